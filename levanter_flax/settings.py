"""The run's settings as plain typed objects: each section's dataclass, and the whole run.

Free of ml_collections: what runs on an accelerator machine (bench/, the step) builds these
directly; config.py turns a ConfigDict into them.
"""
import dataclasses
from typing import Any

from levanter_flax import checks
from levanter_flax.data import DataConfig
from levanter_flax.distributed import DistributedConfig
from levanter_flax.optim import OptimizerConfig
from levanter_flax.partitioning import ShardingConfig


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
  batch_size: int | str  # Sequences per step, or "auto" until batch_search resolves it.
  num_train_steps: int
  log_every_steps: int
  eval_every_steps: int
  eval_tokens: int | str  # Or "all".
  checkpoint_every_steps: int
  keep_checkpoints: int
  seed: int
  device_mesh: tuple[tuple[str, int], ...]
  cpu_devices: int = 0
  gradient_accumulation_steps: int = 1
  nan_policy: str = "halt"
  max_consecutive_skipped_steps: int = 10
  start_fresh_if_unusable: bool = False
  resume_without_config: bool = False
  checkpoint_every_minutes: float = 0.0
  keep_checkpoint_every_steps: int = 0
  load_checkpoint_path: str = ""
  load_checkpoint_items: str = "params"
  init_from_hf: str = ""
  jax_compilation_cache_dir: str = ""
  jax_persistent_cache_min_compile_time_secs: float = 1.0
  peak_flops_per_device: float = 0.0
  target_batch_size: int = 0
  memory_fraction: float = 0.85
  memory_budget_bytes: int = 0
  distributed: DistributedConfig = DistributedConfig()
  profiler: bool = False
  profiler_start_step: int = 5
  profiler_num_steps: int = 5
  hang_watchdog_seconds: float = 1800.0

  def __post_init__(self):
    checks.positive(self, "trainer", (
        "batch_size", "num_train_steps", "log_every_steps", "eval_every_steps", "eval_tokens",
        "checkpoint_every_steps", "keep_checkpoints", "gradient_accumulation_steps",
        "max_consecutive_skipped_steps", "profiler_start_step", "profiler_num_steps"))
    checks.ranges(self, "trainer", {
        "seed": checks.at_least(0),
        "cpu_devices": checks.at_least(0, "0: JAX's default"),
        "target_batch_size": checks.at_least(0, "0: batch_size"),
        "memory_budget_bytes": checks.at_least(0, "0: the device's"),
        "keep_checkpoint_every_steps": checks.at_least(0, "0: none"),
        "checkpoint_every_minutes": checks.at_least(0, "0: never"),
        "hang_watchdog_seconds": checks.at_least(0, "0: off"),
        "memory_fraction": checks.unit(low_open=True),
        "peak_flops_per_device": checks.at_least(0, "0: look it up"),
        "jax_persistent_cache_min_compile_time_secs": checks.at_least(0),
    })


@dataclasses.dataclass(frozen=True)
class RunConfig:
  model: Any  # The config dataclass of one of models.FAMILIES.
  trainer: TrainerConfig
  optimizer: OptimizerConfig
  data: DataConfig
  sharding: ShardingConfig
