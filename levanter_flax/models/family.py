"""What a model family is to the rest of the trainer: one record, registered by name.

The config, the step, the sampler, the exporter, the FLOPs count and the
benchmarks ask the family's record (models.FAMILIES) instead of branching on
its name, so a new family is its module, one line in models/__init__.py and a
config file.
"""
import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class HFLayout:
  """How the family's Hugging Face checkpoints (config.json + safetensors) map onto ours."""
  architecture: str  # config.json's architectures[0], e.g. "LlamaForCausalLM".
  config_from_hf: Callable[[dict], Any]  # Refuses what we do not compute (UserError, KeyError).
  config_to_hf: Callable[[Any], dict]
  # Our path in the unrolled layout (hf.py stacks a scanned model's layers) -> (HF name,
  # transposed); a tuple of names for one tensor per expert, stacked.
  tensor_names: Callable[[Any], dict[str, tuple[str | tuple[str, ...], bool]]]


@dataclasses.dataclass(frozen=True)
class ModelFamily:
  name: str  # config.model.architecture.
  config: type  # Its config dataclass; the section's keys are its fields.
  module: type  # The Flax module, called module(cfg, decode=...).
  partition_rules: tuple  # (regex, logical axes) pairs; see partitioning.py.
  layer_stack: str  # The blocks: <layer_stack>_<i> unrolled, <layer_stack> when scanned.
  # Embedding tables only looked up, never multiplied (so not in the FLOPs), given the params.
  lookup_tables: Callable[[dict], tuple[str, ...]]
  hf: HFLayout
  # Of the matmul parameters, how many a token does not multiply by (given the config and the
  # params): a mixture of experts' unrouted experts. MFU counts the active parameters only.
  inactive_params: Callable[[Any, dict], float] = lambda cfg, params: 0
  # Scanned, the blocks as (stack name, the layer indices it holds), given the config: more
  # than one stack where layers differ in kind (DeepSeek-V3's dense, then mixtures). Unrolled,
  # they are <layer_stack>_<i> whatever their stack. None: one stack, <layer_stack>.
  layer_stacks: Callable[[Any], tuple[tuple[str, range], ...]] | None = None

  def stacks(self, cfg) -> tuple[tuple[str, range], ...]:
    if self.layer_stacks is None:
      return ((self.layer_stack, range(cfg.num_layers)),)
    return tuple((name, layers) for name, layers in self.layer_stacks(cfg) if layers)
