"""The TPU tier: on a TPU chip, with its own kernels and compiler, what the CPU suite checks in
Pallas' interpreter or on CPU devices: splash attention and the grouped matmul against XLA's
arithmetic, the train step against the CPU's (and int8's products and step), a resume bit for
bit, the engine's greedy tokens and cast_in_layer.

`pytest -m tpu tests/test_tpu.py` on a machine with one chip, in one process (one program at a
time holds the chip): the chip is the default device, and the host's CPU beside it gives the
references (conftest leaves the platform alone in this tier). Skipped anywhere else.

The chip multiplies float32 matrices in one bfloat16 pass by default (XLA's and Mosaic's
kernels alike); references are computed under jax.default_matmul_precision("highest"), and
a kernel run as training runs it is held to a bfloat16 pass's error (BF16_PASS).
"""
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_tiny_config, train_losses
from levanter_flax import models
from levanter_flax.config import settings, to_run_config
from levanter_flax.generate.engine import Engine, SamplingParams
from levanter_flax.generate.trained import run_params
from levanter_flax.models import attention, common, int8, moe
from levanter_flax.models.common import ComputeConfig
from levanter_flax.models.gpt2 import GPT2Config
from levanter_flax.models.llama import LlamaConfig
from levanter_flax.models.mistral import MistralConfig
from levanter_flax.models.mixtral import MixtralConfig
from levanter_flax.models.moe import MoeConfig
from levanter_flax.optim import optimizers
from levanter_flax.parallel import partitioning
from levanter_flax.training import step
from levanter_flax.training.loop import train_and_evaluate
from test_sample import full_forward_greedy

pytestmark = pytest.mark.tpu

# A kernel at the chip's default precision against a reference at full float32: each array's
# largest error, over its largest magnitude. One bfloat16 pass rounds each operand to 8
# significant bits (2**-9 = 0.2% each); through the softmax and the sums of these shapes that
# came to at most 5.8e-3 on a v5e (splash's dq; the mixture's gradients 4.5e-3). A wrong mask,
# block or group is off by tenths: a window one token short moves splash's output by 0.09.
BF16_PASS = 2e-2


def assert_near(got, want, tolerance: float = BF16_PASS):
  """Each leaf's largest error at most `tolerance` times its reference's largest magnitude: a
  bfloat16 pass's errors scale with the operands, not with each element, so an element near
  zero has no relative bound."""
  for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
    w, g = np.asarray(w, np.float64), np.asarray(g, np.float64)
    np.testing.assert_allclose(g, w, rtol=0, atol=tolerance * np.abs(w).max(),
                               err_msg=jax.tree_util.keystr(path))


# Splash attention: blocks of 128 queries and 256 keys over 512 tokens, so that the causal
# mask skips blocks and each kind of block (whole, partial, skipped) occurs; head_dim 128.
BATCH, LENGTH, HEADS, HEAD_DIM = 2, 512, 4, 128
BLOCKS = (128, 256)
# Several documents per row, ending inside and on the edges of the blocks.
SEGMENTS = np.stack([np.repeat([0, 1, 2, 3, 4], [100, 28, 128, 200, 56]),
                     np.repeat([0, 1, 2, 3, 4], [30, 98, 60, 68, 256])])
ATTENTION_CASES = {
    "causal": dict(kv_heads=HEADS),
    "documents": dict(kv_heads=HEADS, segment_ids=SEGMENTS),
    "grouped_query": dict(kv_heads=1),
    "sliding_window": dict(kv_heads=2, window=192),
}


def attend(implementation: str, kv_heads: int, fused_backward: bool = True, **masks):
  """(output, its gradients w.r.t. q, k and v of a weighted sum of it), jitted, for random
  float32 q, k and v."""
  q, k, v = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(q, (BATCH, LENGTH, HEADS, HEAD_DIM))
  k, v = (jax.random.normal(key, (BATCH, LENGTH, kv_heads, HEAD_DIM)) for key in (k, v))
  if implementation == "splash":
    blocks = common.SplashBlocks(*BLOCKS, fused_backward=fused_backward)
    fn = lambda q, k, v: attention.splash_attention(q, k, v, block_sizes=blocks, **masks)
  else:
    fn = lambda q, k, v: attention.causal_attention(None, q, k, v, implementation="xla",
                                                    splash_blocks=BLOCKS, **masks)
  weights = jnp.cos(jnp.arange(HEAD_DIM))  # Every output element counts differently.
  grads = jax.grad(lambda q, k, v: (fn(q, k, v) * weights).sum(), argnums=(0, 1, 2))
  return jax.jit(lambda q, k, v: (fn(q, k, v), grads(q, k, v)))(q, k, v)


@pytest.mark.parametrize("fused_backward", [True, False], ids=["fused_backward", "two_backward"])
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_splash_kernels_compute_what_xla_computes_on_the_chip(case, fused_backward):
  """The Mosaic forward kernel and the backward ones (the fused kernel, the default, or dq's and
  dkv's; the CPU suite interprets them) against XLA's attention at full float32 precision,
  forward and gradients."""
  splash = attend("splash", fused_backward=fused_backward, **ATTENTION_CASES[case])
  with jax.default_matmul_precision("highest"):
    xla = attend("xla", **ATTENTION_CASES[case])
  assert jax.tree.leaves(splash)[0].devices() == {jax.devices()[0]}
  assert_near(splash, xla)


# The train step's model: gpt2:nano's shape, 2 layers. Its 128 tokens let 'auto' attention be
# splash on the chip (XLA's on the CPU).
STEP_MODEL = GPT2Config(vocab_size=384, seq_len=128, num_layers=2, num_heads=4, hidden_dim=128)
# The chip's losses against the CPU's, relative. Its bfloat16 passes of float32 matmuls moved
# 20 steps of gpt2:nano's loss by at most 1.4e-3 on a v5e, and these 3 steps by 2.5e-4 (step 3;
# 5e-5 at step 2). A step that computes something else (a mask, a lost gradient) moves it by
# more than the loss falls here, 0.7 in 2 steps.
CHIP_LOSS_RTOL = 2e-3


def three_losses(devices, model=STEP_MODEL) -> list[float]:
  """The losses of 3 train steps on one batch, on a 1-device mesh of `devices`, from key 0."""
  run = settings.RunConfig(
      model=model, trainer=settings.TrainerConfig(batch_size=8, num_train_steps=3),
      optimizer=optimizers.OptimizerConfig(learning_rate=3e-3, warmup_steps=0,
                                           schedule="constant"))
  partitioner = partitioning.Partitioner(
      partitioning.make_mesh((("data", 1), ("model", 1)), devices[:1]), run.sharding)
  steps = step.build(run, partitioner)
  tokens = np.random.default_rng(0).integers(0, STEP_MODEL.vocab_size, (8, STEP_MODEL.seq_len),
                                             dtype=np.int32)
  losses = []
  with partitioner.activation_context():
    state = steps.init(jax.random.key(0))
    batch = {"tokens": jax.device_put(tokens, steps.batch_sharding)}
    for _ in range(3):
      state, metrics = steps.train_step(state, batch)
      losses.append(float(metrics["train/loss"]))
  assert {d.platform for d in jax.tree.leaves(state)[0].devices()} == {devices[0].platform}
  return losses


def test_the_train_step_on_the_chip_takes_the_cpus_losses():
  """The same model from the same key, the same batch, 3 steps: on the chip (splash, the TPU
  compiler) and on the host's CPU."""
  chip, cpu = three_losses(jax.devices()), three_losses(jax.devices("cpu"))
  np.testing.assert_allclose(chip, cpu, rtol=CHIP_LOSS_RTOL)
  assert cpu[2] < cpu[0] - 0.3  # It learns: the comparison covers the updates.


def test_int8_products_on_the_chip_are_numpys_and_an_int8_step_takes_the_cpus_losses():
  """The chip's int8 x int8 -> int32 products, dense and grouped (ragged_dot, in the groups'
  rows), equal NumPy's exact integer products; the train step with quantization=int8 on the
  chip takes the CPU's losses as the float step does (the quantized operands, rounded from the
  chip's float work, may differ in a rounding step: within the float step's tolerance)."""
  rng = np.random.default_rng(0)
  a, b = (rng.integers(-127, 128, shape, dtype=np.int8) for shape in ((256, 512), (512, 384)))
  product = np.asarray(jax.jit(int8.int32_product)(a, b))
  np.testing.assert_array_equal(product, a.astype(np.int64) @ b.astype(np.int64))
  groups = rng.integers(-127, 128, (3, 512, 384), dtype=np.int8)
  sizes = np.array([100, 0, 120], np.int32)
  grouped = np.asarray(jax.jit(lambda a, w, s: jax.lax.ragged_dot(
      a, w, s, preferred_element_type=jnp.int32))(a, groups, sizes))
  exact = np.concatenate([a[:100].astype(np.int64) @ groups[0].astype(np.int64),
                          a[100:220].astype(np.int64) @ groups[2].astype(np.int64)])
  # The chip left rows after the groups unwritten (moe._grouped_mlp zeroes them).
  np.testing.assert_array_equal(grouped[:220], exact)
  model = common.with_compute(STEP_MODEL, quantization="int8")
  chip, cpu = three_losses(jax.devices(), model), three_losses(jax.devices("cpu"), model)
  np.testing.assert_allclose(chip, cpu, rtol=CHIP_LOSS_RTOL)
  assert cpu[2] < cpu[0] - 0.3


def test_a_run_stopped_at_a_checkpoint_resumes_bit_exact_on_the_chip(data_cache, tmp_path):
  """6 steps straight against 3 steps, stopped at their checkpoint, then resumed to 6 in the same
  workdir: the same losses at every step, and the same final params to the bit. The schedule
  is constant after its warmup, so that stopping at 3 trains the first 3 steps as the straight
  run does."""
  config = make_tiny_config(data_cache)
  config.model.seq_len = 128  # Splash's blocks are multiples of 128 tokens.
  config.model.hidden_dim = 128
  config.optimizer.schedule = "constant"
  config.checkpoint.every_steps = 3
  config.trainer.eval_every_steps = 100
  config.trainer.num_train_steps = 6
  train_and_evaluate(to_run_config(config), tmp_path / "straight")
  config.trainer.num_train_steps = 3
  train_and_evaluate(to_run_config(config), tmp_path / "resumed")
  assert sorted(train_losses(tmp_path / "resumed")) == [1, 2, 3]
  config.trainer.num_train_steps = 6
  train_and_evaluate(to_run_config(config), tmp_path / "resumed")
  assert train_losses(tmp_path / "resumed") == train_losses(tmp_path / "straight")
  assert sorted(train_losses(tmp_path / "straight")) == list(range(1, 7))
  (_, straight, _), (_, resumed, _) = (run_params(tmp_path / d) for d in ("straight", "resumed"))
  jax.tree.map(np.testing.assert_array_equal, resumed, straight)


# XLA's attention for the full forward: 'auto' would choose splash on the chip, whose blocks do
# not tile 24 tokens (decoding attends to the cache either way).
ENGINE_MODELS = {
    "llama": LlamaConfig(vocab_size=50, seq_len=24, num_layers=2, num_heads=4, num_kv_heads=2,
                         hidden_dim=16, intermediate_dim=24,
                         compute=ComputeConfig(attention_impl="xla")),
    # A window shorter than the prompts, scanned layers: a ring cache in the scan.
    "mistral_scanned": MistralConfig(vocab_size=50, seq_len=24, num_layers=2, num_heads=4,
                                     num_kv_heads=2, hidden_dim=16, intermediate_dim=24,
                                     sliding_window=3,
                                     compute=ComputeConfig(attention_impl="xla",
                                                           scan_layers=True)),
}
PROMPTS = [[3, 14, 15, 9, 26], [8, 9], [1, 2, 3, 4, 5, 6, 7], [40]]


@pytest.mark.parametrize("name", ENGINE_MODELS)
def test_the_engines_greedy_tokens_are_the_full_forwards_argmax_on_the_chip(name):
  """2 slots for 4 prompts, prefill chunks of 3, on the chip's cache writes and sampler: each
  continuation the full forward's argmax, token by token. At full float32 precision: a bfloat16
  pass flips near-ties between the two programs."""
  cfg = ENGINE_MODELS[name]
  model = models.build(cfg)
  params = model.init(jax.random.key(1), jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]
  # Larger weights make the next token depend on the context, not only the last token.
  params = jax.tree.map(lambda x: x * 8.0 if x.ndim > 1 else x, params)
  with jax.default_matmul_precision("highest"):
    got = Engine(cfg, params, slots=2, prefill_chunk=3).generate(
        PROMPTS, SamplingParams(max_tokens=8, temperature=0))
    for prompt, request in zip(PROMPTS, got):
      assert request.tokens == full_forward_greedy(model, params, prompt, 8)


# The mixture: 4 experts, 2 per token, widths of 128 and 256 (whole tiles of megablox's 128),
# 2 x 128 tokens: 512 copies in groups that straddle the kernel's 128-row tiles.
MOE_LAYERS = 2


class ScannedMixture(nn.Module):
  """MOE_LAYERS mixture blocks as one nn.scan over params stacked on a leading layer axis, as a
  scanned model holds its layers (the experts' bfloat16 cast and the kernel inside the loop);
  each adds to the residual."""
  config: Any

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scan = nn.scan(lambda block, x, _: (x + block(x), None),
                   variable_axes={name: 0 for name in ("params", *common.SOWN_COLLECTIONS)},
                   split_rngs={"params": True}, length=MOE_LAYERS)
    return scan(moe.MoeBlock(self.config, name="layers"), x, None)[0]


def dense_mixture(cfg, params, x: jax.Array) -> jax.Array:
  """ScannedMixture computed without dispatch: each layer's every expert on every token,
  weighted by the routing (zero for the experts a token did not choose)."""
  for layer in range(MOE_LAYERS):
    p = jax.tree.map(lambda a, layer=layer: a[layer], params["layers"])
    experts, weights, _ = moe.route(cfg.moe, x @ p["gate"]["kernel"])
    weights = (jax.nn.one_hot(experts, cfg.moe.num_experts) * weights[..., None]).sum(-2)
    gate, up, down = (p["experts"][name] for name in ("gate_proj", "up_proj", "down_proj"))
    hidden = (jax.nn.silu(jnp.einsum("bld,edf->blef", x, gate))
              * jnp.einsum("bld,edf->blef", x, up))
    x = x + jnp.einsum("blef,efd,ble->bld", hidden, down, weights)
  return x


def test_scanned_mixture_layers_on_the_grouped_matmul_kernel_compute_the_dense_mixture():
  """Megablox gmm compiled for the chip ('auto' chooses it there), forward and its hand-written
  backward, inside a layer scan: the outputs and the gradients w.r.t. the params and the input
  against every expert on every token at full float32 precision."""
  cfg = MixtralConfig(vocab_size=384, seq_len=128, num_layers=MOE_LAYERS, num_heads=4,
                      num_kv_heads=2, hidden_dim=128, intermediate_dim=256,
                      moe=MoeConfig(num_experts=4, num_experts_per_token=2))
  assert moe.grouped_matmul(cfg.moe) == "gmm"
  block = ScannedMixture(cfg)
  x = jax.random.normal(jax.random.key(1), (2, 128, cfg.hidden_dim))
  params = block.init(jax.random.key(0), x)["params"]
  cosines = jnp.cos(jnp.arange(cfg.hidden_dim))  # Every output element counts differently.

  def outputs_and_grads(apply):
    grads = jax.grad(lambda p, x: (apply(p, x) * cosines).sum(), argnums=(0, 1))
    return jax.jit(lambda p, x: (apply(p, x), grads(p, x)))(params, x)
  kernel = outputs_and_grads(lambda p, x: block.apply({"params": p}, x))
  with jax.default_matmul_precision("highest"):
    dense = outputs_and_grads(lambda p, x: dense_mixture(cfg, p, x))
  assert_near(kernel, dense)


def test_cast_in_layer_is_the_chips_bfloat16_convert_bit_for_bit():
  """On the chip cast_in_layer rounds float32 to bfloat16 by integer arithmetic (so that the
  compiler keeps it in a scanned layer): every bit pattern's result and the gradient are the
  chip's convert's, but for NaNs and subnormal inputs. The chip's convert flushes a subnormal
  (below 2**-126) to zero; ours gives that zero too, or IEEE's rounding where it carries up to
  bfloat16's smallest normal."""
  bits = np.random.default_rng(0).integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
  edges = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001,
                    0x00008000, 0x00018000, 0x3F808000, 0x3F818000, 0x3F808001, 0x7FFFFFFF,
                    0xFFFFFFFF, 0x7FC00000, 0x007FFFFF, 0x807FC000], np.uint32)
  x = np.concatenate([bits, edges]).view(np.float32)
  cast = lambda a: common.cast_in_layer(a, jnp.bfloat16)
  assert "bitcast_convert_type" in str(jax.make_jaxpr(cast)(x[:4]))  # The hand-rounded path.
  ours = np.asarray(jax.jit(cast)(x)).view(np.uint16)
  convert = np.asarray(jax.jit(lambda a: a.astype(jnp.bfloat16))(x)).view(np.uint16)
  nan, subnormal = np.isnan(x), (x != 0) & (np.abs(x) < np.finfo(np.float32).tiny)
  normal = ~nan & ~subnormal
  np.testing.assert_array_equal(ours[normal], convert[normal])
  assert np.isnan(ours[nan].view(jnp.bfloat16).astype(np.float32)).all()
  ieee = x[subnormal].astype(jnp.bfloat16).view(np.uint16)  # NumPy's (ml_dtypes') rounding.
  assert ((ours[subnormal] == convert[subnormal]) | (ours[subnormal] == ieee)).all()
  weights = jnp.arange(4.0)
  grad = lambda cast: jax.grad(lambda a: (cast(a).astype(jnp.float32) * weights).sum())(
      jnp.ones(4))
  ours_grad = grad(cast)
  assert ours_grad.dtype == jnp.float32
  np.testing.assert_array_equal(ours_grad, grad(lambda a: a.astype(jnp.bfloat16)))
