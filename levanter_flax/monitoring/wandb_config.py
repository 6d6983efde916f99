"""The trainer.wandb section, apart from the writer (wandb_writer.py): reading a config needs
neither clu nor wandb."""
import ast
import dataclasses
from typing import Any

from levanter_flax.core.errors import UserError
from levanter_flax.core.schema import setting

WANDB_MODES = ("online", "offline", "disabled")


def _tags(key: str, value: Any) -> tuple[str, ...]:
  """"" (none), "a,b" or ["a", "b"] (a list, or its literal from the command line) -> a tuple of
  tags."""
  tags = value
  if isinstance(value, str) and value.strip().startswith(("[", "(")):
    try:
      tags = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
      tags = None
  elif isinstance(value, str):
    tags = [tag.strip() for tag in value.split(",") if tag.strip()]
  if isinstance(tags, (list, tuple)) and all(isinstance(tag, str) for tag in tags):
    return tuple(tags)
  raise UserError(f"config key {key} must be tags like \"baseline,gpt2\" (\"\" for none); "
                  f"got {value!r}")


@dataclasses.dataclass(frozen=True)
class WandbConfig:
  """Logging to Weights & Biases (config.trainer.wandb): off until a project is named."""
  project: str = setting("", "W&B project to log the run to; \"\": no W&B")
  entity: str = setting("", "W&B user or team that owns the project; \"\": your default entity")
  name: str = setting("", "The W&B run's display name; \"\": the workdir's name")
  tags: tuple[str, ...] = setting((), "The W&B run's tags, e.g. \"baseline,gpt2\"",
                                  convert=_tags, written="")
  mode: str = setting("online", "online: log to the W&B server; offline: write the run under "
                      "<workdir>/wandb to upload later with `wandb sync`; disabled: no W&B")

  def __post_init__(self):
    if self.mode not in WANDB_MODES:
      raise UserError(f"config.trainer.wandb.mode must be one of {', '.join(WANDB_MODES)}; "
                      f"got {self.mode!r}")

  @property
  def enabled(self) -> bool:
    return bool(self.project) and self.mode != "disabled"
