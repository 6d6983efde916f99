"""Causal attention for every model family, with a KV cache for decoding.

A `window` > 0 (Mistral's sliding window) lets each token see only itself and
the window - 1 tokens before it, in training and on the cache alike; `windowed` says whether it
applies, per layer (Gemma 3's local layers have it, its global ones not), and may be traced (a
scanned stack's per-layer input: training then runs both masks' kernels under a lax.cond, which
executes one). Training calls it on whole sequences. Decoding (`decode=True`) keeps each
layer's keys and values in the "cache" collection: the first call with a sequence as long as
the cache creates it, then each call writes each row's tokens at that row's index and attends
to everything written before them (generate/engine.py: each row is a slot, at its own
position). A layer whose window always applies caches only the window, a ring.

Packed training windows hold several documents; with `segment_ids` (document
masking) each token attends within its own document only, and the models
restart positions per document (`document_positions`), so each document is
computed as if it were alone in the window.

On TPUs, training attention may run as Pallas splash attention (`splash_attention`), a
blockwise kernel that skips the blocks its mask leaves out: it runs per device inside a
shard_map over the mesh in context.
"""
import concurrent.futures
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec

from levanter_flax.core.errors import UserError
from levanter_flax.models.common import (SPLASH_BLOCK_MULTIPLE, SplashBlocks,
                                         check_attention_platform, platform_in_context)


def causal_attention(module: nn.Module, q: jax.Array, k: jax.Array, v: jax.Array, *,
                     implementation: str, splash_blocks: SplashBlocks | tuple[int, int],
                     decode: bool = False, token_mask: jax.Array | None = None, window: int = 0,
                     segment_ids: jax.Array | None = None,
                     windowed: bool | jax.Array = True, scale: float | None = None,
                     cache_dtype=None) -> jax.Array:
  """q [batch, length, heads, head_dim]; k, v [batch, length, kv_heads, head_dim] (v's head_dim
  may differ: DeepSeek's; in training only). scale: of the scores, by default head_dim ** -0.5.
  cache_dtype: decoding's cache's (common.cache_dtype), by default k's.

  implementation: xla, cudnn or splash (common.attention_implementation), for training;
  splash_blocks: splash's kernel blocks (common.SplashBlocks). segment_ids [batch, length]
  (training only): a token attends only to tokens of its own segment (document masking).
  cuDNN takes the mask as an additive bias [batch, 1, length, length]. windowed: whether
  `window` applies to this layer, a bool or a traced boolean scalar.
  """
  if windowed is False:
    window = 0
  traced = window and not isinstance(windowed, bool)
  if traced and not decode:  # Each kernel with its static mask; the cond runs one.
    attend = lambda w: lambda q, k, v, s: causal_attention(
        module, q, k, v, implementation=implementation, splash_blocks=splash_blocks, window=w,
        segment_ids=s, scale=scale)
    return jax.lax.cond(windowed, attend(window), attend(0), q, k, v, segment_ids)
  if not decode and implementation == "splash":
    return splash_attention(q, k, v, window=window, segment_ids=segment_ids,
                            block_sizes=splash_blocks, scale=scale)
  if not decode:
    mask = None if segment_ids is None else (segment_ids[:, None, :, None]
                                             == segment_ids[:, None, None, :])
    value_dim = v.shape[-1]
    if value_dim != k.shape[-1]:  # jax.nn's takes values as wide as the keys: padded with zeros.
      v = jnp.pad(v, ((0, 0),) * 3 + ((0, k.shape[-1] - value_dim),))
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, scale=scale,
                                        implementation=implementation,
                                        local_window_size=(window - 1, 0) if window else None
                                        )[..., :value_dim]
  cache, mask = append_to_cache(module, {"keys": k, "values": v}, token_mask, window, windowed,
                                dtype=cache_dtype)
  if cache is None:  # model.init with a cache-sized input: shapes only.
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)
  return attend_to_cache(q, cache["keys"], cache["values"], mask, scale)


def attend_to_cache(q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array,
                    scale: float | None = None) -> jax.Array:
  """q [batch, length, heads, head_dim] against a cache of keys and values [batch, kv_heads,
  cache, head_dim] (heads-major: each head's keys are contiguous, so the scores' dot reads
  the cache as it lies), each key/value head serving heads / kv_heads query heads; mask [batch,
  1, length, cache]. Scores and softmax in float32, as jax.nn.dot_product_attention's."""
  batch, length, heads, head_dim = q.shape
  kv_heads = keys.shape[1]
  q = q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)
  scores = jnp.einsum("blkgd,bksd->bkgls", q, keys, preferred_element_type=jnp.float32)
  scores = scores * (head_dim ** -0.5 if scale is None else scale)
  scores = jnp.where(mask[:, :, None], scores, jnp.finfo(jnp.float32).min)
  # A cache narrower than the compute dtype (compute.cache_dtype) is read and widened.
  dtype = jnp.promote_types(q.dtype, values.dtype)
  weights = jax.nn.softmax(scores, axis=-1).astype(dtype)
  out = jnp.einsum("bkgls,bksd->blkgd", weights, values.astype(dtype))
  return out.reshape(batch, length, heads, -1).astype(q.dtype)


def append_to_cache(module: nn.Module, entries: dict[str, jax.Array],
                    token_mask: jax.Array | None, window: int = 0,
                    windowed: bool | jax.Array = True, dtype=None
                    ) -> tuple[dict[str, jax.Array] | None, jax.Array | None]:
  """Writes `entries` (name: [batch, length, ...], the new tokens') into `module`'s "cache"
  collection (per-head ones heads-major, [batch, heads, cache, d]), each row at its own index
  (`index` [batch]: a row is a generation engine's slot, at its own position), and moves each
  row's index past its real tokens (token_mask [batch, length], by default all), as `dtype`
  (by default the entries'). A row's
  padding comes after its real tokens and is not written, nor is anything past the cache's end.

  Returns (the entries to attend to, the mask [batch, 1, length, their positions] of those each
  new token sees: causal, within `window` where `windowed`), or (None, None) while model.init
  creates the cache. A layer whose window always applies (`windowed` True, not traced) keeps
  only its last `window` positions, a ring (_ring_append); any other keeps whole rows and
  returns them, written."""
  first = next(iter(entries.values()))
  batch, length = first.shape[:2]
  ring = window if window and windowed is True else 0
  creating = not module.has_variable("cache", next(iter(entries)))
  cache = {name: module.variable("cache", name, jnp.zeros, _cached_shape(value.shape, ring),
                                 dtype or value.dtype)
           for name, value in entries.items()}
  index = module.variable("cache", "index", jnp.zeros, (batch,), jnp.int32)
  if creating:
    return None, None
  start = index.value
  real = (jnp.ones((batch, length), bool) if token_mask is None else token_mask.astype(bool))
  index.value = start + real.sum(axis=1, dtype=jnp.int32)
  if ring:
    return _ring_append(cache, entries, start, real, ring)
  query_positions = start[:, None] + jnp.arange(length)[None]  # [batch, length]
  slots = jnp.arange(_cache_length(cache[next(iter(entries))].value))
  _write(cache, entries, jnp.where(real, query_positions, len(slots)))
  visible = slots <= query_positions[..., None]  # [batch, length, cache]: causal.
  if window:
    near = slots > query_positions[..., None] - window
    visible &= near if isinstance(windowed, bool) else near | ~windowed
  return {name: variable.value for name, variable in cache.items()}, visible[:, None]


def _ring_append(cache: dict, entries: dict[str, jax.Array], start: jax.Array, real: jax.Array,
                 window: int) -> tuple[dict[str, jax.Array], jax.Array]:
  """append_to_cache for a sliding-window layer whose cache is a ring of `window` positions
  (or fewer, while every position so far is below their count): position p lies in slot
  p % window.

  One token (a decode step) is written first and attends to the ring: it overwrites position
  p - window, which its window has just left, and the write is in place. Several would
  overwrite positions the earlier of them still see, so they attend to the ring as it was,
  then to themselves (a chunk longer than the window sees each of its own tokens), and then
  each row's last `window` real tokens are written (earlier ones would share their slots)."""
  length = real.shape[1]
  query_positions = start[:, None] + jnp.arange(length)[None]  # [batch, length]
  slots = jnp.arange(_cache_length(cache[next(iter(entries))].value))
  if length == 1:
    _write(cache, entries, jnp.where(real, jnp.mod(query_positions, window), len(slots)))
    # The position each slot holds now: the latest up to the token's of its residue.
    held = query_positions - jnp.mod(query_positions - slots[None], window)  # [batch, ring]
    return ({name: variable.value for name, variable in cache.items()},
            (held >= 0)[:, None, None, :])
  # The position each slot held before these tokens: the latest below `start` of its residue
  # (negative: none yet, or a former request's, which a reused slot must not see).
  held = start[:, None] - 1 - jnp.mod(start[:, None] - 1 - slots[None], window)  # [batch, ring]
  before = {name: variable.value for name, variable in cache.items()}
  last = real & (jnp.arange(length)[None] >= real.sum(axis=1, keepdims=True) - window)
  _write(cache, entries, jnp.where(last, jnp.mod(query_positions, window), len(slots)))
  key_positions = jnp.concatenate([held, query_positions], axis=1)  # [batch, ring + length]
  keys_at = key_positions[:, None, :]
  queries_at = query_positions[..., None]
  visible = ((keys_at <= queries_at) & (keys_at > queries_at - window)
             & jnp.concatenate([held >= 0, real], axis=1)[:, None, :])
  attended = {name: jnp.concatenate([before[name], _as_cached(entries[name], before[name].dtype)],
                                    axis=2 if entries[name].ndim == 4 else 1)
              for name in entries}
  return attended, visible[:, None]


def _write(cache: dict, entries: dict[str, jax.Array], written: jax.Array) -> None:
  """Each row's new entries into the cache at positions `written` [batch, length]; those out of
  its bounds are dropped. Several tokens a row (a prefill chunk) are scattered in. One token a
  row (a decode step) on a TPU is selected in, position by position, in whatever layout
  attention's product keeps the cache: that reads and writes each layer's whole cache, but a
  scatter there made XLA copy each layer's keys and values to another layout and back as
  well, every step (12.4 ms a step at 128 slots on a v5e chip, against 1.8 to read what it
  must; docs/serving.md). Elsewhere a scatter writes in place."""
  select = written.shape[1] == 1 and platform_in_context() == "tpu"
  for name, value in entries.items():
    stored = cache[name].value
    if select:
      at = (jnp.arange(_cache_length(stored)) == written)  # [batch, cache]
      at = at[:, None, :, None] if stored.ndim == 4 else at.reshape(
          at.shape + (1,) * (stored.ndim - 2))
      cache[name].value = jnp.where(at, _as_cached(value, stored.dtype), stored)
    else:
      # Per-head entries [batch, length, heads, d] go to [batch, heads, cache, d]: the indexed
      # positions come first in the update, as the new tokens' entries lie.
      rows = jnp.arange(written.shape[0])[:, None]
      where = (rows, slice(None), written) if value.ndim == 4 else (rows, written)
      cache[name].value = stored.at[where].set(value.astype(stored.dtype), mode="drop")


def _as_cached(value: jax.Array, dtype) -> jax.Array:
  """New tokens' entries [batch, length, ...] laid out as the cache's (_cached_shape)."""
  return (value.transpose(0, 2, 1, 3) if value.ndim == 4 else value).astype(dtype)


def _cached_shape(shape: tuple[int, ...], ring: int = 0) -> tuple[int, ...]:
  """How an entry of `shape` [batch, length, ...] is cached: per-head ones ([batch, length,
  heads, d]) heads-major, [batch, heads, length, d]; others as they are. A ring keeps at most
  `ring` positions."""
  length = min(shape[1], ring) if ring else shape[1]
  return ((shape[0], shape[2], length, shape[3]) if len(shape) == 4
          else (shape[0], length, *shape[2:]))


def _cache_length(stored: jax.Array) -> int:
  return stored.shape[2] if stored.ndim == 4 else stored.shape[1]


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                     block_sizes: SplashBlocks | tuple[int, int],
                     window: int = 0, segment_ids: jax.Array | None = None,
                     interpret: bool = False, scale: float | None = None) -> jax.Array:
  """causal_attention's training path as Pallas splash attention, on each device's shard.

  Shapes as causal_attention's. Inside a shard_map over the mesh in context (none: the whole
  arrays), with the layout the logical axis rules in force give: the batch on its axes, the
  heads on theirs (the key/value heads too where they divide), and the length on its axes
  (context parallelism): each device keeps its share of the queries and gathers the keys and
  values of the whole sequence, and the kernel, built for the query shards, masks by global
  positions. Axes that do not divide their dimension are left out: that dimension is whole.

  interpret: run the kernel in Pallas' interpreter, on any device (tests); otherwise the mesh
  in context must be a TPU's.
  """
  if not interpret:
    check_attention_platform("splash", platform_in_context())
  batch, length, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  mesh = jax.sharding.get_abstract_mesh()
  batch_axes = length_axes = head_axes = ()
  if not mesh.empty:
    batch_axes, length_axes, head_axes = (
        _dividing_axes(mesh, axes, size) for axes, size in
        zip(nn.logical_to_mesh_axes(("batch", "length", "heads")), (batch, length, num_heads)))
  kv_head_axes = head_axes if num_kv_heads % _size(mesh, head_axes) == 0 else ()
  q_shards = _size(mesh, length_axes)
  blocks = SplashBlocks(*block_sizes)
  kernel = _splash_kernel(
      num_heads, length, window,
      _splash_block(blocks.q, length // q_shards, "splash_block_q"),
      _splash_block(blocks.kv, length, "splash_block_kv"), blocks.fused_backward,
      _size(mesh, head_axes), q_shards, interpret)
  q = q * jnp.asarray(head_dim ** -0.5 if scale is None else scale, q.dtype)  # It does not.

  def attend(kernel, q, k, v, *segments):
    """One device's queries against its keys and values, all [batch, length, heads, head_dim]."""
    if k.shape[2] * (num_heads // num_kv_heads) != q.shape[2]:
      # The query heads are split but the key/value heads are whole: each query head takes its own.
      first = jax.lax.axis_index(head_axes) * q.shape[2]
      kv_heads = (first + jnp.arange(q.shape[2])) // (num_heads // num_kv_heads)
      k, v = jnp.take(k, kv_heads, axis=2), jnp.take(v, kv_heads, axis=2)
    heads_first = lambda x: x.transpose(0, 2, 1, 3)  # The kernel's [heads, length, head_dim].
    segment_ids = splash.SegmentIds(*segments) if segments else None
    return heads_first(jax.vmap(kernel)(heads_first(q), heads_first(k), heads_first(v),
                                        segment_ids))

  segments = () if segment_ids is None else (segment_ids, segment_ids)
  if mesh.empty:
    return attend(kernel, q, k, v, *segments)
  spec = lambda *axes: PartitionSpec(*(entry or None for entry in axes))
  q_spec = spec(batch_axes, length_axes, head_axes, ())
  kv_spec = spec(batch_axes, (), kv_head_axes, ())  # The whole sequence on every device.
  segment_specs = () if segment_ids is None else (spec(batch_axes, length_axes),
                                                  spec(batch_axes, ()))
  kernel_spec = kernel.manual_sharding_spec(
      jax.sharding.NamedSharding(mesh, spec(head_axes, length_axes)))
  return jax.shard_map(attend, mesh=mesh, out_specs=q_spec, check_vma=False,
                       in_specs=(kernel_spec, q_spec, kv_spec, kv_spec, *segment_specs))(
                           kernel, q, k, v, *segments)


def _dividing_axes(mesh: jax.sharding.AbstractMesh, axes, size: int) -> tuple[str, ...]:
  """A PartitionSpec entry's mesh axes as a tuple, or none if they do not divide size."""
  axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  return axes if size % _size(mesh, axes) == 0 else ()


def _size(mesh: jax.sharding.AbstractMesh, axes: tuple[str, ...]) -> int:
  return math.prod(mesh.shape[axis] for axis in axes)


def _splash_block(size: int, length: int, key: str) -> int:
  """A block of `size` rows (config.model.compute.<key>), clipped to the `length` it tiles."""
  block = min(size, length)
  if length % block or block % SPLASH_BLOCK_MULTIPLE:
    raise UserError(f"config.model.compute.{key} ({size}) does not tile the {length} tokens of "
                    f"a sequence (per sequence shard): splash attention needs a multiple of it, "
                    f"or of {SPLASH_BLOCK_MULTIPLE} when shorter (config.model.seq_len; or set "
                    f"config.model.compute.attention_impl='xla')")
  return block


@functools.cache
def _splash_kernel(num_heads: int, length: int, window: int, block_q: int, block_kv: int,
                   fused_backward: bool, head_shards: int, q_shards: int, interpret: bool):
  """The causal (or sliding-window) splash kernel for `head_shards` x `q_shards` devices.

  Cached: every layer asks for the same one, and building it works through the mask's blocks
  on the host (seconds for a long sequence). Its mask tables are kept as numpy arrays,
  constants of any trace, which shard_map splits as the kernel's manual_sharding_spec says.
  It is built in a thread of its own, where no trace and no mesh are in context (both are
  per thread): the kernel makes its tables jax arrays, which in the caller's thread would be
  a trace's values, or be placed on the mesh's devices, which an ahead-of-time compile for a
  TPU on a CPU host does not have.
  """
  def build():
    shape = (length, length)
    # The XLA path's local_window_size=(window - 1, 0): a token and the window - 1 before it.
    mask = (splash.LocalMask(shape, (window - 1, 0), offset=0) if window
            else splash.CausalMask(shape))
    dq_blocks = {} if fused_backward else dict(block_q_dq=block_q, block_kv_dq=block_kv)
    blocks = splash.BlockSizes(block_q=block_q, block_kv=block_kv, block_q_dkv=block_q,
                               block_kv_dkv=block_kv, use_fused_bwd_kernel=fused_backward,
                               **dq_blocks)
    kernel = splash.make_splash_mha(splash.MultiHeadMask([mask] * num_heads),
                                    block_sizes=blocks, head_shards=head_shards,
                                    q_seq_shards=q_shards, interpret=interpret)
    return jax.tree.map(np.asarray, kernel)
  with concurrent.futures.ThreadPoolExecutor(1) as thread:
    return thread.submit(build).result()


def document_positions(segment_ids: jax.Array) -> jax.Array:
  """Each token's position within its segment [batch, length]: 0 where a segment starts."""
  index = jnp.arange(segment_ids.shape[1])
  starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], jnp.bool_),
                            segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
