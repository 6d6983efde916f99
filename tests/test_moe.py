"""The mixture-of-experts layer (models/moe.py) against NumPy statements of its rules; its
layouts against one device are in test_partitioning."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from levanter_flax import models
from levanter_flax.core.errors import UserError
from levanter_flax.models import moe
from levanter_flax.models.moe import MoeConfig
from levanter_flax.parallel.partitioning import Partitioner, make_mesh
from test_main import assert_one_line_error, run_main
from test_partitioning import sharding_config, tiny

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

