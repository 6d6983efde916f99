"""Mesh, partition rules and ZeRO-3 on 8 fake CPU devices, proven on the arrays themselves."""
import dataclasses
import re

import flax.linen
import jax
import numpy as np
import pytest

from conftest import COMPOSED_FAMILIES, deepseek_sizes, load_config_file, shipped_configs
from levanter_flax import models
from levanter_flax.optim import optimizers
from levanter_flax.parallel import partitioning
from levanter_flax.training import step
from levanter_flax.config import default_config, mesh, to_run_config
from levanter_flax.core.errors import UserError
from levanter_flax.models.gpt2 import PARTITION_RULES, GPT2Config
from levanter_flax.parallel.partitioning import Partitioner, ShardingConfig, make_mesh, path_name
from levanter_flax.models.common import ComputeConfig, with_compute
from levanter_flax.models import moe
from levanter_flax.models.moe import MoeConfig
from levanter_flax.models.pipeline import PipelineConfig
from test_main import NANO, assert_one_line_error, run_main

MODEL = GPT2Config(vocab_size=384, seq_len=32, num_layers=2, num_heads=4, hidden_dim=64)
OPTIMIZER = optimizers.OptimizerConfig(learning_rate=3e-3, warmup_steps=2, weight_decay=0.1,
                                       max_grad_norm=1.0, beta1=0.9, beta2=0.95, epsilon=1e-8,
                                       min_learning_rate_ratio=0.1)
BATCH_SIZE, NUM_STEPS = 8, 5


def sharding_config(rules=(), parameter_axis=None, tensor_axis=None, strict=False,
                    expert_axis=None, logical_axis_rules=(), activation_axis="data"):
  return ShardingConfig(rules=rules, activation_axis=activation_axis, parameter_axis=parameter_axis,
                        optimizer_axis=None, tensor_axis=tensor_axis, strict=strict,
                        expert_axis=expert_axis, logical_axis_rules=logical_axis_rules)


TENSOR_PARALLEL = dict(rules=PARTITION_RULES, tensor_axis="model")
LAYOUTS = {
    "data8": ((("data", 8),), sharding_config()),
    "data4_model2": ((("data", 4), ("model", 2)), sharding_config(**TENSOR_PARALLEL)),
    "data8_zero3": ((("data", 8),), sharding_config(parameter_axis="data")),
    "data2_model4_zero3": ((("data", 2), ("model", 4)),
                           sharding_config(parameter_axis="data", **TENSOR_PARALLEL)),
}

# What each layout must put on a few representative parameters, written out by hand.
EXPECTED_SPECS = {
    "data8": {
        "wte/embedding": (None, None), "h_0/attn/c_attn/kernel": (None, None)},
    "data4_model2": {
        "wte/embedding": ("model", None), "wpe/embedding": (None, None),
        "h_0/attn/c_attn/kernel": (None, "model"), "h_0/attn/c_attn/bias": ("model",),
        "h_0/attn/c_proj/kernel": ("model", None), "h_0/attn/c_proj/bias": (None,),
        "h_1/mlp/c_fc/kernel": (None, "model"), "h_1/mlp/c_proj/kernel": ("model", None),
        "h_1/ln_2/scale": (None,)},
    "data8_zero3": {
        "wte/embedding": ("data", None), "wpe/embedding": (None, "data"),
        "h_0/attn/c_attn/kernel": (None, "data"), "h_0/attn/c_attn/bias": ("data",),
        "h_0/attn/c_proj/kernel": ("data", None), "h_1/mlp/c_proj/kernel": ("data", None),
        "h_1/ln_2/scale": ("data",)},
    "data2_model4_zero3": {
        "wte/embedding": ("model", "data"), "h_0/attn/c_attn/kernel": ("data", "model"),
        "h_0/attn/c_attn/bias": ("model",), "h_0/attn/c_proj/kernel": ("model", "data"),
        "h_1/mlp/c_fc/kernel": ("data", "model"), "h_1/ln_2/scale": ("data",)},
}


def spec_of(array: jax.Array) -> tuple:
  spec = tuple(array.sharding.spec)
  return spec + (None,) * (array.ndim - len(spec))


def build(partitioner: Partitioner, model: GPT2Config = MODEL,
          optimizer: optimizers.OptimizerConfig = OPTIMIZER,
          pipeline: PipelineConfig = PipelineConfig(), accumulation: int = 1) -> step.ShardedSteps:
  """The model's steps with `optimizer`, its schedule over 100 steps, `accumulation`
  microbatches a step, pipelined by `pipeline` where the mesh has stages."""
  nano = to_run_config(load_config_file("gpt2_nano"))
  trainer = dataclasses.replace(nano.trainer, num_train_steps=100,
                                gradient_accumulation_steps=accumulation, pipeline=pipeline)
  run = dataclasses.replace(nano, model=model, optimizer=optimizer, trainer=trainer)
  return step.build(run, partitioner)


def train(device_mesh, config: ShardingConfig, devices=None, model: GPT2Config = MODEL,
          num_steps: int = NUM_STEPS, optimizer: optimizers.OptimizerConfig = OPTIMIZER):
  """num_steps steps on fixed random batches; returns (losses, final state)."""
  partitioner = Partitioner(make_mesh(device_mesh, devices), config)
  steps = build(partitioner, model, optimizer)
  tokens = np.random.default_rng(0).integers(0, 257, (num_steps, BATCH_SIZE, MODEL.seq_len))
  losses = []
  with partitioner.activation_context():
    state = steps.init(jax.random.key(0))
    for batch in tokens:
      batch = jax.device_put(batch.astype(np.int32), steps.batch_sharding)
      state, metrics = steps.train_step(state, {"tokens": batch})
      losses.append(float(metrics["train/loss"]))
  return np.array(losses), state


_ONE_DEVICE_LOSSES = {}


def one_device_losses(model=MODEL, num_steps: int = NUM_STEPS) -> np.ndarray:
  """num_steps steps of `model` on one device: the reference of every layout, trained once per
  model for all the tests of this module that compare with it."""
  key = repr(model), num_steps
  if key not in _ONE_DEVICE_LOSSES:
    _ONE_DEVICE_LOSSES[key], _ = train((("data", 1),), sharding_config(), devices=jax.devices()[:1],
                                       model=model, num_steps=num_steps)
  return _ONE_DEVICE_LOSSES[key]


@pytest.fixture(scope="module")
def single_device_losses():
  return one_device_losses()


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout_run(request):
  device_mesh, config = LAYOUTS[request.param]
  losses, state = train(device_mesh, config)
  return request.param, losses, state


@pytest.mark.slow
def test_losses_match_single_device(layout_run, single_device_losses):
  name, losses, _ = layout_run
  np.testing.assert_allclose(losses, single_device_losses, rtol=1e-5, err_msg=name)


# Sizes for a tiny model of any family; each takes the fields it has (head_dim: Qwen3's, not
# hidden_dim / num_heads).
TINY_SIZES = dict(vocab_size=384, seq_len=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  hidden_dim=64, intermediate_dim=96, head_dim=24)
# A family's own, to exercise it: Gemma 3's local then global layer, a window shorter than the
# sequence.
FAMILY_SIZES = {"gemma3": dict(sliding_window=8, sliding_window_pattern=2),
                "deepseek_v3": deepseek_sizes()}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(models.FAMILIES) - COMPOSED_FAMILIES))
def test_every_family_trains_on_a_2d_mesh_with_zero3_as_on_one_device(name):
  family = models.FAMILIES[name]
  model = tiny(name)
  config = sharding_config(rules=family.partition_rules, tensor_axis="model", parameter_axis="data",
                           strict=True)
  eight, state = train((("data", 4), ("model", 2)), config, model=model)
  np.testing.assert_allclose(eight, one_device_losses(model), rtol=1e-5)
  assert any("model" in spec_of(x) for x in jax.tree.leaves(state.params))


@pytest.mark.slow
def test_a_scanned_gemma3_trains_on_a_2d_mesh_with_zero3_as_on_one_device():
  """Scanned, each layer's kind (local, global) is the scan's input, traced: the lax.cond between
  the two masks under ZeRO-3 and the tensor split."""
  model = tiny("gemma3", compute=ComputeConfig(scan_layers=True))
  one = one_device_losses(model)
  config = sharding_config(rules=models.FAMILIES["gemma3"].partition_rules, tensor_axis="model",
                           parameter_axis="data", strict=True)
  eight, _ = train((("data", 4), ("model", 2)), config, model=model)
  np.testing.assert_allclose(eight, one, rtol=1e-5)


MOE_RULES = models.FAMILIES["mixtral"].partition_rules
MOE_LAYOUTS = {
    # mixtral_8x7b.py's axes with an expert axis of one device: ZeRO-3 alone.
    "data8_expert1_zero3": ((("data", 8), ("expert", 1)), sharding_config(
        rules=MOE_RULES, expert_axis="expert", tensor_axis="expert", parameter_axis="data")),
    # The batch over "data" only: each device of the expert axis takes a quarter of its
    # tokens, sends them to their experts, and the outputs are gathered back.
    "data2_expert4_zero3": ((("data", 2), ("expert", 4)), sharding_config(
        rules=MOE_RULES, expert_axis="expert", parameter_axis="data", strict=True)),
    # The batch over the expert axis too: each device sends its own tokens.
    "expert8_zero3": ((("expert", 8),), sharding_config(
        rules=MOE_RULES, expert_axis="expert", parameter_axis="expert", strict=True,
        activation_axis="expert")),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout,scan_layers,grouped_matmul", [
    ("data2_expert4_zero3", False, "ragged_dot"), ("expert8_zero3", True, "ragged_dot"),
    ("data8_expert1_zero3", True, "ragged_dot"), ("data2_expert4_zero3", False, "gmm")])
def test_experts_split_over_an_expert_axis_train_as_on_one_device(layout, scan_layers,
                                                                  grouped_matmul):
  """Expert parallelism by token dispatch (ragged all-to-all), with ZeRO-3: 10 steps as on one
  device, each device holding its 2 or 1 of the 8 experts. Megablox gmm (interpreted here) runs
  in an unchecked shard_map, whose gradients must come out the same."""
  moe_cfg = MoeConfig(router_aux_loss_coef=0.02, router_z_loss_coef=0.001)
  model = tiny("mixtral", compute=ComputeConfig(scan_layers=scan_layers), moe=moe_cfg)
  reference = one_device_losses(model, num_steps=10)
  model = dataclasses.replace(model, moe=dataclasses.replace(moe_cfg, grouped_matmul=grouped_matmul))
  losses, state = train(*MOE_LAYOUTS[layout], model=model, num_steps=10)
  np.testing.assert_allclose(losses, reference, rtol=1e-5)
  params = {path_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(state.params)}
  layer = "layers" if scan_layers else "layers_0"
  for name in ("gate_proj", "up_proj", "down_proj"):
    expert = params[f"{layer}/mlp/experts/{name}"]
    assert "expert1" in layout or spec_of(expert)[-3] == "expert"
    assert expert.addressable_shards[0].data.shape[-3] == 8 // dict(MOE_LAYOUTS[layout][0])["expert"]


@pytest.mark.slow
def test_deepseeks_experts_and_biases_over_an_expert_axis_train_as_on_one_device():
  """Sigmoid group-limited routing, shared experts and the balancing biases over data=2 x
  expert=4 with ZeRO-3: 10 steps' losses, and the biases they end with, are one device's (each
  step's load is the whole batch's, wherever its tokens were)."""
  model = tiny("deepseek_v3", compute=ComputeConfig(scan_layers=True))
  one, one_state = train((("data", 1),), sharding_config(), devices=jax.devices()[:1],
                         model=model, num_steps=10)
  losses, state = train((("data", 2), ("expert", 4)), sharding_config(
      rules=models.FAMILIES["deepseek_v3"].partition_rules, expert_axis="expert",
      parameter_axis="data", strict=True), model=model, num_steps=10)
  np.testing.assert_allclose(losses, one, rtol=1e-5)
  biases = [np.asarray(s.params["layers"]["mlp"][moe.BIAS]) for s in (state, one_state)]
  np.testing.assert_array_equal(*biases)
  assert np.abs(biases[1]).max() > 0.001  # Moved over the steps, one way or the other.


def tiny(name: str, **fields):
  family = models.FAMILIES[name]
  names = {f.name for f in dataclasses.fields(family.config)}
  return family.config(**{k: v for k, v in TINY_SIZES.items() if k in names}
                       | FAMILY_SIZES.get(name, {}) | fields)


def gathered_elements(partitioner: Partitioner, model, batch_size: int) -> int:
  """How many elements the compiled train step all-gathers, in all."""
  steps = build(partitioner, model)
  with partitioner.activation_context():
    hlo = steps.train_step.lower(*steps.abstract_inputs(batch_size)).compile().as_text()
  return sum(np.prod([int(n) for n in dims.split(",") if n])
             for dims in re.findall(r"= \w+\[([\d,]*)\][^ ]* all-gather", hlo))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["data8", "data8_zero3", "data2_expert4", "data2_expert4_batch"])
def test_the_expert_layer_keeps_each_devices_tokens_on_that_device(layout):
  """Routing is data-parallel, the experts gathered out of ZeRO-3, not the rows, and tokens
  reach other devices' experts by all-to-all: what the step gathers does not grow with the
  batch. Where the batch is not split over the expert axis (data2_expert4), what grows is each
  device's own tokens gathered back over it: the layer's outputs, and in the backward pass the
  gradients of its input and of the routing weights. Under ZeRO-3 the token table is split
  along its width, and its lookup gathers the batch's token ids (rows go by all-to-all)."""
  device_mesh, config, batch_axes = {
      "data8": ((("data", 8),), sharding_config(), 8),
      "data8_zero3": ((("data", 8),), sharding_config(rules=MOE_RULES, parameter_axis="data"), 8),
      "data2_expert4": ((("data", 2), ("expert", 4)),
                        sharding_config(rules=MOE_RULES, expert_axis="expert"), 2),
      "data2_expert4_batch": ((("data", 2), ("expert", 4)), sharding_config(
          rules=MOE_RULES, expert_axis="expert", activation_axis=("data", "expert")), 8),
  }[layout]
  partitioner = Partitioner(make_mesh(device_mesh), config)
  model = tiny("mixtral")
  growth = gathered_elements(partitioner, model, 32) - gathered_elements(partitioner, model, 16)
  own_tokens = 0 if batch_axes == 8 else 16 // batch_axes * model.seq_len
  per_token = 2 * model.hidden_dim + model.moe.num_experts_per_token
  token_ids = 16 * model.seq_len if config.parameter_axis else 0
  assert growth == own_tokens * per_token * model.num_layers + token_ids


@pytest.mark.parametrize("tensor_axis", [None, "model", "expert"])
def test_inside_the_expert_layer_each_stack_keeps_its_rule_layout(tensor_axis):
  """The layer constrains each expert stack by its logical axes; mapped onto the mesh they must
  give the parameter's own layout, or every layer would move whole stacks between devices.
  (mixtral_8x7b.py maps "mlp" onto the expert axis too: the stack's first dimension has it.)"""
  from levanter_flax.models import mixtral, moe
  config = sharding_config(rules=mixtral.PARTITION_RULES, expert_axis="expert",
                           tensor_axis=tensor_axis)
  partitioner = Partitioner(make_mesh((("data", 1), ("expert", 4), ("model", 2))), config)
  for name, axes in moe.EXPERT_AXES.items():
    in_layer = flax.linen.logical_to_mesh_axes(axes, tuple(partitioner.logical_axes.items()))
    spec = partitioner.rule_spec(f"layers_0/mlp/experts/{name}", (8, 64, 96))
    assert tuple(in_layer) == spec, (name, tensor_axis)
    assert spec[0] == "expert"


@pytest.mark.parametrize("hidden, width", [(64, 96), (96, 64)])
def test_zero3_splits_each_expert_stack_in_the_layer_as_the_partitioner_stores_it(hidden, width):
  """Mixtral's experts are wider than the model (ZeRO-3 splits their width), Qwen3-MoE's
  narrower (it splits the model's width). The layer's shard_map must take each stack as it is
  stored, or each step would move every stack between devices (all-to-alls)."""
  from levanter_flax.models import moe
  config = sharding_config(rules=MOE_RULES, expert_axis="expert",
                           activation_axis=("data", "expert"),
                           parameter_axis=("data", "expert"))
  partitioner = Partitioner(make_mesh((("data", 2), ("expert", 4))), config)
  sizes = {"experts": 8, "embed": hidden, "mlp": width}
  with partitioner.activation_context():
    _, _, specs = moe._layout(dict(partitioner.mesh.shape), (8, 16, hidden), sizes)
  for name, spec in zip(("gate_proj", "up_proj", "down_proj"), specs):
    shape = tuple(sizes[axis] for axis in moe.EXPERT_AXES[name])
    stored = partitioner.param_spec(f"layers_0/mlp/experts/{name}", shape)
    assert tuple(spec) == tuple(stored) and "data" in str(stored), (name, spec, stored)


@pytest.mark.slow
def test_scanned_layers_keep_the_rules_and_the_losses():
  scanned = with_compute(MODEL, scan_layers=True)
  single = one_device_losses(scanned)
  losses, state = train(*LAYOUTS["data2_model4_zero3"], model=scanned)
  np.testing.assert_allclose(losses, single, rtol=1e-5)
  params = {path_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(state.params)}
  # The rules name the trailing axes; ZeRO-3 takes the largest free one, here never the layer axis
  # except where nothing else is free.
  assert spec_of(params["h/attn/c_attn/kernel"]) == (None, "data", "model")
  assert spec_of(params["h/mlp/c_proj/kernel"]) == (None, "model", "data")
  assert spec_of(params["h/ln_2/scale"]) == (None, "data")
  assert spec_of(params["h/attn/c_attn/bias"]) == ("data", "model")


@pytest.mark.slow
def test_params_carry_the_intended_sharding(layout_run):
  name, _, state = layout_run
  params = {path_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(state.params)}
  for param, expected in EXPECTED_SPECS[name].items():
    assert spec_of(params[param]) == expected, (name, param)
  for param, x in params.items():
    shard = x.addressable_shards[0].data
    assert shard.shape == x.sharding.shard_shape(x.shape), (name, param)


def test_optimizer_state_is_sharded_like_its_parameter(layout_run):
  name, _, state = layout_run
  params = {path_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(state.params)}
  moments = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state):
    opt_name = path_name(path)
    owner = [p for p in params if opt_name.endswith("/" + p)]
    if leaf.ndim == 0:
      assert spec_of(leaf) == (), (name, opt_name)  # Step counts are replicated.
      continue
    assert len(owner) == 1, opt_name
    assert spec_of(leaf) == spec_of(params[owner[0]]), (name, opt_name)
    assert leaf.addressable_shards[0].data.shape == params[owner[0]].addressable_shards[0].data.shape
    moments += 1
  assert moments == 2 * len(params)  # Adam's mu and nu for every parameter.


# Per-device share of params + optimizer state: everything when replicated, 1/2
# with the model split in two, 1/8 under ZeRO-3 over 8 devices. With data=2,
# model=4 the matrices are split 8 ways, but position embeddings, LayerNorms and
# the column-split biases only 2 or 4 ways, which on this tiny model is 13.5%.
DEVICE_SHARE = {"data8": 1, "data4_model2": 1 / 2, "data8_zero3": 1 / 8, "data2_model4_zero3": 0.135}


def test_per_device_bytes_shrink_with_sharding(layout_run):
  name, _, state = layout_run
  leaves = jax.tree.leaves((state.params, state.opt_state))
  total = sum(x.nbytes for x in leaves)
  device = jax.devices()[0]
  on_device = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == device)
  assert on_device <= total * DEVICE_SHARE[name] * 1.05, (name, on_device, total)
  assert on_device >= total * DEVICE_SHARE[name] * 0.95, (name, on_device, total)


def test_layout_table_lists_params_and_totals():
  steps = build(Partitioner(make_mesh((("data", 8),)), sharding_config(parameter_axis="data")))
  table = steps.layout_table()
  row = next(line for line in table.splitlines() if line.startswith("wte/embedding "))
  assert "(384, 64)" in row and "('data', None) (no rule)" in row and "(48, 64)" in row
  assert "12.0 KiB" in row
  params_bytes = sum(x.size * 4 for x in jax.tree.leaves(steps.abstract_state.params))
  assert table.splitlines()[-1].startswith(
      f"per device: params {params_bytes / 8 / 1024:.1f} KiB + optimizer state ")


def test_rules_mix_logical_and_mesh_axes_and_the_table_names_what_none_matched():
  rules = ((r"wte/embedding$", ("vocab", "data")), (r"c_fc/kernel$", (None, "mlp")))
  steps = build(Partitioner(make_mesh((("data", 2), ("model", 4))),
                            sharding_config(rules=rules, tensor_axis="model")))
  rows = {line.split()[0]: line for line in steps.layout_table().splitlines()}
  assert "('model', 'data')" in rows["wte/embedding"] and "no rule" not in rows["wte/embedding"]
  assert "(None, 'model')" in rows["h_0/mlp/c_fc/kernel"]
  assert "(None, None) (no rule: replicated)" in rows["h_0/attn/c_attn/kernel"]
  assert steps.unmatched_params == {
      name for name in rows if "/" in name and not name.endswith(("wte/embedding", "c_fc/kernel"))}


@pytest.mark.parametrize("device_mesh, config, model, message", [
    ((("data", 8),), sharding_config(rules=((r"wte/embedding$", ("model", None)),)), MODEL,
     "config.sharding.rules entry 'wte/embedding$' names 'model', which is neither a mesh axis "
     "('data',) (trainer.device_mesh) nor a logical axis (experts, batch, length, embed, heads, "),
    ((("data", 4), ("model", 2)), sharding_config(**TENSOR_PARALLEL),
     GPT2Config(vocab_size=383, seq_len=32, num_layers=1, num_heads=4, hidden_dim=64),
     "parameter wte/embedding (383, 64): dimension 0 (383) is not divisible by mesh axis 'model' of size 2"),
    ((("data", 4), ("model", 2)), sharding_config(strict=True, rules=PARTITION_RULES[:7],
                                                   tensor_axis="model"), MODEL,
     "parameter h_0/attn/c_proj/bias (64,) matches no rule in config.sharding.rules"),
    ((("data", 3), ("model", 2)), sharding_config(), MODEL,
     "trainer.device_mesh {'data': 3, 'model': 2}: the sizes multiply to 6 but there are 8 devices"),
    ((("data", 8),), sharding_config(parameter_axis="fsdp"), MODEL,
     "config.sharding.parameter_axis names mesh axis 'fsdp'"),
    ((("data", 8),), sharding_config(logical_axis_rules=(("length", ("data", "seq")),)), MODEL,
     "config.sharding.logical_axis_rules entry 'length' names mesh axis 'seq', but the mesh has "
     "only ('data',)"),
    ((("data", 8),), sharding_config(logical_axis_rules=(("data", None),)), MODEL,
     "config.sharding.logical_axis_rules entry 'data' is a mesh axis of trainer.device_mesh"),
    ((("data", 8),), sharding_config(rules=models.FAMILIES["llama"].partition_rules), MODEL,
     "config.sharding.rules match none of the model's parameters (e.g. h_0/attn/c_attn/bias)"),
])
def test_bad_layouts_are_named(device_mesh, config, model, message):
  with pytest.raises(UserError, match=re.escape(message)):
    build(Partitioner(make_mesh(device_mesh), config), model)


@pytest.mark.parametrize("name", shipped_configs())
def test_every_shipped_config_has_a_rule_for_every_parameter_and_a_2d_layout(name):
  """With config.sharding.strict no parameter is replicated by accident, and the rules lay
  the model out on the config's mesh axes, each at least 2 wide (data 4), with no devices:
  an AbstractMesh. GPT-2's own vocabulary (50257) and the byte tokenizer's (257) split on no
  model axis, which is named; the configs that pad them (to 50304, 384) do."""
  config = load_config_file(name)
  config.sharding.strict = True
  run = to_run_config(config)
  sizes = {axis: 4 if size == -1 else max(size, 2) for axis, size in run.trainer.device_mesh}
  mesh = jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes))
  partitioner = Partitioner(mesh, run.sharding)
  params = jax.eval_shape(lambda: models.init_params(run.model, jax.random.key(0)))
  if run.model.vocab_size % partitioning.axes_size(partitioner.mesh, run.sharding.tensor_axis):
    with pytest.raises(UserError, match=rf"dimension 0 \({run.model.vocab_size}\) is not "
                                        rf"divisible by mesh axis 'model' of size 2"):
      partitioner.param_shardings(params)
    return
  shardings = partitioner.param_shardings(params)  # Raises for a parameter with no rule.
  model_axes = set(sizes) - {"data"}
  split = [s for s in jax.tree.leaves(shardings) if model_axes & set(jax.tree.leaves(tuple(s.spec)))]
  blocks = 1 if run.model.compute.scan_layers else run.model.num_layers  # Scanned: stacked leaves.
  assert len(split) >= 3 * blocks  # Attention in and out, MLP or experts in and out.
  assert partitioning.per_device_bytes(params, shardings) < sum(
      x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) / 1.5


@pytest.mark.slow
@pytest.mark.parametrize("args, fragment", [
    (['--config.sharding.rules=(("h_(", (None,)),)'], "is not a valid regex"),
    (["--config.trainer.device_mesh.data=3"], "the sizes multiply to 3 but there are 8 devices"),
    (['--config.sharding.logical_axis_rules=(("length", "seq"),)'],
     "config.sharding.logical_axis_rules entry 'length' names mesh axis 'seq', but the mesh has "
     "only ('data', 'model')"),
    (["--config.trainer.device_mesh.model=2", "--config.model.vocab_size=385"],
     "parameter wte/embedding (385, 128): dimension 0 (385) is not divisible by mesh axis 'model' of size 2"),
])
def test_layout_errors_from_the_command_line(data_cache, tmp_path, args, fragment):
  result = run_main(f"--config={NANO}", f"--workdir={tmp_path}", f"--config.data.cache_dir={data_cache}",
                    *args)
  assert_one_line_error(result, fragment)


def test_an_untied_gpt2_head_is_split_by_vocabulary_like_the_embedding():
  untied = dataclasses.replace(MODEL, tie_word_embeddings=False)
  steps = build(Partitioner(make_mesh((("data", 4), ("model", 2))),
                            sharding_config(**TENSOR_PARALLEL)), untied)
  params = {path_name(p): s for p, s in
            jax.tree_util.tree_leaves_with_path(steps.state_shardings.params)}
  assert tuple(params["lm_head/kernel"].spec) == (None, "model")  # [hidden, vocab].
  assert tuple(params["wte/embedding"].spec) == ("model", None)


def test_the_default_table_is_what_the_role_keys_gave():
  """Before sharding.logical_axis_rules the role keys were the table; by default they still are,
  in the same order (flax hands out mesh axes in it), for parameters and activations; "zero3"
  (last, named by no rule) tells a layer that gathers its own weights where ZeRO-3 put them."""
  partitioner = Partitioner(make_mesh((("data", 4), ("model", 2))),
                            to_run_config(default_config()).sharding)
  table = (("experts", None), ("batch", "data"), ("length", None), ("embed", None),
           ("heads", "model"), ("kv_heads", "model"), ("mlp", "model"), ("vocab", "model"),
           ("layers", None), ("zero3", None))
  assert tuple(partitioner.logical_axes.items()) == table
  with partitioner.activation_context():
    assert tuple(flax.linen.get_logical_axis_rules()) == table
  assert partitioner.batch_sharding().spec == jax.sharding.PartitionSpec("data")


@pytest.mark.slow
def test_the_sequence_split_by_the_table_trains_as_on_one_device(single_device_losses):
  """Context-parallel style: "length" onto a mesh axis splits activations' sequence dimension
  and the position embedding's rows (its rule names "length"), by the table alone."""
  config = sharding_config(rules=PARTITION_RULES, logical_axis_rules=(("length", "seq"),))
  device_mesh = (("data", 2), ("seq", 4))
  losses, state = train(device_mesh, config)
  np.testing.assert_allclose(losses, single_device_losses, rtol=1e-5)
  params = {path_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(state.params)}
  assert spec_of(params["wpe/embedding"]) == ("seq", None)
  assert spec_of(params["wte/embedding"]) == (None, None)  # vocab: tensor_axis, here none.
  partitioner = Partitioner(make_mesh(device_mesh), config)
  tokens = jax.device_put(np.zeros((BATCH_SIZE, MODEL.seq_len), np.int32),
                          partitioner.batch_sharding())
  with partitioner.activation_context():
    logits = jax.jit(models.build(MODEL).apply)({"params": state.params}, tokens)
  assert spec_of(logits) == ("data", "seq", None)  # The model's last constraint.


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "gemma3"])
def test_context_parallelism_trains_as_on_one_device(name):
  """The sequence split over a mesh axis by the table alone: each device holds a quarter of
  the batch's sequences, halved by length; attention gathers keys and values over it."""
  family = models.FAMILIES[name]
  model = tiny(name)
  config = sharding_config(rules=family.partition_rules,
                           logical_axis_rules=(("length", "sequence"),))
  eight, _ = train((("data", 4), ("sequence", 2)), config, model=model)
  np.testing.assert_allclose(eight, one_device_losses(model), rtol=1e-5)


def test_a_new_logical_name_in_the_table_serves_the_rules_from_the_config_alone():
  config = default_config()
  config.trainer.device_mesh = mesh(data=2, seq=2, model=2)
  config.model.vocab_size = 50304  # Divisible by the 4 devices of model and seq.
  config.sharding.logical_axis_rules = (("sequence", "seq"), ("vocab", "model,seq"))
  config.sharding.rules = ((r"wpe/embedding$", ("sequence", "embed")),)
  run = to_run_config(config)
  assert run.sharding.logical_axis_rules == (("sequence", "seq"), ("vocab", ("model", "seq")))
  sizes = dict(run.trainer.device_mesh)
  partitioner = Partitioner(jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes)),
                            run.sharding)
  params = jax.eval_shape(lambda: models.init_params(run.model, jax.random.key(0)))
  specs = {path_name(p): tuple(s.spec) for p, s in
           jax.tree_util.tree_leaves_with_path(partitioner.param_shardings(params))}
  assert specs["wpe/embedding"] == ("seq", None)
  assert specs["wte/embedding"] == (("model", "seq"), None)  # The family's rule, remapped.
  assert specs["h_0/mlp/c_fc/kernel"] == (None, "model")  # The role key's, untouched.
