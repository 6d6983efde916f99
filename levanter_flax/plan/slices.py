"""TPU slices by name: a Cloud TPU name (v5p-128) or jax's (v5p:4x4x4), their chips, their HBM,
and jax's compile-only devices for them (libtpu, no TPU needed)."""
import contextlib
import importlib.util
import logging
import math
import os
import re
import sys
import tempfile

import jax

from levanter_flax.core.errors import UserError

GIB = 1 << 30
# HBM per chip by jax's device_kind: compile-only devices report no memory of their own.
HBM_BYTES = {
    "TPU v4": 32 * GIB,
    # v5e: of its 16 GiB, what it offers a program: the chip's memory_stats()["bytes_limit"],
    # which its compiler rounds to "available HBM (15.75G)". batch_size=auto on the chip and
    # `aot` for it then search against the same budget.
    "TPU v5 lite": 16_909_336_064,
    "TPU v5": 95 * GIB,  # v5p
    "TPU v5p": 95 * GIB,
    "TPU v6 lite": 32 * GIB,  # v6e (Trillium)
}
# Chips -> physical shape, for the Cloud TPU names: 3D tori (v4, v5p) and 2D ones (v5e, v6e).
_SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
              256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
_SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
              256: "16x16"}
# Generation -> (its torus's shapes, TensorCores the Cloud TPU name counts per chip).
_GENERATIONS = {"v4": (_SHAPES_3D, 2), "v5p": (_SHAPES_3D, 2), "v5e": (_SHAPES_2D, 1),
                "v6e": (_SHAPES_2D, 1)}
EXAMPLES = "v4-32, v5e-256, v5p-128, v6e-64, v5e:16x16 or v5p:4x4x4"
# What libtpu prints on stderr as it starts on a machine that is no TPU VM (its hostname and
# accelerator type unknown): noise around every plan and error.
_LIBTPU_NOISE = re.compile(r"Failed to find host bounds|WARNING: Logging before InitGoogle|"
                           r"could not determine TPU|=== Source Location Trace|^\S+\.cc:\d+$")


def topology(name: str) -> tuple[str, str]:
  """(generation, jax's topology name "v5p:4x4x4") for a Cloud TPU name or jax's own.

  The Cloud TPU suffix counts TensorCores on v4 and v5p (two per chip) and chips on v5e
  and v6e: v4-32 and v5p-32 are 16 chips, v5e-32 is 32.
  """
  cloud = re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", name)
  if cloud:
    generation = "v5e" if cloud.group(1) == "v5litepod" else cloud.group(1)
    shapes, cores_per_chip = _GENERATIONS[generation]
    cores = int(cloud.group(2))
    if cores % cores_per_chip or cores // cores_per_chip not in shapes:
      raise UserError(f"--topology={name}: no {generation} slice of {cores} "
                      f"{'TensorCores' if cores_per_chip > 1 else 'chips'}; sizes are "
                      f"{', '.join(str(c * cores_per_chip) for c in shapes)}")
    return generation, f"{generation}:{shapes[cores // cores_per_chip]}"
  jax_name = re.fullmatch(r"(v4|v5p|v5e|v6e):(\d+x\d+(?:x\d+)?)", name)
  if jax_name and jax_name.group(2).count("x") == (2 if jax_name.group(1) in ("v4", "v5p") else 1):
    return jax_name.group(1), name
  raise UserError(f"--topology={name}: unknown TPU topology; use a Cloud TPU name or jax's, "
                  f"e.g. {EXAMPLES}")


def chips(name: str) -> int:
  """Chips in one slice of the topology `name`."""
  return _chip_count(topology(name)[1].split(":")[1])


def devices(name: str, num_slices: int = 1) -> list[jax.Device]:
  """The compile-only devices of `num_slices` slices of topology `name`: one per chip."""
  generation, jax_name = topology(name)
  if num_slices < 1:
    raise UserError(f"--num_slices must be at least 1; got {num_slices}")
  if importlib.util.find_spec("libtpu") is None:
    raise UserError("compiling for a TPU needs libtpu: pip install -e \".[tpu-aot]\" (the "
                    "version jax[tpu] pins, see docs/build-notes.md)")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # No metadata server: this is not a TPU VM.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # Its lockfile is for real chips.
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  # v4 runs as megacore, one device per chip, as on a real v4 VM.
  options = {"chip_config_name": "megacore"} if generation == "v4" else {}
  shape = [int(size) for size in jax_name.split(":")[1].split("x")]
  if len(shape) == 2 and math.prod(shape) < 4:
    # A one-chip VM (v5litepod-1, v6e-1) is a host of its own: libtpu's default host is 2x2.
    options["chips_per_host_bounds"] = (*shape, 1)
  # jax tries the TPU backend for the chips it looks for here, and says it found none.
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  try:
    with _without_libtpu_noise():
      return list(topologies.get_topology_desc(topology_name=jax_name, platform="tpu",
                                               num_slices=num_slices, **options).devices)
  except jax.errors.JaxRuntimeError as e:
    shapes, _ = _GENERATIONS[generation]
    raise UserError(f"--topology={name}: libtpu has no {generation} topology {jax_name} "
                    f"({str(e).splitlines()[0]}); {generation} comes in "
                    f"{', '.join(sorted(set(shapes.values()), key=_chip_count))}") from e


@contextlib.contextmanager
def _without_libtpu_noise():
  """Holds back what native code writes on stderr meanwhile, then writes it less _LIBTPU_NOISE's
  lines; all of it where libtpu failed, whose reason may be among them."""
  sys.stderr.flush()
  saved = os.dup(2)
  failed = True
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    try:
      yield
      failed = False
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      held.seek(0)
      lines = held.read().decode(errors="replace").splitlines(keepends=True)
      sys.stderr.write("".join(line for line in lines
                               if failed or not _LIBTPU_NOISE.search(line.strip())))


def _chip_count(shape: str) -> int:
  return math.prod(int(n) for n in shape.split("x"))
