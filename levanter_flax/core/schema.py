"""How a setting is declared, once: a field of its section's dataclass with its default, a
one-line description and its kind. config.py builds default_config(), --print_config and the
checks of a resume from these declarations.

A section is a frozen dataclass owned by the module that reads it (checkpoint.CheckpointConfig,
monitoring.MonitoringConfig, ...); a field whose default is itself a section dataclass is a
nested section (model.compute, trainer.distributed).
"""
import dataclasses
from typing import Any, Callable, Iterator, Optional

from levanter_flax.core.errors import UserError

# The kinds of setting, by what a resume may do with them.
STATE = "state"  # Shapes the saved state: a resume that changes it is refused.
MODEL = "model"  # What the weights compute, not their shapes: free on resume, but a Hugging
                 # Face checkpoint's config.json decides it (trainer.init_from_hf).
FREE = "free"  # Free to change on resume; the change is logged.
CHOSEN = "chosen"  # Chosen when the run first starts unless set (see chosen_when), then kept:
                   # config.json holds the choice, and a resume keeps it.
KINDS = (STATE, MODEL, FREE, CHOSEN)


def setting(default: Any = dataclasses.MISSING, doc: str = "", kind: str = FREE, *,
            convert: Optional[Callable[[str, Any], Any]] = None,
            chosen_when: Optional[tuple[str, Any]] = None, written: Any = dataclasses.MISSING,
            kw_only: bool = False) -> Any:
  """A section field. `default` MISSING: the config must set it. `convert(key, value)` turns the
  config's value into the field's type (else the type itself is checked). A CHOSEN setting is
  chosen at start while the key `chosen_when[0]` holds `chosen_when[1]`. `written`: the default
  as a config file writes it, where that is not the typed default (a dict for a mapping).
  kw_only: the field may follow required ones (a base class's field)."""
  if kind not in KINDS:
    raise ValueError(f"kind {kind!r} is not one of {KINDS}")
  if (kind == CHOSEN) != (chosen_when is not None):
    raise ValueError("a CHOSEN setting, and only one, says when it is chosen")
  return dataclasses.field(default=default, kw_only=kw_only, metadata={
      "doc": doc, "kind": kind, "convert": convert, "chosen_when": chosen_when,
      "written": default if written is dataclasses.MISSING else written})


def overridden(section: type, name: str, default: Any) -> Any:
  """`section`'s field `name`, declared again with another default (a family's own)."""
  field = next(f for f in dataclasses.fields(section) if f.name == name)
  return dataclasses.field(default=default, metadata={**field.metadata, "written": default})


_FIELDS_OWN = object()  # Declared.own_default where the field's own default stands.


@dataclasses.dataclass(frozen=True)
class Declared:
  """One setting as its section declares it; `own_default`: where a family's instance of the
  section says otherwise (Qwen3-MoE's 128 experts), its value."""
  key: str  # "trainer.batch_size"
  field: dataclasses.Field
  own_default: Any = _FIELDS_OWN

  @property
  def name(self) -> str:
    return self.field.name

  @property
  def default(self) -> Any:
    return self.field.default if self.own_default is _FIELDS_OWN else self.own_default

  @property
  def doc(self) -> str:
    return self.field.metadata.get("doc", "")

  @property
  def kind(self) -> Optional[str]:
    return self.field.metadata.get("kind")

  @property
  def written(self) -> Any:
    if self.own_default is not _FIELDS_OWN and self.own_default != self.field.default:
      return self.own_default
    return self.field.metadata.get("written", self.field.default)

  @property
  def convert(self) -> Optional[Callable[[str, Any], Any]]:
    return self.field.metadata.get("convert")

  @property
  def chosen_when(self) -> Optional[tuple[str, Any]]:
    return self.field.metadata.get("chosen_when")


def int_or(word: str) -> Callable[[str, Any], int | str]:
  """A converter for settings that take an int or `word` ("auto", "all")."""
  def convert(key: str, value: Any) -> int | str:
    if value == word or (isinstance(value, int) and not isinstance(value, bool)):
      return value
    raise UserError(f"config key {key} must be a positive int or {word!r}; got {value!r}")
  return convert


def is_section(field: dataclasses.Field) -> bool:
  return dataclasses.is_dataclass(field.default) and not isinstance(field.default, type)


def declared(section: type, prefix: str, instance: Any = None) -> Iterator[Declared]:
  """Every setting of `section` and its nested sections, keyed under `prefix` ("trainer"), a
  nested section's defaults its parent's instance of it (`instance`: of `section`)."""
  for field in dataclasses.fields(section):
    key = f"{prefix}.{field.name}"
    own = _FIELDS_OWN if instance is None else getattr(instance, field.name)
    if is_section(field):
      yield from declared(type(field.default), key, field.default if instance is None else own)
    else:
      yield Declared(key, field, own)
