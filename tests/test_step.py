"""Speed and memory knobs change cost, not results: accumulation, remat, precision, FLOP counts."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from levanter_flax.objectives import dpo, next_token
from levanter_flax.core import flops
from levanter_flax.monitoring import metrics
from levanter_flax import models
from levanter_flax.optim import optimizers
from levanter_flax.parallel import partitioning
from levanter_flax.training import step
from levanter_flax.models import lora
from levanter_flax.models.common import ComputeConfig, with_compute, REMAT_POLICIES
from levanter_flax.models.lora import LoraConfig
from levanter_flax.models.gpt2 import GPT2Config, GPT2LMHeadModel
from levanter_flax.models import moe
from levanter_flax.models.moe import MoeConfig
from conftest import COMPOSED_FAMILIES, deepseek_sizes

TINY = GPT2Config(vocab_size=128, seq_len=32, num_layers=2, num_heads=4, hidden_dim=64)


def params_and_tokens(cfg: GPT2Config, batch_size: int = 8):
  tokens = jax.random.randint(jax.random.key(1), (batch_size, cfg.seq_len), 0, cfg.vocab_size)
  return GPT2LMHeadModel(cfg).init(jax.random.key(0), tokens)["params"], tokens


def loss_and_grads(cfg: GPT2Config, num_microbatches: int = 1):
  params, tokens = params_and_tokens(cfg)
  fn = jax.jit(lambda p, t: step.accumulated_loss_and_grads(GPT2LMHeadModel(cfg), p,
                                                            {"tokens": t}, num_microbatches))
  parts, grads = fn(params, tokens)
  return parts["loss"], grads


def assert_trees_close(a, b, tolerance):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tolerance, atol=tolerance)


# Knobs that trade memory or speed and must not change the result: gradient
# accumulation, each remat policy, and the blockwise loss (vocab 128 is split
# evenly by 32, unevenly by 50 (padding), and is one block at 128).
SAME_RESULT = ([({}, n) for n in (2, 4, 8)]
               + [({"remat": p}, 1) for p in REMAT_POLICIES if p not in ("none", "offload")]
               + [({"cross_entropy_block_size": b}, 1) for b in (32, 50, 128)])


@pytest.mark.slow
@pytest.mark.parametrize("change, num_microbatches", SAME_RESULT, ids=str)
def test_cost_knobs_give_the_same_loss_and_gradients(change, num_microbatches):
  loss, grads = loss_and_grads(TINY)
  new_loss, new_grads = loss_and_grads(with_compute(TINY, **change), num_microbatches)
  assert float(new_loss) == pytest.approx(float(loss), rel=1e-6)
  assert_trees_close(new_grads, grads, 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("weighted", [False, True], ids=["mean", "loss_weights"])
def test_gradients_kept_apart_over_an_axis_until_the_step_end_are_the_same(weighted):
  """Multi-slice accumulation (step._cross_slice_batch_axis): each data shard's gradients summed
  over the microbatches apart, reduced once; here over the data axis of 8 fake devices."""
  partitioner = partitioning.Partitioner(
      partitioning.make_mesh((("data", 4), ("model", 2))), partitioning.ShardingConfig())
  params, tokens = params_and_tokens(TINY, batch_size=16)
  weights = (jax.random.uniform(jax.random.key(2), tokens.shape) < 0.5).astype(jnp.float32)
  model = GPT2LMHeadModel(TINY)

  def run(unreduced):
    with partitioner.activation_context():
      return jax.jit(lambda p, t, w: step.accumulated_loss_and_grads(
          model, p, {"tokens": t, "loss_weights": w} if weighted else {"tokens": t}, 4,
          objective=next_token.NextToken(weighted), unreduced=unreduced))(params, tokens, weights)
  (parts, grads), (apart, apart_grads) = run(None), run(("data", 4))
  assert float(apart["loss"]) == pytest.approx(float(parts["loss"]), rel=1e-6)
  assert_trees_close(apart_grads, grads, 1e-5)


# What a family's tiny model needs beyond the shared sizes to exercise it: Gemma 3's local
# and global layers (3 layers: local, global, local) with a window shorter than the sequence.
FAMILY_SIZES = {"gemma3": dict(sliding_window=8, sliding_window_pattern=2),
                "deepseek_v3": deepseek_sizes()}


LAYER_FAMILIES = sorted(set(models.FAMILIES) - COMPOSED_FAMILIES)


def tiny(family: str, **sizes):
  """A tiny model of any registered family: each takes the sizes it has fields for (head_dim:
  Qwen3's and Gemma 3's, not hidden_dim / num_heads)."""
  sizes = dict(vocab_size=128, seq_len=32, num_layers=3, num_heads=4, num_kv_heads=2,
               hidden_dim=64, intermediate_dim=96, head_dim=24) | FAMILY_SIZES.get(family, {}) | sizes
  config = models.FAMILIES[family].config
  return config(**{k: v for k, v in sizes.items() if k in {f.name for f in dataclasses.fields(config)}})


@pytest.mark.slow
@pytest.mark.parametrize("family", LAYER_FAMILIES)
def test_scanning_the_layers_leaves_the_run_unchanged(family):
  """The same seed gives the same parameters, loss and gradients with scan_layers on or off."""
  cfg = tiny(family)
  scanned_cfg = with_compute(cfg, scan_layers=True)
  tokens = jax.random.randint(jax.random.key(1), (4, cfg.seq_len), 0, cfg.vocab_size)
  results = []
  for c in (cfg, scanned_cfg):
    params = models.init_params(c, jax.random.key(0))
    results.append((params, *jax.jit(lambda p, t, c=c: step.accumulated_loss_and_grads(
        models.build(c), p, {"tokens": t}, 1))(params, tokens)))
  (params, parts, grads), (scanned_params, scanned_parts, scanned_grads) = results
  assert_trees_close(models.unstack_layers(cfg, scanned_params), params, 0)
  # Sigmoid routing's loads per expert, by block: a scanned stack's [layers, experts] at once.
  loads, scanned_loads = ({**p}.pop(moe.BALANCE, {}) for p in (parts, scanned_parts))
  assert_trees_close(list(scanned_loads.values()), [np.stack(list(loads.values()))] if loads else [],
                     0)
  others = lambda p: {name: value for name, value in p.items() if name != moe.BALANCE}
  assert_trees_close(others(scanned_parts), others(parts), 1e-6)  # A mixture's router_aux_loss too.
  assert_trees_close(models.unstack_layers(cfg, scanned_grads), grads, 1e-5)


@pytest.mark.slow
def test_accumulation_lowers_peak_memory():
  cfg = dataclasses.replace(TINY, vocab_size=2048, seq_len=128)
  params, tokens = params_and_tokens(cfg, batch_size=32)
  optimizer = optax.adamw(1e-3)
  state = step.TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
  temp_bytes = []
  for num_microbatches in (1, 4):
    train_step = step.make_train_step(GPT2LMHeadModel(cfg), optimizer, lambda _: 1e-3,
                                      num_microbatches)
    compiled = jax.jit(train_step).lower(state, {"tokens": tokens}).compile()
    temp_bytes.append(compiled.memory_analysis().temp_size_in_bytes)
  assert temp_bytes[1] < temp_bytes[0] / 2, temp_bytes


@pytest.mark.slow
def test_bfloat16_compute_keeps_parameters_and_loss_in_float32():
  cfg = with_compute(TINY, dtype="bfloat16")
  params, tokens = params_and_tokens(cfg)
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}
  logits = GPT2LMHeadModel(cfg).apply({"params": params}, tokens)
  assert logits.dtype == jnp.bfloat16
  loss, grads = loss_and_grads(cfg)
  full_loss, _ = loss_and_grads(TINY)
  assert loss.dtype == jnp.float32
  assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype("float32")}
  assert float(loss) == pytest.approx(float(full_loss), rel=1e-2)


@pytest.mark.slow
@pytest.mark.parametrize("family", LAYER_FAMILIES)
def test_a_packed_windows_loss_is_the_sum_of_its_documents_losses(family):
  """With document masking, a window of three documents (EOS opening each, as the loader packs
  them) costs what the three cost alone: summed over their predictions. Without, it does not."""
  cfg, eos = tiny(family), 0
  rng = np.random.default_rng(0)
  alone = [np.concatenate([[eos], rng.integers(1, cfg.vocab_size, n)]) for n in (9, 5, 15)]
  window = np.concatenate(alone)[None]  # 32 tokens: seq_len.
  model, params = models.build(cfg), models.init_params(cfg, jax.random.key(0))
  loss = jax.jit(step.next_token_loss, static_argnums=(0, 3))
  # Each document also predicts the EOS that follows it, but the last, which the window cuts.
  alone = [np.append(doc, eos) for doc in alone[:-1]] + alone[-1:]
  total = sum(float(loss(model, params, doc[None], None)) * (len(doc) - 1) for doc in alone)
  packed = float(loss(model, params, window, eos)) * (window.shape[1] - 1)
  unmasked = float(loss(model, params, window, None)) * (window.shape[1] - 1)
  assert packed == pytest.approx(total, rel=1e-6)  # Seen: 1e-7 at most.
  assert abs(unmasked - total) > 2e-5 * total  # Seen: 9e-5 (a tiny Mixtral) to 4e-3 (GPT-2).


def test_bfloat16_parameters_are_stored_as_asked():
  params, _ = params_and_tokens(with_compute(TINY, param_dtype="bfloat16"))
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("bfloat16")}


def test_flops_per_token_is_nanogpts_count_with_causal_attention_halved():
  # GPT-2 small: 124,439,808 parameters less 1024 * 768 position embeddings.
  n = 124_439_808 - 1024 * 768
  attention = 12 * 12 * 12 * 64 * 1024
  assert flops.flops_per_token(n, 12, 12, 64, 1024, causal=False) == 6 * n + attention
  assert flops.flops_per_token(n, 12, 12, 64, 1024) == 6 * n + attention / 2
  # DPO's reference model runs forward too: 2 per weight, and a third of attention's count.
  assert flops.flops_per_token(n, 12, 12, 64, 1024, reference_params=n) == pytest.approx(
      8 * n + (attention + attention / 3) / 2)


# Wide enough that matmuls are nearly all of the work, as in the models MFU is quoted for.
FLOPS_SIZES = dict(vocab_size=512, seq_len=128, num_layers=2, hidden_dim=256, intermediate_dim=688)
FLOPS_CONFIGS = {
    **{family: tiny(family, **FLOPS_SIZES) for family in LAYER_FAMILIES},
    # XLA's CPU backend multiplies each row by every expert's weights (a masked grouped matmul),
    # so it would count num_experts times the work: one expert here, where that is the work;
    # test_mfu_counts_only_the_routed_experts covers routing.
    "mixtral": tiny("mixtral", moe=MoeConfig(num_experts=1, num_experts_per_token=1), **FLOPS_SIZES),
    # Values as wide as the keys: XLA's attention pads narrower ones (work the count leaves out).
    "deepseek_v3": tiny("deepseek_v3", v_head_dim=24, moe=dataclasses.replace(
        deepseek_sizes()["moe"], num_experts=1, num_experts_per_token=1, num_groups=1,
        top_groups=1), **FLOPS_SIZES),
    "gpt2-untied": tiny("gpt2", tie_word_embeddings=False, **FLOPS_SIZES),
    "llama-tied": tiny("llama", tie_word_embeddings=True, **FLOPS_SIZES),
}


@pytest.mark.parametrize("family", FLOPS_CONFIGS)
def test_flops_per_token_matches_xlas_count_of_the_compiled_step(family):
  """Our FLOPs (matmuls only) against XLA's cost analysis of forward + backward.

  XLA counts every op, including the elementwise rest (norms, softmax, GELU or
  SiLU, the loss), so it is a little higher: under 2% at this width. The
  causal count's halving of attention is a convention XLA does not share (it
  computes the masked half too), so the full count is what is compared.
  """
  cfg, batch = FLOPS_CONFIGS[family], 4
  params = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))
  tokens = jax.ShapeDtypeStruct((batch, cfg.seq_len), jnp.int32)
  loss_and_grads = jax.jit(lambda p, t: step.accumulated_loss_and_grads(models.build(cfg), p,
                                                                        {"tokens": t}, 1))
  cost = loss_and_grads.lower(params, tokens).compile().cost_analysis()
  xla = (cost[0] if isinstance(cost, list) else cost)["flops"]
  ours = batch * cfg.seq_len * models.flops_per_token(cfg, params, causal=False)
  assert 1.0 <= xla / ours < 1.02 + rope_permutation_flops(family, cfg, batch) / ours, (xla, ours)


def rope_permutation_flops(family: str, cfg, batch: int) -> int:
  """At most what XLA counts for RoPE's partner products (llama.rotary_embedding), which are
  not the model's work: a [dims, dims] matmul per rotated head and token, forward and back."""
  if family.startswith("gpt2"):
    return 0
  dims = getattr(cfg, "qk_rope_head_dim", None) or cfg.head_dim
  rotated_heads = cfg.num_heads + cfg.num_kv_heads
  return batch * cfg.seq_len * cfg.num_layers * rotated_heads * 2 * (2 * dims * dims)


def test_dpo_flops_count_the_reference_forward_as_xla_does():
  """DPO's step runs its reference model forward on every token: XLA's count of the step is
  our count with the reference (a third more), not without it."""
  cfg, batch = FLOPS_CONFIGS["llama-tied"], 4
  params = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))
  tokens = jax.ShapeDtypeStruct((batch, cfg.seq_len), jnp.int32)
  model = models.build(cfg)
  loss_and_grads = jax.jit(lambda p, r, t, w: step.accumulated_loss_and_grads(
      model, p, {"tokens": t, "loss_weights": w}, 1, objective=dpo.Dpo(),
      reference=step.Reference(model, r)))
  cost = loss_and_grads.lower(params, params, tokens, jax.ShapeDtypeStruct(
      tokens.shape, jnp.float32)).compile().cost_analysis()
  xla = (cost[0] if isinstance(cost, list) else cost)["flops"]
  ours = batch * cfg.seq_len * models.flops_per_token(cfg, params, causal=False, reference=True)
  rope = rope_permutation_flops("llama", cfg, batch) * 3 // 2  # The reference's forward too.
  assert 1.0 <= xla / ours < 1.02 + rope / ours, (xla, ours)


def test_mfu_counts_only_the_routed_experts():
  dense = tiny("mixtral", moe=MoeConfig(num_experts=8, num_experts_per_token=8))
  params = jax.eval_shape(lambda: models.init_params(dense, jax.random.key(0)))
  experts = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(params)
                if "experts" in jax.tree_util.keystr(path))
  assert experts == 3 * 8 * 3 * 64 * 96  # Layers x experts x (gate, up, down) x hidden x mlp.
  top2 = dataclasses.replace(dense, moe=MoeConfig(num_experts=8, num_experts_per_token=2))
  skipped = models.flops_per_token(dense, params) - models.flops_per_token(top2, params)
  assert skipped == pytest.approx(6 * experts * 6 / 8)


def test_throughput_reports_mfu_against_the_peak():
  throughput = metrics.Throughput(tokens_per_step=1000, step=0, flops_per_token=1e9,
                                  num_devices=2, peak_flops=1e12)
  result = throughput.measure(step=10)
  per_device = result["train/tokens_per_second"] * 1e9 / 2
  assert result["train/model_tflops_per_device"] == pytest.approx(per_device / 1e12)
  assert result["train/mfu"] == pytest.approx(per_device / 1e12)
  assert flops.peak_flops_per_device(jax.devices()[0]) == 0.0  # CPUs are not in the table.
  assert flops.peak_flops_per_device(jax.devices()[0], 5e10) == 5e10


@pytest.mark.parametrize("scan_layers", [False, True])
def test_weight_decay_skips_biases_and_layer_norms(scan_layers):
  params, _ = params_and_tokens(with_compute(TINY, scan_layers=scan_layers))
  decayed = {partitioning.path_name(p) for p, d in jax.tree_util.tree_leaves_with_path(
      optimizers.decay_mask(params)) if d}
  assert decayed == {partitioning.path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)
                     if partitioning.path_name(p).endswith(("kernel", "embedding"))}
  assert not any(name.endswith(("bias", "scale")) for name in decayed)


def test_weight_decay_takes_a_mixtures_expert_stacks_not_its_bias_or_their_adapters():
  cfg = tiny("deepseek_v3", compute=ComputeConfig(scan_layers=True),
             lora=LoraConfig(rank=2, targets=lora.EXPERT_TARGETS))
  params = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))
  decayed = {partitioning.path_name(p) for p, d in jax.tree_util.tree_leaves_with_path(
      optimizers.decay_mask(params)) if d}
  assert {f"layers/mlp/experts/{name}" for name in ("gate_proj", "up_proj", "down_proj")} < decayed
  assert not [name for name in decayed if "lora" in name or name.endswith(moe.BIAS)]


@pytest.mark.slow
def test_blockwise_cross_entropy_never_holds_all_logits():
  cfg = dataclasses.replace(TINY, vocab_size=65536, seq_len=128)
  params, tokens = params_and_tokens(cfg, batch_size=8)
  all_logits = 8 * 128 * 65536 * 4
  temp_bytes = {}
  for block_size in (0, 1024):
    model = GPT2LMHeadModel(with_compute(cfg, cross_entropy_block_size=block_size))
    grad = jax.jit(jax.grad(lambda p: step.next_token_loss(model, p, tokens)))
    temp_bytes[block_size] = grad.lower(params).compile().memory_analysis().temp_size_in_bytes
  assert temp_bytes[0] > all_logits
  assert temp_bytes[1024] < all_logits / 4, temp_bytes


def test_a_non_finite_step_leaves_the_state_and_says_so():
  params, tokens = params_and_tokens(TINY)
  optimizer = optax.adamw(1e-3)
  state = step.TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
  train_step = jax.jit(step.make_train_step(GPT2LMHeadModel(TINY), optimizer, lambda _: 1e-3))
  # An id past the vocabulary embeds as NaN, so loss and gradients are NaN.
  bad = {"tokens": tokens.at[0, 3].set(TINY.vocab_size)}
  after_bad, metrics = train_step(state, bad)
  assert float(metrics["train/nonfinite"]) == 1.0 and not np.isfinite(float(metrics["train/loss"]))
  assert int(after_bad.step) == 1
  assert_trees_close(after_bad.params, state.params, 0)
  assert_trees_close(after_bad.opt_state, state.opt_state, 0)
  after_good, metrics = train_step(after_bad, {"tokens": tokens})
  assert float(metrics["train/nonfinite"]) == 0.0
  assert not np.allclose(after_good.params["wte"]["embedding"], state.params["wte"]["embedding"])


def test_equal_settings_on_an_equal_mesh_share_their_steps():
  """A second build of the same settings (lf.train again in a notebook, a resume in the same
  process) reuses the jitted steps, which compile nothing again; a change of the model, the
  optimizer, the trainer or the mesh builds anew."""
  from conftest import load_config_file
  from levanter_flax.config import to_run_config
  config = load_config_file("gpt2_nano")
  config.model.num_layers, config.model.hidden_dim, config.model.seq_len = 1, 64, 64
  run = to_run_config(config)
  partitioner = lambda axes=run.trainer.device_mesh: partitioning.Partitioner(
      partitioning.make_mesh(axes), run.sharding)
  built = step.build(run, partitioner())
  assert step.build(run, partitioner()) is built
  replace = dataclasses.replace
  for changed in (replace(run, model=replace(run.model, hidden_dim=128)),
                  replace(run, optimizer=replace(run.optimizer, learning_rate=0.5)),
                  replace(run, trainer=replace(run.trainer, seed=run.trainer.seed + 1))):
    assert step.build(changed, partitioner()) is not built
  assert step.build(run, partitioner((("data", 4), ("model", 2)))) is not built
