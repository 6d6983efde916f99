"""Pipeline parallelism (models/pipeline.py) on 8 fake CPU devices: each layout trains as one
device does, resumes on another stage count, and bad settings are one line."""
import dataclasses
import re
import shutil
import types

import jax
import numpy as np
import pytest
from absl import flags

from conftest import train_losses
from levanter_flax import models
from levanter_flax.config import loading, mesh, to_run_config
from levanter_flax.core.errors import UserError
from levanter_flax.models import moe, pipeline
from levanter_flax.models.lora import LoraConfig
from levanter_flax.models.moe import MoeConfig
from levanter_flax.models.common import ComputeConfig
from levanter_flax.parallel.partitioning import Partitioner, make_mesh
from levanter_flax.plan import planner
from levanter_flax.training import step
from levanter_flax.training.loop import train_and_evaluate
from test_main import NANO
from test_partitioning import BATCH_SIZE, build, sharding_config, tiny

NUM_STEPS = 5


@dataclasses.dataclass(frozen=True)
class Layout:
  """A mesh and what runs on it; the batch of 8 rows is cut into `accumulation` microbatches,
  each into `microbatches` that split over the batch's axes."""
  device_mesh: tuple
  microbatches: int
  repeats: int = 1
  sharding: dict = dataclasses.field(default_factory=dict)  # sharding_config's arguments.
  accumulation: int = 1
  remat: str = "none"
  remat_stages: bool = False


LAYOUTS = {
    "stage2_data4": Layout((("stage", 2), ("data", 4)), 2),
    "stage4_data2": Layout((("stage", 4), ("data", 2)), 4),
    "stage2_model2_data2": Layout((("stage", 2), ("model", 2), ("data", 2)), 2,
                                  sharding={"tensor_axis": "model"}),
    "stage2_data4_repeats2": Layout((("stage", 2), ("data", 4)), 2, repeats=2),
    # ZeRO-3 over data, tensor parallelism, full remat and two accumulated microbatches at once.
    "stage2_model2_data2_zero3_remat_accumulation2": Layout(
        (("stage", 2), ("model", 2), ("data", 2)), 2, accumulation=2, remat="full",
        sharding={"tensor_axis": "model", "parameter_axis": "data"}),
    # More microbatches than stages: the last stage's outputs wait in the queue.
    "stage2_model2_data2_microbatches4": Layout(
        (("stage", 2), ("model", 2), ("data", 2)), 4, sharding={"tensor_axis": "model"}),
    "stage2_model2_data2_microbatches4_repeats2": Layout(
        (("stage", 2), ("model", 2), ("data", 2)), 4, repeats=2,
        sharding={"tensor_axis": "model"}),
    # Each stage recomputed in the backward pass from its input, its layers remat'ed within.
    "stage4_data2_remat_stages": Layout((("stage", 4), ("data", 2)), 4, remat="full",
                                        remat_stages=True),
}
# A mixture's experts split over an expert axis too: tokens dispatched by all-to-all within
# each stage.
EXPERT_LAYOUT = Layout((("stage", 2), ("data", 2), ("expert", 2)), 2,
                       sharding={"expert_axis": "expert", "parameter_axis": "data"})


def model_of(name: str, remat: str = "none", **fields):
  return tiny(name, num_layers=4, compute=ComputeConfig(scan_layers=True, remat=remat), **fields)


def trained(name: str, layout: Layout, devices=None, **fields):
  """(losses of NUM_STEPS steps, the gradient at the first batch, the steps, the last state),
  on fixed random batches; `fields`: the model's, over the tiny one's."""
  model = model_of(name, layout.remat, **fields)
  config = pipeline.PipelineConfig(microbatches=layout.microbatches, repeats=layout.repeats,
                                   remat_stages=layout.remat_stages)
  accumulation = layout.accumulation
  partitioner = Partitioner(make_mesh(layout.device_mesh, devices), sharding_config(
      rules=models.FAMILIES[name].partition_rules, strict=True, **layout.sharding))
  steps = build(partitioner, model, pipeline=config, accumulation=accumulation)
  tokens = np.random.default_rng(0).integers(0, 257, (NUM_STEPS, BATCH_SIZE, model.seq_len))
  batches = [{"tokens": jax.device_put(t.astype(np.int32), steps.batch_sharding)} for t in tokens]
  gradient = step.scheduled_by(steps.pipeline_schedule, config)(
      lambda params, frozen, batch: step.accumulated_loss_and_grads(
          models.build(model), params, batch, accumulation, frozen=frozen)[1])
  losses = []
  with partitioner.activation_context():
    state = steps.init(jax.random.key(0))
    grads = jax.device_get(jax.jit(gradient)(state.params, state.frozen, batches[0]))
    for batch in batches:
      state, metrics = steps.train_step(state, batch)
      losses.append(float(metrics["train/loss"]))
  return np.array(losses), grads, steps, state


_REFERENCE = {}


def one_device(name: str, accumulation: int):
  """The one-device run a layout is held to: a mixture's router losses are each microbatch's,
  so its reference accumulates as many microbatches as the pipeline and accumulation cut."""
  if (name, accumulation) not in _REFERENCE:
    _REFERENCE[name, accumulation] = trained(
        name, Layout((("data", 1),), 0, accumulation=accumulation),
        devices=jax.devices()[:1])[:2]
  return _REFERENCE[name, accumulation]


def assert_trains_as_on_one_device(name: str, layout: str):
  spec = EXPERT_LAYOUT if layout == "expert" else LAYOUTS[layout]
  losses, grads, steps, _ = trained(name, spec)
  assert steps.pipeline_schedule == (dict(spec.device_mesh)["stage"], spec.microbatches,
                                     spec.repeats, spec.remat_stages)
  cuts = spec.accumulation * spec.microbatches if name == "mixtral" else 1
  one_losses, one_grads = one_device(name, cuts)
  np.testing.assert_allclose(losses, one_losses, rtol=1e-5, err_msg=layout)
  for path, got, want in zip(jax.tree_util.tree_leaves_with_path(grads),
                             jax.tree.leaves(grads), jax.tree.leaves(one_grads)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(),
                               err_msg=f"{layout} {jax.tree_util.keystr(path[0])}")


def test_gpt2_trains_in_two_stages_as_on_one_device():
  assert_trains_as_on_one_device("gpt2", "stage2_data4")


@pytest.mark.slow
@pytest.mark.parametrize("name, layout", [
    (name, layout) for name in ("gpt2", "llama", "mixtral") for layout in sorted(LAYOUTS)
    if (name, layout) != ("gpt2", "stage2_data4")] + [("mixtral", "expert")])
def test_each_layout_trains_as_on_one_device(name, layout):
  assert_trains_as_on_one_device(name, layout)


@pytest.mark.slow
def test_lora_adapters_train_in_stages_as_on_one_device():
  """The layers run apart from their stack keep its names, which LoRA's targets match: the
  adapters' gradients and the losses are one device's."""
  lora_cfg = LoraConfig(rank=4, alpha=8.0)
  losses, grads, _, _ = trained("llama", LAYOUTS["stage2_data4"], lora=lora_cfg)
  one, one_grads, _, _ = trained("llama", Layout((("data", 1),), 0), devices=jax.devices()[:1],
                                 lora=lora_cfg)
  np.testing.assert_allclose(losses, one, rtol=1e-5)
  adapters = {jax.tree_util.keystr(path): g for path, g in jax.tree_util.tree_leaves_with_path(grads)}
  assert any("lora_b" in name and np.abs(g).max() > 0 for name, g in adapters.items())
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(one_grads)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.slow
def test_sigmoid_routers_balance_as_under_accumulation():
  """The copies per expert that move a sigmoid router's biases add up over the microbatches, as
  accumulation's: losses and the biases after 5 steps are one device's."""
  moe_cfg = MoeConfig(scoring="sigmoid", bias_update_rate=0.01)
  layout = LAYOUTS["stage2_data4"]
  losses, _, _, state = trained("mixtral", layout, moe=moe_cfg)
  one, _, _, one_state = trained("mixtral", Layout((("data", 1),), 0, accumulation=2),
                                 devices=jax.devices()[:1], moe=moe_cfg)
  np.testing.assert_allclose(losses, one, rtol=1e-5)
  biases = [np.asarray(s.params["layers"]["mlp"][moe.BIAS]) for s in (state, one_state)]
  assert biases[0].shape == (4, 8)
  np.testing.assert_allclose(*biases, atol=1e-6)
  assert np.abs(biases[1]).max() > 0.001


def test_the_stages_hold_their_layers_and_pass_activations_on():
  """Each stack's layer dimension is split over the stages, and the compiled step sends
  activations from stage to stage (collective permutes) without gathering any layer stack."""
  partitioner = Partitioner(make_mesh(LAYOUTS["stage2_data4"].device_mesh), sharding_config(
      rules=models.FAMILIES["gpt2"].partition_rules))
  steps = build(partitioner, model_of("gpt2"), pipeline=pipeline.PipelineConfig(microbatches=2))
  stacks = {path: x for path, x in jax.tree_util.tree_leaves_with_path(steps.abstract_state.params)
            if path[0].key == "h"}
  assert stacks and all(x.sharding.spec[0] == "stage" for x in stacks.values())
  with partitioner.activation_context():
    hlo = steps.train_step.lower(*steps.abstract_inputs(BATCH_SIZE)).compile().as_text()
  assert "collective-permute" in hlo
  gathered = set(re.findall(r"= f32\[([\d,]+)\]\S* all-gather\(", hlo))
  whole = [x.shape for x in stacks.values()]
  staged = [(2, 1, shape[0] // 2, *shape[1:]) for shape in whole]  # [stage, repeat, chunk, ...]
  assert not gathered & {",".join(map(str, shape)) for shape in whole + staged}, gathered


def test_the_stage_axis_splits_nothing_but_the_layers():
  with pytest.raises(UserError, match=r"config.sharding.tensor_axis names mesh axis 'stage', "
                                      r"which holds a pipeline's stages"):
    Partitioner(make_mesh((("stage", 2), ("data", 4))), sharding_config(tensor_axis="stage"))


def test_the_bubble_is_the_schedules():
  assert pipeline.Schedule(4, 8, 1).bubble == pytest.approx(3 / 11)
  assert pipeline.Schedule(4, 8, 2).bubble == pytest.approx(3 / 19)
  assert pipeline.Schedule(2, 2, 1).describe() == (
      "2 stages x 1 repeats, 2 microbatches: 3 iterations, bubble 33.3%")
  assert pipeline.Schedule(2, 2, 1, remat=True).describe().endswith(", stages rematerialised")


@pytest.mark.slow
def test_a_staged_run_resumes_on_other_stage_counts(tiny_config, tmp_path, caplog):
  """Checkpoints keep the layers unstaged: a 4-stage run's checkpoint resumes in 1 and in 2
  stages, each as the 1-stage run that never stopped."""
  tiny_config.model.num_layers = 4
  tiny_config.model.compute.scan_layers = True
  tiny_config.trainer.num_train_steps = 6
  tiny_config.checkpoint.every_steps = 3
  train_and_evaluate(to_run_config(tiny_config), tmp_path / "whole")
  tiny_config.trainer.num_train_steps = 3
  tiny_config.trainer.device_mesh = mesh(stage=4, data=2, model=1)
  tiny_config.trainer.pipeline.microbatches = 4
  with caplog.at_level("INFO"):
    train_and_evaluate(to_run_config(tiny_config), tmp_path / "staged")
  assert "Pipeline: 4 stages x 1 repeats, 4 microbatches: 7 iterations, bubble 42.9%" in caplog.text
  shutil.copytree(tmp_path / "staged", tmp_path / "staged_again")
  tiny_config.trainer.num_train_steps = 6
  whole = train_losses(tmp_path / "whole")
  for stages, workdir in ((1, "staged"), (2, "staged_again")):
    tiny_config.trainer.device_mesh = mesh(stage=stages, data=8 // stages, model=1)
    tiny_config.trainer.pipeline.microbatches = 0
    train_and_evaluate(to_run_config(tiny_config), tmp_path / workdir)
    resumed = train_losses(tmp_path / workdir)
    np.testing.assert_allclose([resumed[s] for s in range(1, 7)], [whole[s] for s in range(1, 7)],
                               rtol=1e-5, err_msg=f"{stages} stages")


@pytest.mark.parametrize("fields, device_mesh, settings, message", [
    ({"num_layers": 3}, (("stage", 2), ("data", 4)), {},
     r"trainer.device_mesh stage=2 x trainer.pipeline.repeats \(1\) = 2 must divide "
     r"config.model.num_layers \(3\)"),
    ({}, (("stage", 2), ("data", 4)), {"repeats": 4},
     r"stage=2 x trainer.pipeline.repeats \(4\) = 8 must divide config.model.num_layers \(4\)"),
    ({}, (("stage", 4), ("data", 2)), {"microbatches": 2},
     r"trainer.pipeline.microbatches \(2\) must be at least the stages"),
    ({"compute": ComputeConfig(scan_layers=False)}, (("stage", 2), ("data", 4)), {},
     r"stage=2 pipelines a scanned layer stack: set config.model.compute.scan_layers=True"),
])
def test_layouts_that_cannot_pipeline_are_named(fields, device_mesh, settings, message):
  model = dataclasses.replace(model_of("gpt2"), **fields)
  partitioner = Partitioner(make_mesh(device_mesh), sharding_config(
      rules=models.FAMILIES["gpt2"].partition_rules))
  with pytest.raises(UserError, match=message):
    build(partitioner, model, pipeline=pipeline.PipelineConfig(**settings))


def test_deepseeks_two_stacks_are_refused():
  partitioner = Partitioner(make_mesh((("stage", 2), ("data", 4))), sharding_config())
  with pytest.raises(UserError, match=r"stage=2: deepseek_v3 stacks its kinds of layer apart"):
    build(partitioner, tiny("deepseek_v3", compute=ComputeConfig(scan_layers=True)))


@pytest.mark.parametrize("settings, message", [
    ({"microbatches": -1}, r"config.trainer.pipeline.microbatches must be >= 0 \(0: the stages\); got -1"),
    ({"repeats": 0}, r"config key config.trainer.pipeline.repeats must be positive, got 0"),
])
def test_bad_pipeline_settings_are_named(settings, message):
  with pytest.raises(UserError, match=message):
    pipeline.PipelineConfig(**settings)


def test_a_batch_the_microbatches_cannot_split_is_named(tiny_config, tmp_path):
  tiny_config.model.num_layers = 4
  tiny_config.model.compute.scan_layers = True
  tiny_config.trainer.device_mesh = mesh(stage=2, data=4, model=1)
  tiny_config.trainer.pipeline.microbatches = 4
  with pytest.raises(UserError, match=r"config.trainer.batch_size / gradient_accumulation_steps "
                                      r"\(8\) must be divisible by trainer.pipeline.microbatches "
                                      r"\(4\) x the activation axis size \(4\)"):
    train_and_evaluate(to_run_config(tiny_config), tmp_path)


def test_a_stage_axis_is_added_to_the_mesh_from_the_command_line():
  """--config.trainer.device_mesh.stage=N adds the axis the config's mesh lacks, outermost."""
  argv = ["train", f"--config={NANO}", "--config.trainer.device_mesh.stage=2",
          "--config.trainer.dcn_mesh.stage=2", "--config.trainer.dcn_mesh.data=1"]
  values = flags.FlagValues()
  loading.define_config_flag("the config", values, sys_argv=argv)
  values(argv)
  run = loading.run_config_of_flags(values)
  assert run.trainer.device_mesh == (("stage", 2), ("data", -1), ("model", 1))
  assert run.trainer.dcn_mesh == (("stage", 2), ("data", 1))
  mistyped = ["train", f"--config={NANO}", "--config.trainer.device_mesh.dta=2"]
  values = flags.FlagValues()
  loading.define_config_flag("the config", values, sys_argv=mistyped)
  with pytest.raises(AttributeError, match="dta"):  # Only the stage axis is added.
    values(mistyped)


def test_the_batch_search_refuses_a_pipelined_run(tiny_config, tmp_path):
  tiny_config.model.num_layers = 4
  tiny_config.model.compute.scan_layers = True
  tiny_config.trainer.device_mesh = mesh(stage=2, data=4, model=1)
  tiny_config.trainer.batch_size = "auto"
  with pytest.raises(UserError, match=r"config.trainer.batch_size=auto does not search a "
                                      r"pipelined run's batch"):
    train_and_evaluate(to_run_config(tiny_config), tmp_path)


@pytest.mark.parametrize("device_mesh, dcn_mesh, opposite", [
    ((("stage", 1), ("data", -1), ("model", 8)), (("stage", 4), ("data", 1)),
     ((("stage", 4), ("data", -1), ("model", 8)), (("stage", 1), ("data", 4)))),
    # configs/llama.py:70b's: a stage per slice.
    ((("stage", 1), ("data", -1), ("model", 8)), (("stage", -1), ("data", 1)),
     ((("stage", 4), ("data", -1), ("model", 8)), (("stage", 1), ("data", 4)))),
    ((("data", 8),), (("stage", 2), ("data", -1)),
     ((("stage", 2), ("data", 4)), (("stage", 1), ("data", 4)))),
    ((("data", 8), ("stage", 1)), (("stage", 4),),  # The axes' order kept.
     ((("data", 2), ("stage", 4)), (("stage", 1), ("data", 4)))),
    ((("data", 6),), (("stage", 4),), None),  # The stages do not divide the data inside.
    ((("stage", 1), ("data", 1), ("model", 8)), (("stage", 4),), None),  # No data inside.
    ((("stage", 2), ("data", -1)), (("data", 4),), None),  # The stages are inside already.
])
def test_the_opposite_of_stages_across_slices_keeps_the_other_sizes(device_mesh, dcn_mesh,
                                                                     opposite):
  trainer = types.SimpleNamespace(device_mesh=device_mesh, dcn_mesh=dcn_mesh)
  assert planner.stages_inside_slices(trainer, num_slices=4) == opposite
