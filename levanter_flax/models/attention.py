"""Causal attention for every model family, with a KV cache for decoding.

A `window` > 0 (Mistral's sliding window) lets each token see only itself and
the window - 1 tokens before it, in training and on the cache alike. Training
calls it on whole sequences. Decoding (`decode=True`) keeps each
layer's keys and values in the "cache" collection: the first call with a
sequence as long as the cache creates it, then each call writes its tokens at
the cache index and attends to everything written so far that is a real token
(`token_mask`: prompts of different lengths are left-padded).

Packed training windows hold several documents; with `segment_ids` (document
masking) each token attends within its own document only, and the models
restart positions per document (`document_positions`), so each document is
computed as if it were alone in the window.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp


def causal_attention(module: nn.Module, q: jax.Array, k: jax.Array, v: jax.Array, *,
                     implementation: str, decode: bool = False,
                     token_mask: jax.Array | None = None, window: int = 0,
                     segment_ids: jax.Array | None = None) -> jax.Array:
  """q [batch, length, heads, head_dim]; k, v [batch, length, kv_heads, head_dim].

  segment_ids [batch, length] (training only): a token attends only to tokens of its own
  segment (document masking). cuDNN takes the mask as an additive bias [batch, 1, length,
  length].
  """
  if not decode:
    mask = None if segment_ids is None else (segment_ids[:, None, :, None]
                                             == segment_ids[:, None, None, :])
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                        implementation=implementation,
                                        local_window_size=(window - 1, 0) if window else None)
  creating = not module.has_variable("cache", "keys")
  keys = module.variable("cache", "keys", jnp.zeros, k.shape, k.dtype)
  values = module.variable("cache", "values", jnp.zeros, v.shape, v.dtype)
  real = module.variable("cache", "real", jnp.zeros, k.shape[:2], jnp.bool_)
  index = module.variable("cache", "index", lambda: jnp.zeros([], jnp.int32))
  if creating:  # model.init with a cache-sized input: shapes only.
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)
  start, length = index.value, q.shape[1]
  if token_mask is None:
    token_mask = jnp.ones(q.shape[:2], jnp.bool_)
  keys.value = jax.lax.dynamic_update_slice(keys.value, k, (0, start, 0, 0))
  values.value = jax.lax.dynamic_update_slice(values.value, v, (0, start, 0, 0))
  real.value = jax.lax.dynamic_update_slice(real.value, token_mask, (0, start))
  index.value = start + length
  slots = jnp.arange(keys.value.shape[1])
  query_slots = start + jnp.arange(length)[:, None]
  visible = slots[None, :] <= query_slots  # [length, cache]: causal.
  if window:  # Prompts are left-padded, so slots after a real token are real: slots count tokens.
    visible &= slots[None, :] > query_slots - window
  mask = visible[None, None] & real.value[:, None, None, :]  # [batch, 1, length, cache]
  return jax.nn.dot_product_attention(q, keys.value, values.value, mask=mask)


def document_positions(segment_ids: jax.Array) -> jax.Array:
  """Each token's position within its segment [batch, length]: 0 where a segment starts."""
  index = jnp.arange(segment_ids.shape[1])
  starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], jnp.bool_),
                            segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
