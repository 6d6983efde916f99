"""The fit plan: the trainer's step compiled for TPU topologies by libtpu, on this CPU machine."""
import importlib.util
import json
import subprocess
import sys

import jax
import pytest

from conftest import REPO, load_config_file
from levanter_flax import models
from levanter_flax.models import pipeline
from levanter_flax.plan import hlo, planner, slices
from levanter_flax.parallel import partitioning
from levanter_flax.config import to_run_config
from levanter_flax.core.errors import UserError
from test_main import NANO, assert_one_line_error

KEYS = ("topology", "chips", "hbm_per_chip_bytes", "bytes_per_chip", "temp_bytes_per_chip",
        "fits", "model_flops_per_step", "compiler_flops_per_step", "compiler_bound_seconds",
        "tokens_per_step", "collective_bytes_per_step")


@pytest.mark.parametrize("name,chips", [
    ("v4-32", 16), ("v4-8", 4), ("v5p-128", 64), ("v5p-8", 4), ("v5e-256", 256), ("v5e-8", 8),
    ("v5litepod-16", 16), ("v6e-64", 64), ("v5e:16x16", 256), ("v5p:4x4x4", 64),
    ("v4:2x2x4", 16)])
def test_cloud_names_count_cores_on_v4_and_v5p_and_chips_on_v5e_and_v6e(name, chips):
  assert slices.chips(name) == chips


@pytest.mark.parametrize("name", ["v5e-3", "v5p-3", "v9-8", "tpu", "v5e:4x4x4", "v5p:4x4"])
def test_an_unknown_topology_is_one_line_with_examples(name):
  with pytest.raises(UserError, match=r"^--topology=.*(v5p-128|sizes are)"):
    slices.topology(name)


def test_without_libtpu_the_error_names_the_extra(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "libtpu" else real(name, *a))
  with pytest.raises(UserError, match=r"pip install -e \"\.\[tpu-aot\]\""):
    slices.devices("v5e:2x2")


def test_collective_bytes_count_tuples_async_outputs_loops_permutes_and_what_crosses_slices():
  text = "\n".join([
      "HloModule jit_train_step, is_scheduled=true, num_partitions=4",
      "%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {",
      "  %g = bf16[64]{0} all-gather(%x), channel_id=7, dimensions={0}",  # 3 times: 384 bytes.
      "}",
      "%fused (param_0: bf16[32]) -> bf16[64] {",  # An async fusion's copy of channel 7.
      "  %g2 = bf16[64]{0} all-gather(%param_0), channel_id=7, dimensions={0}",
      "}",
      "%cond (p: (s32[], f32[4])) -> pred[] {",
      "  %bound = s32[]{:T(128)} constant(3)",
      "  ROOT %lt = pred[] compare(%i, %bound), direction=LT",
      "}",
      "ENTRY %main (a: f32[10]) -> f32[7] {",
      "  %a = (f32[10]{0}, f32[5]{0}) all-reduce(%x, %y), channel_id=1",  # Combined: 15 floats.
      "  %b = ((bf16[2,3]{1,0}, bf16[4]{0}), (bf16[4,3]{1,0}, bf16[8]{0})) all-gather-start(%p), "
      "channel_id=2",
      "  %c = (f32[192]{0}, f32[6]{0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%p), "
      "channel_id=3",
      # A cyclic shift's two phases, each received by half of the 4 chips: 16 bytes each.
      "  %s0 = f32[8]{0} collective-permute(%z), channel_id=9, "
      "source_target_pairs={{2,0},{3,1}}",
      "  %s1 = f32[8]{0} collective-permute(%z), channel_id=10, "
      "source_target_pairs={{0,2},{1,3}}",
      "  %d = bf16[64]{0} reduce-scatter(%z), channel_id=4, dimensions={0}",
      # The smaller of its operand (%rows: 16 x 8 bf16) and its buffer (64 rows); and back.
      "  %rows = bf16[16,8]{1,0:T(8,128)(2,1)} copy-done(%rows-start)",
      "  %r = bf16[64,8]{1,0} ragged-all-to-all(%rows, %buffer, %o, %s, /*index=5*/%p, %q), "
      "channel_id=6",
      "  %back = bf16[16,8]{1,0} ragged-all-to-all(%r, %rows, %o, %s, /*index=5*/%p, %q), "
      "channel_id=8",
      "  %send = (f32[192,32]{0,1:T(8,128)}, u32[], token[]) send(%p, %t), channel_id=5, "
      "is_host_transfer=true, frontend_attributes={_xla_megascale_transfer_type=\"ALL_REDUCE\"}",
      "  %k = f32[4]{0} custom-call(%q), custom_call_target=\"tpu_custom_call\", backend_config={",
      "}}, metadata={}",  # A Pallas kernel's config spans lines.
      "  %w = (s32[], f32[4]) while(%t0), condition=%cond, body=%body",
      "  %f = bf16[64]{0} fusion(%h), kind=kCustom, calls=%fused",
      "  ROOT %e = f32[7]{0} add(%all-gather, %all-reduce)",
      "}"])
  assert hlo.collective_bytes(text) == {
      "all-reduce": 60, "all-gather": (12 + 8) * 2 + 3 * 128, "collective-permute": 24 + 2 * 16,
      "reduce-scatter": 128, "all-to-all": 0, "ragged-all-to-all": 2 * 16 * 8 * 2,
      "all-reduce across slices": 192 * 32 * 4}


def nano(**overrides):
  """gpt2_nano's run, made smaller, with `overrides` ({"trainer.batch_size": 8, ...})."""
  config = load_config_file("gpt2_nano")
  config.model.num_layers = 2
  for key, value in overrides.items():
    section, name = key.rsplit(".", 1)
    node = config
    for part in section.split("."):
      node = node[part]
    node[name] = value
  return to_run_config(config)


@pytest.mark.slow
def test_the_command_prints_and_writes_every_key(tmp_path):
  pytest.importorskip("libtpu")
  output = tmp_path / "plan.json"
  result = subprocess.run([sys.executable, "-m", "levanter_flax.commands.aot", f"--config={NANO}",
                           "--topology=v5e-4", "--config.model.num_layers=2",
                           # XLA's attention: the compiler counts no FLOPs inside a Pallas kernel.
                           "--config.model.compute.attention_impl=xla", f"--output={output}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  plan = json.loads(output.read_text())
  assert set(KEYS) <= set(plan)
  assert plan["chips"] == 4 and plan["fits"] and plan["tokens_per_step"] == 16 * 128
  assert 0 < plan["temp_bytes_per_chip"] < plan["bytes_per_chip"] < plan["hbm_per_chip_bytes"]
  assert plan["collective_bytes_per_step"]["all-reduce"] > 0  # The gradients, data parallel.
  # The compiler's count has the optimizer and the loss besides the model's matmuls.
  assert 1 <= plan["compiler_flops_per_step"] / plan["model_flops_per_step"] < 1.3
  assert "fits" in result.stdout and "not a step time" in result.stdout
  # libtpu's start-up on a machine that is no TPU VM says nothing.
  for noise in ("Source Location Trace", "could not determine TPU", "Failed to find host bounds",
                "Unable to initialize backend 'tpu'"):
    assert noise not in result.stderr, result.stderr


def test_no_tensorflow_on_the_compile_side():
  code = "import sys, levanter_flax.commands.aot; assert 'tensorflow' not in sys.modules"
  subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


@pytest.mark.slow
def test_a_step_that_does_not_fit_exits_1_with_the_shortfall_and_a_remedy():
  pytest.importorskip("libtpu")
  result = subprocess.run([sys.executable, "-m", "levanter_flax.commands.aot", f"--config={NANO}",
                           "--topology=v5e-4", "--config.model.num_layers=2",
                           "--config.trainer.batch_size=65536"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
  assert_one_line_error(result, "GiB per chip more than v5e-4's HBM; try ")
  assert "does NOT fit" in result.stdout


@pytest.mark.slow
def test_no_batch_fits_names_what_could_help_and_counts_the_state(tmp_path):
  """Two 8192-wide layers outgrow a v5e chip whatever the batch: batch 4 is already one
  sequence per device, so the smallest step is this step, its state counted as well."""
  pytest.importorskip("libtpu")
  plan_file = tmp_path / "plan.json"
  result = subprocess.run([sys.executable, "-m", "levanter_flax.commands.aot", f"--config={NANO}",
                           "--topology=v5e-4", "--config.model.num_layers=2",
                           "--config.model.hidden_dim=8192", "--config.trainer.batch_size=4",
                           f"--output={plan_file}"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
  assert_one_line_error(result, "no batch fits", "sharding.parameter_axis=data",
                        "model.compute.remat=full", "more chips")
  assert "smaller trainer.batch_size" not in result.stderr
  plan = json.loads(plan_file.read_text())
  assert plan["smallest_step_bytes_per_chip"] == plan["bytes_per_chip"]


@pytest.mark.slow
def test_accumulation_sends_no_more_across_slices_than_one_microbatch():
  """The data-center network carries one gradient reduction a step, however many microbatches
  (step._cross_slice_batch_axis keeps the accumulator unreduced over the slices)."""
  pytest.importorskip("libtpu")
  across = []
  for microbatches in (1, 4):
    plan = planner.plan(nano(**{"trainer.device_mesh": {"data": 2, "model": 2},
                                "trainer.batch_size": 32,
                                "trainer.gradient_accumulation_steps": microbatches}),
                        "v5e:2x2", num_slices=2, compiler_costs=False)
    across.append(plan["collective_bytes_per_step"]["all-reduce across slices"])
  # One reduction either way (4 per step were 3.8x one's); the layouts differ a little.
  assert 0 < across[1] <= 1.05 * across[0], across


def test_a_batch_the_topologys_data_axis_cannot_split_is_one_line():
  pytest.importorskip("libtpu")
  with pytest.raises(UserError, match=r"^config.trainer.batch_size \(16\) / "
                                      r"gradient_accumulation_steps \(1\) must be divisible by "
                                      r"the activation axis size \(12\)"):
    planner.plan(nano(**{"trainer.batch_size": 16}), "v4:2x2x3", compiler_costs=False)


@pytest.mark.parametrize("name", ["v5e:1x1", "v6e-1"])
def test_a_one_chip_vm_is_a_topology(name):
  """v5litepod-1 and v6e-1: libtpu's default host is 2x2 chips, which a 1x1 slice cannot hold."""
  pytest.importorskip("libtpu")
  [chip] = slices.devices(name)
  assert chip.device_kind in slices.HBM_BYTES


def test_a_topology_libtpu_does_not_make_is_one_line_naming_the_shapes():
  pytest.importorskip("libtpu")
  with pytest.raises(UserError, match=r"^--topology=v5e:3x3: .* v5e comes in 1x1, 2x2, 2x4"):
    slices.devices("v5e:3x3")


@pytest.mark.slow
def test_a_dpo_plan_holds_and_runs_the_reference_model():
  pytest.importorskip("libtpu")
  run = nano()
  plain = planner.plan(run, "v5e:2x2", compiler_costs=False)
  dpo = planner.plan(run, "v5e:2x2", compiler_costs=False, objective_name="dpo")
  assert (plain["objective"], dpo["objective"]) == ("next_token", "dpo")
  params = jax.eval_shape(lambda: models.init_params(run.model, jax.random.key(0)))
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  # Replicated as the params are (nano's mesh is data-parallel): a whole copy per chip.
  assert dpo["argument_bytes_per_chip"] >= plain["argument_bytes_per_chip"] + param_bytes
  tokens = run.trainer.batch_size * run.model.seq_len
  assert dpo["model_flops_per_step"] == pytest.approx(
      tokens * models.flops_per_token(run.model, params, reference=True))
  assert dpo["model_flops_per_step"] > 1.3 * plain["model_flops_per_step"]
  # GRPO's generations hold the state and the engine's cache of a completion per row.
  grpo = planner.plan(run, "v5e:2x2", compiler_costs=False, objective_name="grpo")
  # (test_batch_search counts them; here, that the plan does.)
  cache = 2 * run.model.num_layers * run.trainer.batch_size * run.model.seq_len * (
      run.model.hidden_dim) * 2 // 4  # Keys and values of 2 bytes or more, rows over 4 chips.
  assert grpo["generation_bytes_per_chip"] > cache
  assert "memory per chip while generating" in planner.describe(grpo)


def test_a_mesh_of_another_size_than_the_topology_is_one_line():
  pytest.importorskip("libtpu")
  with pytest.raises(UserError, match=r"trainer.device_mesh .* multiply to 8 but there are 4 "
                     r"devices: v5e:2x2 x 1 slice\(s\) has 4 chips"):
    planner.plan(nano(**{"trainer.device_mesh": {"data": 8}}), "v5e:2x2")


def test_a_mesh_the_torus_cannot_hold_axis_by_axis_is_still_built():
  """Mixtral's data x expert = 8 x 8 on v5p-128's 4x4x4 chips: jax's torus-following layout
  has no such split; the mesh splits a physical axis instead."""
  pytest.importorskip("libtpu")
  mesh = partitioning.make_mesh((("data", -1), ("expert", 8)), slices.devices("v5p-128"))
  assert dict(mesh.shape) == {"data": 8, "expert": 8}


@pytest.mark.slow
def test_auto_batch_accumulates_to_its_target_within_the_target_chip(monkeypatch):
  """The batch search against the TPU's HBM; the compiler refuses what does not fit. The plan
  reads the chosen step's program from the search, not compiling it again (its FLOPs are
  counted on a step of one microbatch, compiled for them)."""
  pytest.importorskip("libtpu")
  compile_step = planner._compile  # pylint: disable=protected-access

  def only_one_microbatch(run, *args):
    if run.trainer.gradient_accumulation_steps > 1:
      pytest.fail("compiled again")
    return compile_step(run, *args)
  monkeypatch.setattr(planner, "_compile", only_one_microbatch)
  budget = 19 << 20  # The nano needs 17.0 MiB a chip at one sequence a step, 19.9 at eight.
  fraction = budget / slices.HBM_BYTES["TPU v5 lite"]
  plan = planner.plan(nano(**{"trainer.batch_size": "auto", "batch_search.target_batch_size": 32,
                              "batch_search.memory_fraction": fraction}), "v5e:2x2")
  assert plan["batch_size"] == 32 and plan["gradient_accumulation_steps"] > 1
  assert plan["bytes_per_chip"] <= budget


@pytest.mark.slow
def test_a_scanned_stack_is_counted_as_the_unrolled_one():
  """The compiler counts a loop's body once: its FLOPs are extrapolated from unrolled compiles
  of 2 and 4 layers, its collectives counted as often as the loop runs."""
  pytest.importorskip("libtpu")
  # 3 layers: the scanned plan's counts come from compiles of 2 and 4 unrolled layers.
  layout = {"model.num_layers": 3, "trainer.device_mesh": {"data": 2, "model": 2},
            "sharding.parameter_axis": "data"}
  unrolled = planner.plan(nano(**layout), "v5e:2x2")
  scanned = planner.plan(nano(**layout, **{"model.compute.scan_layers": True}), "v5e:2x2")
  assert scanned["compiler_flops_per_step"] == pytest.approx(
      unrolled["compiler_flops_per_step"], rel=0.01)
  assert scanned["model_flops_per_step"] == unrolled["model_flops_per_step"]
  # Each kind within 3% or 128 KiB: outside the loop the scanned step gathers 114,688 bytes more
  # than the unrolled one (seen), 6% of nano's gathers under tensor parallelism.
  for kind, unrolled_bytes in unrolled["collective_bytes_per_step"].items():
    assert scanned["collective_bytes_per_step"][kind] == pytest.approx(
        unrolled_bytes, rel=0.03, abs=128 << 10), kind


@pytest.mark.slow
def test_two_slices_reduce_gradients_across_slices_and_nothing_else():
  pytest.importorskip("libtpu")
  run = nano(**{"trainer.device_mesh": {"data": 2, "model": 2},
                "model.compute.scan_layers": True})
  plan = planner.plan(run, "v5e:2x2", num_slices=2, compiler_costs=False)  # No unrolled compiles.
  assert plan["compiler_flops_per_step"] is None and plan["compiler_bound_seconds"] is None
  assert plan["chips"] == 8 and plan["mesh"] == {"data": 4, "model": 2}
  across = {k: v for k, v in plan["collective_bytes_per_step"].items() if "across" in k and v}
  assert set(across) == {"all-reduce across slices"}
  # Once per step: each chip sends its share of the gradients, about a quarter of them (those the
  # model axis replicates, norms and biases, are reduced whole).
  shapes = jax.eval_shape(lambda: models.init_params(run.model, jax.random.key(0)))
  gradient_bytes = sum(x.size * 4 for x in jax.tree.leaves(shapes))
  assert gradient_bytes / 4 <= across["all-reduce across slices"] < gradient_bytes / 2


@pytest.mark.slow
def test_a_pipelined_step_is_counted_as_its_loops_unrolled():
  """A pipelined step's FLOPs come from compiles of one and two layers a stage, its loops
  unrolled: the count of the whole step unrolled, and no more than the data-parallel step's
  with the layers' idle stage-iterations (the bubble's, computed on nothing) besides. (Counted
  once, the loops made it 0.24 to 0.35 of the data-parallel count.)"""
  pytest.importorskip("libtpu")
  layout = {"model.num_layers": 6, "model.compute.scan_layers": True, "trainer.batch_size": 16}
  staged = {"trainer.device_mesh": {"stage": 2, "data": 2, "model": 1},
            "trainer.pipeline.microbatches": 2}
  pipelined = planner.plan(nano(**layout, **staged), "v5e:2x2")
  run = nano(**layout, **staged)
  mesh = partitioning.make_mesh(run.trainer.device_mesh, slices.devices("v5e:2x2"))
  partitioner = partitioning.Partitioner(mesh, run.sharding)
  jax.clear_caches()
  with pipeline.unrolled_loops():
    whole = planner._costs(planner._compile(  # pylint: disable=protected-access
        run, partitioner, planner._steps(run, partitioner, planner.step.NEXT_TOKEN)), 4)
  jax.clear_caches()
  assert pipelined["compiler_flops_per_step"] == pytest.approx(whole.flops, rel=0.01)
  data_parallel = planner.plan(nano(**layout, **{"trainer.device_mesh": {"data": 4, "model": 1}}),
                               "v5e:2x2")
  bubble = pipeline.Schedule(**pipelined["pipeline"])
  over = pipelined["compiler_flops_per_step"] / data_parallel["compiler_flops_per_step"]
  assert 1.2 <= over <= 1.05 / (1 - bubble.bubble), over


@pytest.mark.slow
def test_accumulated_microbatches_are_each_counted():
  """The compiler counts accumulation's loop body once: the plan counts one microbatch's step
  times their count, the FLOPs of the same batch in one."""
  pytest.importorskip("libtpu")
  layout = {"trainer.batch_size": 16, "trainer.device_mesh": {"data": 4, "model": 1}}
  whole = planner.plan(nano(**layout), "v5e:2x2")
  accumulated = planner.plan(nano(**layout, **{"trainer.gradient_accumulation_steps": 2}),
                             "v5e:2x2")
  assert accumulated["compiler_flops_per_step"] == pytest.approx(
      whole["compiler_flops_per_step"], rel=0.01)


@pytest.mark.slow
def test_stages_across_slices_are_compared_with_stages_inside_them():
  """A plan with the stages across slices and data inside them plans the opposite too, and
  warns with both figures where it sends less across slices: nano's activations (256 x 128
  tokens a step, width 128) outweigh its gradients."""
  pytest.importorskip("libtpu")
  run = nano(**{"model.compute.scan_layers": True, "trainer.batch_size": 256,
                "trainer.device_mesh": {"stage": 1, "data": -1, "model": 1},
                "trainer.dcn_mesh": {"stage": 2, "data": 1}, "trainer.pipeline.microbatches": 2})
  plan = planner.plan(run, "v5e:2x2", num_slices=2, compiler_costs=False)
  other = plan["stages_inside_slices"]
  assert other["device_mesh"] == {"stage": 2, "data": -1, "model": 1}
  assert other["dcn_mesh"] == {"stage": 1, "data": 2} and other["fits"]
  ours, theirs = planner.across_slices(plan), other["across_slices_bytes"]
  assert 0 < theirs < ours
  warning = planner.describe(plan).splitlines()[-1]
  assert warning.startswith("warning: the stages inside each slice and data across them send "
                            "less across slices"), warning
  assert f"{theirs / slices.GIB:.3g} GiB" in warning and f"{ours / slices.GIB:.3g};" in warning
