"""The mixture-of-experts layer (models/moe.py) against NumPy statements of its rules; its
layouts against one device are in test_partitioning."""
import dataclasses
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from levanter_flax import models
from levanter_flax.core.errors import UserError
from levanter_flax.models import common, moe
from levanter_flax.models.moe import MoeConfig
from levanter_flax.generate.trained import run_params
from levanter_flax.parallel.partitioning import Partitioner, make_mesh
from levanter_flax.training import step
from conftest import train_losses
from test_main import assert_one_line_error, run_main
from test_partitioning import sharding_config, tiny
from test_resume import run_killed_after_checkpoint

EXPERTS = 4


def numpy_ragged_all_to_all(operands, outputs, input_offsets, send_sizes, output_offsets):
  """jax.lax.ragged_all_to_all as its documentation states it, for every device at once:
  device i's rows [input_offsets[i][j], + send_sizes[i][j]) land in device j's output at
  output_offsets[i][j]."""
  outputs = [o.copy() for o in outputs]
  for i, operand in enumerate(operands):
    for j, output in enumerate(outputs):
      rows = operand[input_offsets[i][j]:input_offsets[i][j] + send_sizes[i][j]]
      output[output_offsets[i][j]:output_offsets[i][j] + len(rows)] = rows
  return outputs


def test_the_cpu_stand_in_for_ragged_all_to_all_places_rows_as_the_collective_does():
  devices, rows, inbox = 4, 6, 24
  rng = np.random.default_rng(0)
  send_sizes = rng.integers(0, 3, (devices, devices))  # [source, destination]
  input_offsets = np.cumsum(send_sizes, axis=1) - send_sizes
  output_offsets = np.cumsum(send_sizes, axis=0) - send_sizes  # Sources in order at each.
  operands = rng.normal(size=(devices, rows, 2)).astype(np.float32)
  mesh = jax.make_mesh((devices,), ("expert",), devices=jax.devices()[:devices])
  per_device = lambda a: jax.device_put(a, jax.NamedSharding(mesh, P("expert")))

  def exchange(operand, input_offset, send_size, output_offset, recv_size):
    return moe._ragged_all_to_all(operand[0], jnp.full((inbox, 2), -1.0), input_offset[0],
                                  send_size[0], output_offset[0], recv_size[0], ("expert",))[None]
  with jax.set_mesh(mesh):
    got = jax.jit(jax.shard_map(exchange, in_specs=P("expert"), out_specs=P("expert")))(
        *map(per_device, (operands, input_offsets.astype(np.int32), send_sizes.astype(np.int32),
                          output_offsets.astype(np.int32), send_sizes.T.astype(np.int32))))
  expected = numpy_ragged_all_to_all(operands, np.full((devices, inbox, 2), -1.0, np.float32),
                                     input_offsets, send_sizes, output_offsets)
  np.testing.assert_array_equal(np.asarray(got), np.stack(expected))


def numpy_moe(cfg: MoeConfig, x, router, gate, up, down):
  """The layer by its definition, token by token: softmax router, the k best experts (ties to
  the lower index), weights renormalised; over capacity, an expert's later copies (token by
  token, slot by slot) are dropped. Returns (outputs, copies dropped)."""
  x = x.reshape(-1, x.shape[-1]).astype(np.float64)
  logits = x @ router
  probabilities = np.exp(logits - logits.max(-1, keepdims=True))
  probabilities /= probabilities.sum(-1, keepdims=True)
  k = cfg.num_experts_per_token
  capacity = (np.inf if cfg.dropless
              else np.ceil(cfg.capacity_factor * len(x) * k / cfg.num_experts))
  taken, dropped = np.zeros(cfg.num_experts), 0
  outputs = np.zeros_like(x)
  for t, row in enumerate(x):
    chosen = np.argsort(-probabilities[t], kind="stable")[:k]
    weights = probabilities[t][chosen] / probabilities[t][chosen].sum()
    for e, w in zip(chosen, weights):
      if taken[e] >= capacity:
        dropped += 1
        continue
      taken[e] += 1
      h = row @ gate[e]
      outputs[t] += w * ((h / (1 + np.exp(-h))) * (row @ up[e])) @ down[e]
  return outputs, dropped


@pytest.mark.parametrize("capacity_factor,skew,grouped_matmul", [
    ("dropless", 0.0, "ragged_dot"), ("dropless", 0.05, "ragged_dot"), (1.0, 0.0, "ragged_dot"),
    (1.0, 0.05, "ragged_dot"), (0.5, 0.05, "ragged_dot"), (1.0, 0.05, "gmm")])
def test_the_layer_computes_its_definition(capacity_factor, skew, grouped_matmul):
  """One device: routing, the grouped matmul (megablox gmm interpreted on the CPU), and
  capacity's drops, against NumPy. A skewed router sends most tokens to expert 0, past its
  capacity."""
  cfg = tiny("mixtral", moe=MoeConfig(num_experts=EXPERTS, num_experts_per_token=2,
                                      capacity_factor=capacity_factor,
                                      grouped_matmul=grouped_matmul))
  x = jax.random.normal(jax.random.key(1), (2, 8, cfg.hidden_dim))
  block = moe.MoeBlock(cfg)
  params = block.init(jax.random.key(0), x)["params"]
  params["gate"]["kernel"] = params["gate"]["kernel"].at[:, 0].add(skew * jnp.sign(x[0, 0]))
  outputs, sown = block.apply({"params": params}, x, mutable=["router", "losses"])
  as_numpy = lambda a: np.asarray(a, np.float64)
  expected, dropped = numpy_moe(cfg.moe, np.asarray(x), as_numpy(params["gate"]["kernel"]),
                                *(as_numpy(params["experts"][name])
                                  for name in ("gate_proj", "up_proj", "down_proj")))
  np.testing.assert_allclose(np.asarray(outputs).reshape(expected.shape), expected, atol=1e-5)
  assert sown["router"]["dropped_fraction"][0] == pytest.approx(dropped / (2 * 8 * 2))
  if capacity_factor != "dropless" and skew:
    assert dropped > 0
  if grouped_matmul == "gmm":  # Its hand-written backward pass, against ragged_dot's.
    ragged = moe.MoeBlock(tiny("mixtral", moe=dataclasses.replace(cfg.moe,
                                                                  grouped_matmul="ragged_dot")))
    grads = [jax.grad(lambda p, x: jnp.sum(b.apply({"params": p}, x) ** 2), argnums=(0, 1))(
        params, x) for b in (block, ragged)]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), *grads)


def unwritten_after_the_groups(ragged_dot):
  """ragged_dot as a TPU may run it: the rows after the groups hold garbage (NaN, or 2**30 in
  an integer product), in its result and in its gradient for the rows."""
  def garbage(product, group_sizes):
    after = (jnp.arange(product.shape[0]) >= group_sizes.sum())[:, None]
    fill = jnp.nan if jnp.issubdtype(product.dtype, jnp.floating) else 2 ** 30
    return jnp.where(after, jnp.asarray(fill, product.dtype), product)

  def patched(lhs, rhs, group_sizes, **kwargs):
    @jax.custom_vjp
    def product(lhs, rhs):
      return garbage(ragged_dot(lhs, rhs, group_sizes, **kwargs), group_sizes)

    def backward(operands, g):
      d_lhs, d_rhs = jax.vjp(lambda a, b: ragged_dot(a, b, group_sizes, **kwargs),
                             *operands)[1](g)
      return garbage(d_lhs, group_sizes), d_rhs
    product.defvjp(lambda lhs, rhs: (product(lhs, rhs), (lhs, rhs)), backward)
    return product(lhs, rhs)
  return patched


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_rows_left_unwritten_after_the_groups_reach_no_token(monkeypatch, quantization):
  """On a v5e chip ragged_dot left the rows after the groups unwritten, where the copies over
  capacity sort: with garbage there, forward and back, a layer that drops copies gives the
  same outputs and gradients, all finite."""
  cfg = common.with_compute(tiny("mixtral", moe=MoeConfig(
      num_experts=EXPERTS, num_experts_per_token=2, capacity_factor=0.5,
      grouped_matmul="ragged_dot")), quantization=quantization)
  x = jax.random.normal(jax.random.key(1), (2, 8, cfg.hidden_dim))
  block = moe.MoeBlock(cfg)
  params = block.init(jax.random.key(0), x)["params"]
  loss = lambda p, x: jnp.sum(block.apply({"params": p}, x) ** 2)
  clean = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
  monkeypatch.setattr(jax.lax, "ragged_dot", unwritten_after_the_groups(jax.lax.ragged_dot))
  patched = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
  assert all(np.isfinite(a).all() for a in jax.tree.leaves(patched))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), patched, clean)


def test_bad_moe_settings_are_refused_naming_the_key():
  for fields, key in [(dict(capacity_factor=0), "capacity_factor"),
                      (dict(capacity_factor=-1.5), "capacity_factor"),
                      (dict(capacity_factor="lots"), "capacity_factor"),
                      (dict(num_experts=4, num_experts_per_token=5), "num_experts_per_token"),
                      (dict(router_z_loss_coef=-1.0), "router_z_loss_coef"),
                      (dict(grouped_matmul="einsum"), "grouped_matmul")]:
    with pytest.raises(UserError, match=f"config.*moe.{key}"):
      converted = {k: moe._capacity_factor(f"config.model.moe.{k}", v)
                   if k == "capacity_factor" else v for k, v in fields.items()}
      MoeConfig(**converted)
  with pytest.raises(UserError, match="config.model.moe.normalize_top_k"):
    tiny("mixtral", moe=MoeConfig(normalize_top_k=False))


@pytest.mark.slow
def test_an_expert_count_the_expert_axis_does_not_divide_is_one_line(data_cache, tmp_path):
  result = run_main("--config=configs/mixtral.py:nano", f"--workdir={tmp_path}",
                    "--config.trainer.device_mesh.expert=4", "--config.model.moe.num_experts=6",
                    f"--config.data.cache_dir={data_cache}", "--config.data.reader_groups=1")
  assert_one_line_error(result, "config.model.moe.num_experts (6)", "expert axis's size (4")


@pytest.mark.parametrize("capacity_factor", ["dropless", 1.0])
def test_expert_parallel_capacity_drops_per_device_as_each_devices_tokens_alone(capacity_factor):
  """Over expert=8, one sequence a device, with a skewed router: each device keeps (or drops)
  what the layer on one device keeps of that sequence alone, the exchange's buffers bounded by
  capacity; the dropped count is the devices' sum."""
  cfg = tiny("mixtral", moe=MoeConfig(capacity_factor=capacity_factor))
  x = jax.random.normal(jax.random.key(1), (8, cfg.seq_len, cfg.hidden_dim))
  block = moe.MoeBlock(cfg)
  params = block.init(jax.random.key(0), x[:1])["params"]
  params["gate"]["kernel"] = params["gate"]["kernel"].at[:, 0].add(0.05 * jnp.sign(x[0, 0]))
  apply = jax.jit(lambda p, x: block.apply({"params": p}, x, mutable=["router"]))
  alone = [apply(params, x[i:i + 1]) for i in range(8)]
  partitioner = Partitioner(make_mesh((("expert", 8),)), sharding_config(
      rules=models.FAMILIES["mixtral"].partition_rules, expert_axis="expert",
      activation_axis="expert"))
  with partitioner.activation_context():
    outputs, sown = apply(params, x)
  np.testing.assert_allclose(outputs, np.concatenate([o for o, _ in alone]), atol=1e-6)
  dropped = sum(float(s["router"]["dropped_fraction"][0]) for _, s in alone) / 8
  assert float(sown["router"]["dropped_fraction"][0]) == pytest.approx(dropped)
  assert (dropped > 0) == (capacity_factor != "dropless")



def numpy_sigmoid_route(cfg: MoeConfig, logits, bias):
  """DeepSeek-V3's routing as transformers' DeepseekV3TopkRouter states it, token by token:
  sigmoid scores; each group ranked by the sum of its two best scores plus bias; the k best
  (score plus bias) of the top_groups groups; weighted by their scores, renormalised, scaled."""
  experts, weights = [], []
  for row in np.asarray(logits, np.float64).reshape(-1, logits.shape[-1]):
    scores = 1 / (1 + np.exp(-row))
    choice = (scores + bias).reshape(cfg.num_groups, -1)
    ranked = np.argsort(-np.sort(choice, axis=1)[:, -2:].sum(axis=1), kind="stable")
    allowed = np.full_like(choice, -np.inf)
    allowed[ranked[:cfg.top_groups]] = choice[ranked[:cfg.top_groups]]
    chosen = np.argsort(-allowed.reshape(-1), kind="stable")[:cfg.num_experts_per_token]
    w = scores[chosen] / (scores[chosen].sum() if cfg.normalize_top_k else 1)
    experts.append(chosen)
    weights.append(w * cfg.routed_scaling_factor)
  return np.array(experts), np.array(weights)


@pytest.mark.parametrize("normalize_top_k", [True, False])
def test_sigmoid_routing_chooses_within_the_top_groups_by_score_plus_bias(normalize_top_k):
  cfg = MoeConfig(num_experts=16, num_experts_per_token=3, scoring="sigmoid", num_groups=4,
                  top_groups=2, routed_scaling_factor=2.5, normalize_top_k=normalize_top_k)
  logits = jax.random.normal(jax.random.key(0), (2, 32, 16))
  bias = jax.random.normal(jax.random.key(1), (16,)) * 0.5  # Enough to change choices.
  experts, weights, _ = moe.route(cfg, logits, bias)
  expected_experts, expected_weights = numpy_sigmoid_route(cfg, logits, np.asarray(bias))
  np.testing.assert_array_equal(np.asarray(experts).reshape(-1, 3), expected_experts)
  np.testing.assert_allclose(np.asarray(weights).reshape(-1, 3), expected_weights, rtol=1e-5)
  unbiased, _, _ = moe.route(cfg, logits, jnp.zeros(16))
  assert (np.asarray(unbiased) != np.asarray(experts)).any()


@pytest.mark.slow
def test_the_balancing_bias_moves_by_its_rule_outside_the_gradient():
  """A train step at a learning rate of 0 changes the biases alone: each by the rate towards
  the mean load (NumPy's sign of the mean minus the load of a forward pass over the batch),
  whether or not the batch is accumulated; their gradient is zero."""
  cfg = tiny("deepseek_v3")
  model = models.build(cfg)
  params = models.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (4, cfg.seq_len), 0, cfg.vocab_size)
  sown = jax.jit(lambda p, t: model.apply({"params": p}, t, mutable=[moe.BALANCE])[1])(params, tokens)
  optimizer = optax.sgd(0.0)
  state = step.TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
  for num_microbatches in (1, 2):
    train_step = jax.jit(step.make_train_step(model, optimizer, lambda _: 0.0, num_microbatches))
    new = train_step(state, {"tokens": tokens})[0].params
    biased = 0
    for (path, before), after in zip(jax.tree_util.tree_leaves_with_path(params),
                                     jax.tree.leaves(new)):
      keys = [key.key for key in path]
      if keys[-1] != moe.BIAS:
        np.testing.assert_array_equal(after, before, err_msg="/".join(keys))
        continue
      load = np.asarray(sown[moe.BALANCE][keys[0]]["mlp"]["expert_load"][0])
      np.testing.assert_allclose(np.asarray(after) - np.asarray(before),
                                 cfg.moe.bias_update_rate * np.sign(load.mean() - load), atol=1e-7)
      biased += 1
    assert biased == cfg.num_layers - cfg.first_dense_layers
  grads = jax.jit(lambda p, t: step.accumulated_loss_and_grads(model, p, {"tokens": t}, 1)[1])(
      params, tokens)
  assert all(not np.any(g) for path, g in jax.tree_util.tree_leaves_with_path(grads)
             if path[-1].key == moe.BIAS)


def test_bad_routing_groups_are_refused_naming_the_key():
  sigmoid = dict(num_experts=8, num_experts_per_token=2, scoring="sigmoid")
  for fields, message in [
      (dict(num_groups=3), r"config.model.moe.num_groups \(3\) must divide "
                           r"config.model.moe.num_experts \(8\)"),
      (dict(num_groups=4, top_groups=5), "config.model.moe.top_groups must be between 1 and"),
      (dict(num_groups=4, top_groups=1, num_experts_per_token=3),
       r"config.model.moe.num_experts_per_token \(3\) exceeds the experts of"),
      (dict(scoring="softmax", bias_update_rate=0.001),
       "config.model.moe.bias_update_rate needs config.model.moe.scoring='sigmoid'"),
      (dict(scoring="top1"), "config.model.moe.scoring must be one of softmax, sigmoid")]:
    with pytest.raises(UserError, match=message):
      MoeConfig(**sigmoid | fields)


DEEPSEEK_RUN = ["--config=configs/deepseek_v3.py:nano", "--config.model.num_layers=2",
                "--config.model.seq_len=64", "--config.trainer.batch_size=8",
                "--config.trainer.num_train_steps=4", "--config.checkpoint.every_steps=2",
                "--config.trainer.eval_every_steps=100", "--config.trainer.eval_tokens=256",
                "--config.trainer.log_every_steps=1", "--config.data.reader_groups=1"]


@pytest.mark.slow
def test_a_killed_deepseek_run_resumes_with_its_biases_bit_exact(data_cache, tmp_path):
  """Killed (SIGKILL) after its step-2 checkpoint and rerun, a run ends with the biases, params
  and losses of one never killed: the biases are in the checkpoint, and move on from there."""
  flags = [f"--config.data.cache_dir={data_cache}"]
  killed = run_killed_after_checkpoint(tmp_path / "killed", 2, *flags, run=DEEPSEEK_RUN)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
  for workdir in ("killed", "straight"):
    finished = run_killed_after_checkpoint(tmp_path / workdir, None, *flags, run=DEEPSEEK_RUN)
    assert finished.returncode == 0, finished.stderr[-2000:]
  (_, killed, _), (_, straight, _) = (run_params(tmp_path / d) for d in ("killed", "straight"))
  biases = [x for path, x in jax.tree_util.tree_leaves_with_path(straight)
            if path[-1].key == moe.BIAS]
  assert biases and all(np.any(b) for b in biases)  # They moved.
  jax.tree.map(np.testing.assert_array_equal, killed, straight)
  assert train_losses(tmp_path / "killed") == train_losses(tmp_path / "straight")
  assert sorted(train_losses(tmp_path / "killed")) == [1, 2, 3, 4]


def test_the_experts_bfloat16_cast_is_convert_bit_for_bit():
  """On a TPU, common.cast_in_layer rounds float32 to bfloat16 by hand (so that the compiler keeps
  it in the layer loop): every bit pattern's result, NaN aside, and the gradient are convert's.
  Elsewhere it is a plain convert."""
  bits = np.random.default_rng(0).integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
  edges = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001,
                    0x00008000, 0x00018000, 0x3F808000, 0x3F818000, 0x3F808001, 0x7FFFFFFF,
                    0xFFFFFFFF, 0x7FC00000], np.uint32)
  x = np.concatenate([bits, edges]).view(np.float32)
  ours = np.asarray(jax.jit(common.float32_to_bfloat16)(x))
  convert = np.asarray(jax.jit(lambda a: a.astype(jnp.bfloat16))(x))
  nan = np.isnan(x)
  np.testing.assert_array_equal(ours.view(np.uint16)[~nan], convert.view(np.uint16)[~nan])
  assert np.isnan(ours[nan].astype(np.float32)).all()
  weights = jnp.arange(4.0)
  grad = lambda cast: jax.grad(lambda a: (cast(a).astype(jnp.float32) * weights).sum())(
      jnp.ones(4))
  ours_grad = grad(common.float32_to_bfloat16)
  assert ours_grad.dtype == jnp.float32
  np.testing.assert_array_equal(ours_grad, grad(lambda a: a.astype(jnp.bfloat16)))
  on_cpu = str(jax.make_jaxpr(lambda a: common.cast_in_layer(a, jnp.bfloat16))(x[:4]))
  assert "convert_element_type" in on_cpu and "bitcast" not in on_cpu
