"""Device mesh, regex partition rules and ZeRO axes -> NamedShardings.

A rule is (regex, spec): the regex is matched against a parameter's
'/'-joined Flax path (e.g. "h_3/attn/c_attn/kernel") and the first match wins.
A spec gives each array dimension a logical axis name (what the dimension is),
a mesh axis name, a tuple of names, or None. Logical names are the ones the
models' activation constraints use too (role_presets' keys), and one table maps them
onto the mesh for both: the role keys of ShardingConfig fill it (heads,
kv_heads, mlp and vocab onto `tensor_axis`, the batch onto `activation_axis`,
a mixture's experts onto `expert_axis`; the rest are not split), and
`logical_axis_rules` overrides entries or adds new logical names. On top of the
rules, `parameter_axis` (ZeRO-3/FSDP) and `optimizer_axis` (ZeRO-1) shard each
array along its largest evenly divisible dimension that no rule has claimed.
"""
import contextlib
import dataclasses
import math
import re
from typing import Any, Optional, Sequence, Union

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from levanter_flax.core.errors import UserError
from levanter_flax.core.schema import setting

AxisNames = Union[None, str, tuple[str, ...]]
# The mesh axis of a pipeline's stages (trainer.device_mesh stage=N): models/pipeline.py.
STAGE_AXIS = "stage"
# (logical axis, mesh axes) pairs, as t5x's and Flax's logical_axis_rules write them.
AxisRules = tuple[tuple[str, AxisNames], ...]


def axes_value(key: str, value: Any) -> AxisNames:
  """A config's mesh axes: a name, comma-separated names ("data,model") or a sequence of them;
  "" or None is none."""
  if value is None or value == "":
    return None
  if isinstance(value, str):
    names = tuple(name.strip() for name in value.split(","))
    return names[0] if len(names) == 1 else names
  if isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value):
    return tuple(value)
  raise UserError(f"config key {key} must be a mesh axis name, names, or None; got {value!r}")


def rules_value(key: str, value: Any) -> tuple[tuple[str, tuple[AxisNames, ...]], ...]:
  """A config's (regex, spec) partition rules, each regex compiled to check it."""
  try:
    rules = tuple((pattern, tuple(spec)) for pattern, spec in value)
  except (TypeError, ValueError):
    raise UserError(f"config key {key} must be a sequence of (regex, spec) pairs; "
                    f"got {value!r}") from None
  for pattern, _ in rules:
    if not isinstance(pattern, str):
      raise UserError(f"config key {key}: regex {pattern!r} is not a string")
    try:
      re.compile(pattern)
    except re.error as e:
      raise UserError(f"{key}: {pattern!r} is not a valid regex: {e}") from None
  return tuple((pattern, tuple(axes_value(f"{key}[{pattern!r}]", e) for e in spec))
               for pattern, spec in rules)


def parse_logical_axis_rules(key: str, value: Any) -> AxisRules:
  """The config value of `key` (a sequence of (logical axis, mesh axes) pairs) as AxisRules.

  Mesh axes as axes_value reads them. Whether the mesh has them is Partitioner's check.
  """
  if isinstance(value, str) or not isinstance(value, Sequence):
    raise UserError(f"{key} must be a sequence of (logical axis, mesh axes) pairs, e.g. "
                    f"((\"length\", \"seq\"),); got {value!r}")
  rules = {}
  for entry in value:
    if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str)
            and entry[0]):
      raise UserError(f"{key} entry {entry!r} must be a (logical axis name, mesh axes) pair, mesh "
                      f"axes a name, comma-separated names, a tuple of names, or None")
    name, axes = entry
    if name in rules:
      raise UserError(f"{key} names logical axis {name!r} twice")
    rules[name] = axes_value(f"{key} entry {entry!r}", axes)
  return tuple(rules.items())


def _axes_setting(default: AxisNames, doc: str) -> Any:
  return setting(default, doc, convert=axes_value, written=default or "")


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
  """How parameters, optimizer state and activations are laid out on the mesh (config.sharding).
  Mesh axes are a name or comma-separated names ("data,model"); "" is none."""
  rules: tuple[tuple[str, tuple[AxisNames, ...]], ...] = setting(
      (), "(regex, axes) rules tried before the model family's own (PARTITION_RULES of "
      "models/<family>.py, in logical axes), which are always there: only to override them",
      convert=rules_value)
  activation_axis: AxisNames = _axes_setting("data", "Splits the batch: data parallelism")
  parameter_axis: AxisNames = _axes_setting(None, "ZeRO-3: also shard every parameter")
  optimizer_axis: AxisNames = _axes_setting(None, "ZeRO-1: also shard optimizer state")
  tensor_axis: AxisNames = _axes_setting(
      "model", "Where the logical heads, kv_heads, MLP and vocab dimensions go, of parameters "
      "and activations alike: tensor parallelism")
  strict: bool = setting(False, "Refuse parameters that no rule matches")
  expert_axis: AxisNames = _axes_setting(
      None, "Where a mixture of experts' experts go (logical axis experts): expert parallelism")
  logical_axis_rules: AxisRules = setting(
      (), "(logical axis, mesh axes) pairs over what the role keys above give, for parameters "
      "and activations alike: ((\"length\", \"seq\"),) splits the sequence (context "
      "parallelism); a new name is a logical axis sharding.rules may use",
      convert=parse_logical_axis_rules)


def role_presets(config: ShardingConfig) -> dict[str, AxisNames]:
  """The logical -> mesh axes table that the role keys give, before logical_axis_rules.

  "experts" first: flax gives a mesh axis to the logical axes in this order, and an expert
  stack's first dimension has the expert axis when "mlp" maps there too (_spec_on_mesh).
  "zero3" is where ZeRO-3 splits the parameters, for a layer that gathers its own (moe.py).
  """
  tensor = config.tensor_axis
  return {"experts": config.expert_axis, "batch": config.activation_axis, "length": None,
          "embed": None, "heads": tensor, "kv_heads": tensor, "mlp": tensor, "vocab": tensor,
          "layers": None, "zero3": config.parameter_axis}


def split_cpu(num_devices: int) -> None:
  """Makes a CPU backend num_devices XLA devices (0: JAX's default). Before any backend exists.

  XLA:CPU splits one op between cores only when it is big enough; one device
  per core splits a small model's every op, as data parallelism.
  """
  if num_devices:
    jax.config.update("jax_num_cpu_devices", num_devices)


def make_mesh(device_mesh: Sequence[tuple[str, int]],
              devices: Optional[Sequence[jax.Device]] = None,
              dcn_mesh: Sequence[tuple[str, int]] = ()) -> Mesh:
  """Builds the mesh from (axis, size) pairs; one size may be -1 for 'the rest'.

  On TPU devices of several slices, device_mesh's sizes are per slice and dcn_mesh says how
  many slices each axis spans: the slow data-center network then carries only those axes'
  collectives (mesh_utils.create_hybrid_device_mesh), and a slice's own axes stay on its ICI.
  """
  devices = list(jax.devices() if devices is None else devices)
  num_slices = len({getattr(d, "slice_index", 0) for d in devices}
                   if devices[0].platform == "tpu" else {0})
  names = tuple(name for name, _ in device_mesh)
  sizes = _sizes("trainer.device_mesh", device_mesh, len(devices) // num_slices,
                 "devices per slice" if num_slices > 1 else "devices")
  if num_slices == 1:
    return Mesh(_torus_aware(mesh_utils.create_device_mesh, sizes, devices), names)
  unknown = [name for name, _ in dcn_mesh if name not in names]
  if unknown:
    raise UserError(f"trainer.dcn_mesh {dict(dcn_mesh)}: {', '.join(unknown)} is not an axis of "
                    f"trainer.device_mesh {dict(device_mesh)}")
  spans = dict(zip((n for n, _ in dcn_mesh), _sizes("trainer.dcn_mesh", dcn_mesh, num_slices,
                                                     "slices")))
  device_array = _torus_aware(mesh_utils.create_hybrid_device_mesh, sizes,
                              [spans.get(name, 1) for name in names], devices)
  return Mesh(device_array, names)


def _torus_aware(create, *args) -> np.ndarray:
  """`create`'s device array, whose axes follow the TPU torus's where they can; where a mesh
  axis cannot be one physical axis or a product of whole ones (8 x 8 on a 4x4x4 torus), an
  axis split between mesh axes (jax's allow_split_physical_axes) rather than no mesh."""
  try:
    return create(*args)
  except NotImplementedError:
    return create(*args, allow_split_physical_axes=True)


def _sizes(key: str, axes: Sequence[tuple[str, int]], total: int, what: str) -> list[int]:
  """The axes' sizes with a -1 resolved, multiplying to `total` (of `what`)."""
  sizes = [size for _, size in axes]
  if sizes.count(-1) > 1:
    raise UserError(f"{key} {dict(axes)}: only one axis may be -1")
  if any(size == 0 or size < -1 for size in sizes):
    raise UserError(f"{key} {dict(axes)}: sizes must be positive or -1")
  known = math.prod(size for size in sizes if size != -1)
  if -1 in sizes:
    if total % known:
      raise UserError(f"{key} {dict(axes)}: {total} {what} are not divisible by the fixed "
                      f"axes' product {known}")
    sizes[sizes.index(-1)] = total // known
  if math.prod(sizes) != total:
    raise UserError(f"{key} {dict(axes)}: the sizes multiply to {math.prod(sizes)} but there "
                    f"are {total} {what}")
  return sizes


def path_name(path) -> str:
  """'/'-joined names of a pytree key path: ('params', 'h_0', 'ln_1', 'scale') -> 'h_0/ln_1/scale'."""
  parts = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
  if parts and parts[0] == "params":
    parts = parts[1:]
  return "/".join(parts)


_KERNEL = "kernel$"


def with_adapter_rules(rules: Sequence[tuple[str, tuple]]) -> tuple[tuple[str, tuple], ...]:
  """`rules` with, after each rule of a matrix kernel (a regex ending in kernel$, two axes),
  the rules of its LoRA adapters (models/lora.py): A [in, rank] split like the kernel's input
  axis, B [rank, out] like its output axis; the rank has no rule (ZeRO may split it). An expert
  stack's (a regex ending in $, three axes) likewise, each adapter split like the stack's
  experts too: <stack>_lora_a [experts, in, rank], <stack>_lora_b [experts, rank, out]."""
  derived = []
  for pattern, spec in rules:
    derived.append((pattern, spec))
    if pattern.endswith(_KERNEL) and len(spec) == 2:
      stem = pattern[:-len(_KERNEL)]
      derived += [(stem + "lora_a$", (spec[0], None)), (stem + "lora_b$", (None, spec[1]))]
    elif pattern.endswith("$") and len(spec) == 3:
      stem = pattern[:-1]
      derived += [(stem + "_lora_a$", (spec[0], spec[1], None)),
                  (stem + "_lora_b$", (spec[0], None, spec[2]))]
  return tuple(derived)


def axes_of(entry: AxisNames) -> tuple[str, ...]:
  """The mesh axes of a PartitionSpec entry."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def axes_size(mesh: Mesh, entry: AxisNames) -> int:
  """How many devices a PartitionSpec entry's mesh axes span (1: none)."""
  return math.prod(mesh.shape[a] for a in axes_of(entry))


class Partitioner:
  """Turns the mesh and the sharding config into shardings for state and batches."""

  def __init__(self, mesh: Mesh, config: ShardingConfig):
    self.mesh = mesh
    self.config = config
    for key in ("activation_axis", "parameter_axis", "optimizer_axis", "tensor_axis",
                "expert_axis"):
      for axis in axes_of(getattr(config, key)):
        self._check_axis(axis, f"config.sharding.{key}")
        self._check_not_stages(axis, f"config.sharding.{key}")
    for name, axes in config.logical_axis_rules:
      where = f"config.sharding.logical_axis_rules entry {name!r}"
      if name in mesh.shape:
        raise UserError(f"{where} is a mesh axis of trainer.device_mesh; give the logical axis "
                        f"another name")
      for axis in axes_of(axes):
        self._check_axis(axis, where)
        if name != "layers":
          self._check_not_stages(axis, where)
    # The one table for parameters (the rules' logical names) and activations. A layer stack's
    # leading dimension goes on the pipeline's stages (models/pipeline.py).
    stages = {"layers": STAGE_AXIS} if STAGE_AXIS in mesh.shape else {}
    self.logical_axes = {**role_presets(config), **stages, **dict(config.logical_axis_rules)}
    self._layers = self._mesh_axes("layers", "layers")
    self._rules = tuple((pattern, self._spec_on_mesh(spec, pattern))
                        for pattern, spec in with_adapter_rules(config.rules))

  def _check_not_stages(self, axis: str, where: str) -> None:
    if axis == STAGE_AXIS:
      raise UserError(f"{where} names mesh axis {STAGE_AXIS!r}, which holds a pipeline's "
                      f"stages (the layers) and splits nothing else; use another axis")

  def _check_axis(self, axis: str, where: str) -> None:
    if axis not in self.mesh.shape:
      raise UserError(f"{where} names mesh axis {axis!r}, but the mesh has only "
                      f"{tuple(self.mesh.shape)} (trainer.device_mesh)")

  def _spec_on_mesh(self, spec: tuple[AxisNames, ...], pattern: str) -> tuple[AxisNames, ...]:
    """A rule's spec on this mesh. A mesh axis splits one dimension only: when two logical axes
    map onto the same mesh axis (experts and mlp both on "expert"), the first dimension has it."""
    used, entries = set(), []
    for entry in spec:
      axes = [a for a in axes_of(self._mesh_axes(entry, pattern)) if a not in used]
      used.update(axes)
      entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return tuple(entries)

  def _mesh_axes(self, entry: AxisNames, pattern: str) -> AxisNames:
    """A rule's spec entry on this mesh: mesh axis names as they are, logical ones mapped."""
    axes = []
    for name in axes_of(entry):
      if name in self.mesh.shape:
        axes.append(name)
      elif name in self.logical_axes:
        axes.extend(axes_of(self.logical_axes[name]))
      else:
        raise UserError(f"config.sharding.rules entry {pattern!r} names {name!r}, which is "
                        f"neither a mesh axis {tuple(self.mesh.shape)} (trainer.device_mesh) "
                        f"nor a logical axis ({', '.join(self.logical_axes)}; "
                        f"config.sharding.logical_axis_rules)")
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)

  def logical_axis_size(self, name: str) -> int:
    """How many ways the mesh splits logical axis `name` (1: not at all)."""
    return axes_size(self.mesh, self.logical_axes.get(name))

  def rule_spec(self, name: str, shape: tuple[int, ...]) -> tuple[AxisNames, ...]:
    """The first matching rule's spec, on the mesh. A spec shorter than the array names its
    trailing dimensions; the first leading one (the layer axis of scanned blocks) has the
    logical axis "layers" (the pipeline's stages, if any), the others are not split."""
    for pattern, spec in self._rules:
      if re.search(pattern, name):
        if len(spec) > len(shape):
          raise UserError(f"config.sharding.rules entry {pattern!r} gives {len(spec)} "
                          f"dimensions to parameter {name} of shape {shape}")
        leading = len(shape) - len(spec)
        return (self._layers,)[:leading] + (None,) * (leading - 1) + tuple(spec)
    if self.config.strict:
      raise UserError(f"parameter {name} {shape} matches no rule in config.sharding.rules "
                      "(config.sharding.strict is set)")
    return (None,) * len(shape)

  def _with_zero_axis(self, spec: tuple[AxisNames, ...], shape, zero_axis: AxisNames):
    """Adds zero_axis on the largest free dimension it divides; used axes are skipped."""
    used = {a for entry in spec for a in axes_of(entry)}
    new_axes = tuple(a for a in axes_of(zero_axis) if a not in used)
    if not new_axes:
      return spec
    size = axes_size(self.mesh, new_axes)
    free = [d for d in range(len(shape)) if spec[d] is None and shape[d] % size == 0]
    if not free:
      return spec
    dim = max(free, key=lambda d: shape[d])
    spec = list(spec)
    spec[dim] = new_axes[0] if len(new_axes) == 1 else new_axes
    return tuple(spec)

  def _checked(self, name: str, shape, spec) -> PartitionSpec:
    for dim, entry in enumerate(spec):
      size = axes_size(self.mesh, entry)
      if shape[dim] % size:
        raise UserError(f"parameter {name} {tuple(shape)}: dimension {dim} ({shape[dim]}) is "
                        f"not divisible by mesh axis {entry!r} of size {size}")
    return PartitionSpec(*spec)

  def param_spec(self, name: str, shape) -> PartitionSpec:
    spec = self.rule_spec(name, shape)
    spec = self._with_zero_axis(spec, shape, self.config.parameter_axis)
    return self._checked(name, shape, spec)

  def optimizer_spec(self, name: str, shape) -> PartitionSpec:
    spec = self.param_spec(name, shape)
    spec = self._with_zero_axis(tuple(spec) + (None,) * (len(shape) - len(spec)), shape,
                                self.config.optimizer_axis)
    return self._checked(name, shape, spec)

  def sharding(self, spec: PartitionSpec) -> NamedSharding:
    return NamedSharding(self.mesh, spec)

  @property
  def replicated(self) -> NamedSharding:
    return self.sharding(PartitionSpec())

  def param_shardings(self, abstract_params) -> Any:
    names = [path_name(path) for path, _ in jax.tree_util.tree_leaves_with_path(abstract_params)]
    if self._rules and self.unmatched(abstract_params) == set(names):
      # Another family's rules (the default is GPT-2's): everything would be replicated.
      raise UserError(f"config.sharding.rules match none of the model's parameters (e.g. "
                      f"{names[0]}); set them to its family's rules, e.g. "
                      f"<family module>.PARTITION_RULES, or to () for none")
    return jax.tree_util.tree_map_with_path(
        lambda path, x: self.sharding(self.param_spec(path_name(path), x.shape)), abstract_params)

  def opt_state_shardings(self, optimizer: optax.GradientTransformation,
                          abstract_opt_state, abstract_params) -> Any:
    """Shards each optimizer leaf like its parameter; counts, scalars and leaves of another
    shape (Adafactor's factored moments, a fraction of the parameter's size) are replicated.
    A group's state (optax.partition: Muon's) holds a MaskedNode for each parameter of another
    group, kept as it is."""
    names = jax.tree_util.tree_map_with_path(lambda path, _: path_name(path), abstract_params)
    shapes = {name: x.shape for name, x in zip(jax.tree.leaves(names), jax.tree.leaves(abstract_params))}

    def like_its_parameter(leaf, name: str) -> Any:
      if isinstance(leaf, optax.MaskedNode):
        return leaf
      if leaf.shape != shapes[name]:
        return self.replicated
      return self.sharding(self.optimizer_spec(name, leaf.shape))
    return optax.tree_map_params(optimizer, like_its_parameter, abstract_opt_state, names,
                                 transform_non_params=lambda _: self.replicated,
                                 is_leaf=lambda x: isinstance(x, optax.MaskedNode))

  def batch_sharding(self) -> NamedSharding:
    return self.sharding(PartitionSpec(self.logical_axes["batch"]))

  @property
  def data_parallel_size(self) -> int:
    return axes_size(self.mesh, self.logical_axes["batch"])

  def check_batch_size(self, batch_size: int, accumulation: int) -> None:
    """A microbatch (batch_size / accumulation sequences) splits evenly over the batch's axes."""
    if (batch_size // accumulation) % self.data_parallel_size:
      raise UserError(f"config.trainer.batch_size ({batch_size}) / gradient_accumulation_steps "
                      f"({accumulation}) must be divisible by the activation axis size "
                      f"({self.data_parallel_size})")

  def unmatched(self, abstract_params) -> set[str]:
    """The parameters no rule matches: replicated, unless a ZeRO axis splits them."""
    return {path_name(path) for path, _ in jax.tree_util.tree_leaves_with_path(abstract_params)
            if not any(re.search(pattern, path_name(path)) for pattern, _ in self._rules)}

  def activation_context(self) -> contextlib.ExitStack:
    """Within it, the model's logical activation constraints resolve on this mesh."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(self.mesh))
    stack.enter_context(nn.logical_axis_rules(tuple(self.logical_axes.items())))
    return stack


def per_device_bytes(abstract_tree, shardings) -> int:
  """Bytes that one device holds of a tree of arrays (or ShapeDtypeStructs)."""
  return sum(math.prod(sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
             for x, sharding in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings)))


def _bytes(n: float) -> str:
  if n < 1024:
    return f"{n} B"
  for unit in ("KiB", "MiB", "GiB"):
    n /= 1024
    if n < 1024 or unit == "GiB":
      return f"{n:.1f} {unit}"


def layout_table(abstract_params, param_shardings, abstract_opt_state, opt_state_shardings,
                 unmatched: frozenset[str] = frozenset()) -> str:
  """One row per parameter: shape, spec, per-device shape and bytes; then the per-device totals.

  A parameter in `unmatched` (no partition rule) says so after its spec.
  """
  rows = [("parameter", "shape", "spec", "per device", "bytes/device")]
  leaves = jax.tree_util.tree_leaves_with_path(abstract_params)
  for (path, x), sharding in zip(leaves, jax.tree.leaves(param_shardings)):
    shard, name = sharding.shard_shape(x.shape), path_name(path)
    spec = str(tuple(sharding.spec))
    if name in unmatched:
      spec += " (no rule)" if any(sharding.spec) else " (no rule: replicated)"
    rows.append((name, str(tuple(x.shape)), spec, str(shard),
                 _bytes(math.prod(shard) * np.dtype(x.dtype).itemsize)))
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
  params = per_device_bytes(abstract_params, param_shardings)
  opt_state = per_device_bytes(abstract_opt_state, opt_state_shardings)
  lines.append(f"per device: params {_bytes(params)} + optimizer state {_bytes(opt_state)} "
               f"= {_bytes(params + opt_state)}")
  return "\n".join(lines)
