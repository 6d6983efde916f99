"""Splash attention (model.compute.attention_impl="splash"): the XLA path's numbers, run in
Pallas' interpreter on CPU devices (the sequence split too); Mosaic kernels when compiled for a
TPU topology on this CPU host; one line on a mesh of other devices."""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from levanter_flax.parallel import partitioning
from levanter_flax.config import settings
from levanter_flax.training import step
from levanter_flax.core.errors import UserError
from levanter_flax.models import FAMILIES, attention, build, common
from levanter_flax.models.llama import LlamaConfig

BATCH, LENGTH, HEADS, KV_HEADS, HEAD_DIM = 2, 256, 4, 2, 64
BLOCKS = (128, 128)
# Several documents per row, ending inside and on the edges of the 128-token blocks.
SEGMENTS = np.stack([np.repeat([0, 1, 2], [100, 28, 128]),
                     np.repeat([0, 1, 2, 3], [30, 98, 60, 68])])
# float32 throughout; the two paths sum in different orders (blockwise online softmax vs whole).
TOLERANCE = dict(rtol=1e-4, atol=1e-5)


def qkv(kv_heads: int = KV_HEADS):
  q, k, v = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(q, (BATCH, LENGTH, HEADS, HEAD_DIM)),
          jax.random.normal(k, (BATCH, LENGTH, kv_heads, HEAD_DIM)),
          jax.random.normal(v, (BATCH, LENGTH, kv_heads, HEAD_DIM)))


def attend(implementation: str, blocks=BLOCKS, **masks):
  """(q, k, v) -> (output, its gradients w.r.t. q, k and v of a weighted sum of it), jitted."""
  if implementation == "splash":
    fn = lambda q, k, v: attention.splash_attention(q, k, v, block_sizes=blocks, interpret=True,
                                                    **masks)
  else:
    fn = lambda q, k, v: attention.causal_attention(None, q, k, v, implementation="xla",
                                                    splash_blocks=BLOCKS, **masks)
  weights = jnp.cos(jnp.arange(HEAD_DIM))  # Every output element counts differently.
  grads = jax.grad(lambda q, k, v: (fn(q, k, v) * weights).sum(), argnums=(0, 1, 2))
  return jax.jit(lambda q, k, v: (fn(q, k, v), grads(q, k, v)))


def assert_same(splash, xla):
  for got, want in zip(jax.tree.leaves(splash), jax.tree.leaves(xla)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOLERANCE)


MASKS = {"causal": {}, "documents": {"segment_ids": SEGMENTS}, "window": {"window": 64}}


@pytest.mark.parametrize("mask", MASKS)
def test_splash_computes_what_xla_computes(mask):
  inputs = qkv()
  assert_same(attend("splash", **MASKS[mask])(*inputs), attend("xla", **MASKS[mask])(*inputs))


def test_the_two_backward_kernels_compute_what_the_fused_one_does():
  """config.model.compute.splash_fused_backward=false: a kernel for dq, another for dk and dv
  (the other tests run the default, one kernel for all three)."""
  inputs, masks = qkv(), MASKS["documents"]
  two = attend("splash", common.SplashBlocks(*BLOCKS, fused_backward=False), **masks)(*inputs)
  assert_same(two, attend("xla", **masks)(*inputs))


def test_values_narrower_than_keys_and_a_scale_of_their_own_as_deepseeks():
  """DeepSeek's latent attention: values half as wide as the keys, scores scaled by a factor of
  their own; both paths against attention written out (the XLA path pads the values)."""
  q, k, v = qkv()
  v, scale = v[..., :HEAD_DIM // 2], 0.3
  repeat = lambda x: jnp.repeat(x, HEADS // KV_HEADS, axis=2)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, repeat(k)) * scale
  causal = jnp.tril(jnp.ones((LENGTH, LENGTH), bool))
  expected = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(causal, scores, -jnp.inf)),
                        repeat(v))
  splash = attention.splash_attention(q, k, v, block_sizes=BLOCKS, interpret=True, scale=scale)
  xla = attention.causal_attention(None, q, k, v, implementation="xla", splash_blocks=BLOCKS,
                                   scale=scale)
  for got in (splash, xla):
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), **TOLERANCE)


@pytest.mark.parametrize("mask, kv_heads", [("documents", KV_HEADS), ("window", 1)])
def test_splash_on_a_mesh_with_the_sequence_split_computes_what_xla_computes(mask, kv_heads):
  """data=2 x sequence=2 x model=2: each device has its rows, heads and quarter of the queries,
  gathers the keys and values, and masks by global positions. One key/value head does not
  split over the model axis: each device takes the one its query heads share."""
  mesh = partitioning.make_mesh((("data", 2), ("sequence", 2), ("model", 2)))
  partitioner = partitioning.Partitioner(mesh, partitioning.ShardingConfig(
      logical_axis_rules=(("length", "sequence"),)))
  inputs = qkv(kv_heads)
  with partitioner.activation_context():
    splash = attend("splash", **MASKS[mask])(*inputs)
  assert_same(splash, attend("xla", **MASKS[mask])(*inputs))


def test_auto_is_splash_on_a_tpu_cudnn_on_a_gpu_in_16_bits_else_xla():
  cfg = lambda dtype: tiny_llama(attention_impl="auto", dtype=dtype)
  assert common.attention_implementation(cfg("float32"), "tpu") == "splash"
  assert common.attention_implementation(cfg("bfloat16"), "gpu") == "cudnn"
  assert common.attention_implementation(cfg("float32"), "gpu") == "xla"
  assert common.attention_implementation(cfg("bfloat16"), "cpu") == "xla"


def tiny_llama(architecture: str = "llama", model_fields: dict | None = None,
               **compute) -> LlamaConfig:
  """A tiny model of the Llama kind: Llama's, or a family's built on its module (QK-norm), or
  Gemma 3's; model_fields: the family's own settings."""
  return FAMILIES[architecture].config(
      vocab_size=256, seq_len=LENGTH, num_layers=2, num_heads=HEADS, num_kv_heads=KV_HEADS,
      hidden_dim=HEADS * HEAD_DIM, intermediate_dim=256, **(model_fields or {}),
      compute=common.ComputeConfig(splash_block_q=BLOCKS[0], splash_block_kv=BLOCKS[1],
                                   **compute))


def train_step_hlo(devices, device_mesh, sharding=partitioning.ShardingConfig(), eos_id=None,
                   architecture="llama", model_fields=None, **compute) -> str:
  """The tiny Llama's train step, compiled by step.build for a mesh over `devices`."""
  run = settings.RunConfig(model=tiny_llama(architecture, model_fields, **compute),
                           sharding=sharding,
                           trainer=settings.TrainerConfig(batch_size=4, num_train_steps=10))
  partitioner = partitioning.Partitioner(partitioning.make_mesh(device_mesh, devices), sharding)
  steps = step.build(run, partitioner, eos_id)
  with partitioner.activation_context():
    return steps.train_step.lower(*steps.abstract_inputs(4)).compile().as_text()


@pytest.fixture(scope="module")
def tpu_devices():
  """A TPU v5e's 2x2 slice, described by libtpu: compiled for, never run."""
  pytest.importorskip("libtpu")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  return topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices


def mosaic_calls(hlo: str) -> int:
  return len(re.findall(r'custom_call_target="tpu_custom_call"', hlo))


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["llama", "qwen3", "olmo2"])
def test_auto_compiles_each_layers_attention_to_mosaic_kernels_for_a_tpu(tpu_devices,
                                                                         architecture):
  """On this CPU host, 'auto' is splash for the TPU mesh: per layer a forward and a backward
  kernel (the fused one: dq, dk and dv together); XLA's attention has none (Llama's, for every
  family). QK-norm changes nothing in the kernels."""
  mesh = (("data", 2), ("model", 2))
  assert mosaic_calls(train_step_hlo(tpu_devices, mesh, architecture=architecture,
                                     attention_impl="auto")) == 2 * 2
  if architecture == "llama":
    assert mosaic_calls(train_step_hlo(tpu_devices, mesh, architecture=architecture,
                                       attention_impl="xla")) == 0


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [False, True])
def test_gemma3s_local_and_global_layers_compile_to_mosaic_kernels_for_a_tpu(tpu_devices,
                                                                             scan_layers):
  """A local layer (splash's LocalMask, a window of 128 of the 256 tokens) and a global one
  (CausalMask), with document masking. Unrolled, each layer's kind is static: a forward and a
  backward kernel each. Scanned, the kind is the scan's per-layer input, and a lax.cond holds both
  masks' kernels (it runs one): the same four calls, in the one scanned block."""
  mesh = (("data", 2), ("model", 2))
  hlo = train_step_hlo(tpu_devices, mesh, eos_id=0, architecture="gemma3",
                       model_fields=dict(sliding_window=128, sliding_window_pattern=2),
                       attention_impl="auto", scan_layers=scan_layers)
  assert mosaic_calls(hlo) == 2 * 2


def test_context_parallel_splash_compiles_for_a_tpu(tpu_devices):
  """data=2 x sequence=2, the length on the sequence axis, document masking, scanned layers."""
  hlo = train_step_hlo(tpu_devices, (("data", 2), ("sequence", 2)), partitioning.ShardingConfig(
      tensor_axis=None, logical_axis_rules=(("length", "sequence"),)), eos_id=0,
      attention_impl="splash", scan_layers=True)
  assert mosaic_calls(hlo) == 2  # A forward and a backward kernel.


def test_splash_off_a_tpu_is_one_line():
  message = r"config.model.compute.attention_impl 'splash' runs on TPU only; this mesh's devices "
  with pytest.raises(UserError, match=message + "are cpu"):
    train_step_hlo(jax.devices()[:1], (("data", 1), ("model", 1)), attention_impl="splash")
  cfg = tiny_llama(attention_impl="splash")
  tokens = jnp.zeros((1, LENGTH), jnp.int32)
  with pytest.raises(UserError, match=message):
    build(cfg).init(jax.random.key(0), tokens)


def test_blocks_that_do_not_tile_the_sequence_are_named():
  with pytest.raises(UserError, match=r"config.model.compute.splash_block_q must be a positive "
                     r"multiple of 128; got 100"):
    common.ComputeConfig(splash_block_q=100)
  q, k, v = (x[:, :192] for x in qkv())
  with pytest.raises(UserError, match=r"config.model.compute.splash_block_q \(128\) does not "
                     r"tile the 192 tokens of a sequence"):
    attention.splash_attention(q, k, v, block_sizes=BLOCKS, interpret=True)
