"""The run's settings as plain typed objects: the trainer's section, and the whole run.

Each section is declared by the module that reads it (schema.setting); RunConfig gathers them.
Free of ml_collections: what runs on an accelerator machine (bench/, the step) builds these
directly; config.py turns a ConfigDict into them.
"""
import dataclasses
from typing import Any

from levanter_flax.core import checks, schema
from levanter_flax.optim import spikes
from levanter_flax.checkpoint.store import CheckpointConfig
from levanter_flax.data import DataConfig
from levanter_flax.parallel.distributed import DistributedConfig
from levanter_flax.objectives.dpo import DpoConfig
from levanter_flax.objectives.grpo import GrpoConfig
from levanter_flax.core.errors import UserError
from levanter_flax.models.gpt2 import GPT2Config
from levanter_flax.monitoring.wandb_config import WandbConfig
from levanter_flax.monitoring.watch import MonitoringConfig
from levanter_flax.optim.optimizers import OptimizerConfig
from levanter_flax.parallel.partitioning import ShardingConfig
from levanter_flax.models.pipeline import PipelineConfig
from levanter_flax.core.schema import CHOSEN, STATE, setting

_AUTO_BATCH = ("trainer.batch_size", "auto")


def _device_mesh(key: str, value: Any) -> tuple[tuple[str, int], ...]:
  items = list(value.items()) if hasattr(value, "items") else None
  if not items or not all(isinstance(n, str) and isinstance(s, int) for n, s in items):
    raise UserError(f"config key {key} must map axis names to sizes, e.g. data=-1, model=1; "
                    f"got {value!r}")
  return tuple(items)


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
  """The loop: steps, batches, logging, evals, the mesh and the start (config.trainer)."""
  batch_size: int | str = setting(
      32, "Sequences per step, global; or auto: the largest microbatch that fits in memory "
      "(config.batch_search), with accumulation up to its target_batch_size", CHOSEN,
      convert=schema.int_or("auto"), chosen_when=_AUTO_BATCH)
  num_train_steps: int = setting(10_000, "Steps to train; a larger value extends a finished run")
  log_every_steps: int = setting(10, "Log the mean of the train metrics every this many steps")
  eval_every_steps: int = setting(500, "Evaluate every this many steps (and at the last)")
  eval_tokens: int | str = setting(
      1 << 20, "The eval set: this many tokens' worth of seq_len windows spread evenly over the "
      "whole validation split (of each source), the same at every eval; all: every window",
      convert=schema.int_or("all"))
  seed: int = setting(0, "Initialisation and the order of the data")
  device_mesh: tuple[tuple[str, int], ...] = setting(
      (("data", -1), ("model", 1)), "Mesh axis name -> size; -1 takes all remaining devices",
      convert=_device_mesh, written={"data": -1, "model": 1})
  dcn_mesh: tuple[tuple[str, int], ...] = setting(
      (("data", -1),), "Multi-slice TPU: how many slices each mesh axis spans, over the "
      "data-center network (-1: all of them); device_mesh's sizes are then per slice. Read only "
      "when the devices span several slices", convert=_device_mesh, written={"data": -1})
  pipeline: PipelineConfig = setting(
      PipelineConfig(), "A stage axis of device_mesh (stage=N) pipelines the scanned layers "
      "over N stages: the microbatches and the schedule (docs/scaling.md)")
  cpu_devices: int = setting(
      0, "On a CPU backend, split each process's CPU into this many XLA devices (0: JAX's "
      "default, one): small models run faster data-parallel, one device per core")
  gradient_accumulation_steps: int = setting(
      1, "Microbatches per step, summed inside one jitted step; chosen with batch_size=auto",
      CHOSEN, chosen_when=_AUTO_BATCH)
  nan_policy: str = setting(
      "halt", "A step with a non-finite loss or gradient never updates the params; then halt "
      "stops the run naming the step, skip warns, counts it and goes on")
  max_consecutive_skipped_steps: int = setting(
      10, "With nan_policy=skip: this many skipped steps in a row mean divergence; the run halts")
  spike_policy: str = setting(
      "none", "none; skip: a step whose loss or gradient norm exceeds the mean of the last "
      "spike_window steps' by spike_threshold standard deviations updates nothing, and is "
      "counted (train/spike_skipped_steps; the statistics are in the checkpointed optimizer "
      "state); rollback: skip, and after spike_rollback_after spikes within spike_window steps "
      "restore the newest checkpoint from before the first of them and train on without the "
      "batches that made them", STATE)
  spike_threshold: float = setting(
      6.0, "spike_policy skip or rollback: how many standard deviations above the window's mean "
      "a spike is")
  spike_window: int = setting(
      128, "spike_policy skip or rollback: the steps the mean and deviation are over; nothing "
      "is a spike before half of them have run", STATE)
  spike_rollback_after: int = setting(
      3, "spike_policy=rollback: this many spikes within spike_window steps roll the run back")
  max_rollbacks: int = setting(
      3, "spike_policy=rollback: the most rollbacks a run makes (spike_rollbacks.json counts "
      "them, across restarts); one more ends it with exit 1, naming the spikes' steps")
  init_from_hf: str = setting(
      "", "Start from a Hugging Face checkpoint directory (config.json + safetensors) of "
      "config.model's family, with fresh optimizer and data. Its config.json sets config.model's "
      "state and model keys (the shape, RoPE, norm epsilon, tied head); seq_len (but GPT-2's), "
      "compute and lora stay this config's; a --config.model flag it contradicts is refused")
  jax_compilation_cache_dir: str = setting(
      "", "Keep compiled programs here across runs (a shared path serves many nodes); \"\" uses "
      "$JAX_COMPILATION_CACHE_DIR if set, else no cache")
  jax_persistent_cache_min_compile_time_secs: float = setting(
      -1.0, "Cache only programs that took at least this long to compile; -1: JAX's own (1 s, "
      "or $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS)")
  eval_harness_every_steps: int = setting(
      0, "Run lm-eval-harness on the current params every this many steps (and at the last), "
      "logged as harness/<task>/<metric>; 0: never")
  eval_harness_tasks: str = setting(
      "", "lm-eval task names, comma-separated: built-in ones (their data already on disk, e.g. "
      "in the hub cache) or those of eval_harness_include_path; checked, data included, at start")
  eval_harness_include_path: str = setting(
      "", "A directory of lm-eval task YAMLs (e.g. over local JSON lines) whose tasks "
      "eval_harness_tasks may name")
  eval_harness_limit: int = setting(
      0, "Documents per task at each harness run; 0: all of them")
  peak_flops_per_device: float = setting(
      0.0, "For train/mfu; 0 looks the device up in flops.PEAK_FLOPS")
  distributed: DistributedConfig = setting(
      DistributedConfig(), "Multi-process runs (launch/README.md)")
  wandb: WandbConfig = setting(WandbConfig(), "Logging to Weights & Biases, besides TensorBoard "
                               "and metrics.jsonl")

  def __post_init__(self):
    checks.positive(self, "trainer", (
        "batch_size", "num_train_steps", "log_every_steps", "eval_every_steps", "eval_tokens",
        "gradient_accumulation_steps", "max_consecutive_skipped_steps"))
    checks.ranges(self, "trainer", {
        "seed": checks.at_least(0),
        "cpu_devices": checks.at_least(0, "0: JAX's default"),
        "peak_flops_per_device": checks.at_least(0, "0: look it up"),
        "eval_harness_every_steps": checks.at_least(0, "0: never"),
        "eval_harness_limit": checks.at_least(0, "0: all"),
        "jax_persistent_cache_min_compile_time_secs": (lambda seconds: seconds >= 0 or
                                                       seconds == -1, ">= 0, or -1 (JAX's own)"),
    })
    self._check_spike_settings()
    if self.eval_harness_every_steps and not self.eval_harness_tasks.strip(" ,"):
      raise UserError(f"config.trainer.eval_harness_every_steps is "
                      f"{self.eval_harness_every_steps}, but config.trainer.eval_harness_tasks "
                      f"names no lm-eval task to run")
    if self.eval_harness_tasks.strip(" ,") and not self.eval_harness_every_steps:
      raise UserError(f"config.trainer.eval_harness_tasks is {self.eval_harness_tasks!r}, but "
                      f"config.trainer.eval_harness_every_steps is 0 (never): set it to run them")
    for key in ("eval_harness_include_path", "eval_harness_limit"):
      if getattr(self, key) and not self.eval_harness_every_steps:
        raise UserError(f"config.trainer.{key} is {getattr(self, key)!r}, but "
                        f"config.trainer.eval_harness_every_steps is 0: no harness runs to read "
                        f"it (set eval_harness_every_steps and eval_harness_tasks)")

  def _check_spike_settings(self) -> None:
    if self.spike_policy not in spikes.POLICIES:
      raise UserError(f"config.trainer.spike_policy must be one of {', '.join(spikes.POLICIES)}; "
                      f"got {self.spike_policy!r}")
    checks.ranges(self, "trainer", {"spike_threshold": checks.above(0),
                                    "spike_window": checks.at_least(4)})
    checks.ranges(self, "trainer", {"spike_rollback_after": checks.at_least(1),
                                    "max_rollbacks": checks.at_least(0)})
    read = {"none": (), "skip": ("spike_threshold", "spike_window"),
            "rollback": ("spike_threshold", "spike_window", "spike_rollback_after",
                         "max_rollbacks")}
    defaults = {f.name: f.default for f in dataclasses.fields(self)}
    for field in read["rollback"]:
      if field not in read[self.spike_policy] and getattr(self, field) != defaults[field]:
        reader = next(policy for policy in ("skip", "rollback") if field in read[policy])
        raise UserError(f"config.trainer.{field} is {getattr(self, field)}, but "
                        f"config.trainer.spike_policy is {self.spike_policy!r}, which reads it "
                        f"not: set spike_policy={reader}, or leave {field} unset")


@dataclasses.dataclass(frozen=True)
class BatchSearchConfig:
  """What trainer.batch_size="auto" searches for (config.batch_search)."""
  target_batch_size: int = setting(0, "The global batch to reach by gradient accumulation (0: "
                                   "what fits, no accumulation)")
  memory_fraction: float = setting(0.0, "The share of each device's memory a step may use; 0: "
                                   "all of a TPU's, whose compiler plans every buffer and "
                                   "refuses what does not fit, 0.85 of another's")
  memory_budget_bytes: int = setting(0, "Bytes per device a step may use where the backend does "
                                     "not report its memory (CPU); 0: the device's")

  def __post_init__(self):
    checks.ranges(self, "batch_search", {
        "target_batch_size": checks.at_least(0, "0: batch_size"),
        "memory_budget_bytes": checks.at_least(0, "0: the device's"),
        "memory_fraction": checks.unit()})


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Every section of a run. `model` is the config dataclass of one of models.FAMILIES."""
  model: Any = setting(GPT2Config(), "The model: its family (architecture), shape and compute")
  trainer: TrainerConfig = setting(TrainerConfig(), "The loop: steps, batches, logging, evals, the "
                                   "mesh and the start")
  optimizer: OptimizerConfig = setting(OptimizerConfig(), "The optimizer and its schedule")
  data: DataConfig = setting(DataConfig(), "The datasets and how they are read")
  sharding: ShardingConfig = setting(ShardingConfig(), "How parameters, optimizer state and "
                                     "activations are laid out on the mesh")
  checkpoint: CheckpointConfig = setting(CheckpointConfig(), "When checkpoints are written, which "
                                         "are kept, and where a run starts from")
  monitoring: MonitoringConfig = setting(MonitoringConfig(), "The profiler window and the hang "
                                         "watchdog")
  batch_search: BatchSearchConfig = setting(BatchSearchConfig(), "What trainer.batch_size=auto "
                                            "searches for")
  dpo: DpoConfig = setting(DpoConfig(), "DPO's loss, for runs on preference data")
  rl: GrpoConfig = setting(GrpoConfig(), "GRPO: reinforcement learning from rewards")


def sections(architecture: str) -> dict[str, type]:
  """Section name -> its dataclass, the model's being `architecture`'s."""
  from levanter_flax import models  # pylint: disable=g-import-not-at-top  # Imports the families.
  return {f.name: models.FAMILIES[architecture].config if f.name == "model" else type(f.default)
          for f in dataclasses.fields(RunConfig)}


def declared(architecture: str) -> list[schema.Declared]:
  """Every setting of a run whose model is `architecture`'s, nested sections flattened."""
  return [d for name, cls in sections(architecture).items() for d in schema.declared(cls, name)]


def keys_of_kind(kind: str, architecture: str) -> tuple[str, ...]:
  return tuple(d.key for d in declared(architecture) if d.kind == kind)
