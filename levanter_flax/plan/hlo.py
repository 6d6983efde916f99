"""Collective bytes per step, read from a compiled program's HLO text: each collective's result
counted as often as its computation runs (a scanned layer stack's loop body, once per layer).
A ragged all-to-all counts the smaller of its operand and its output buffer: a device sends no
more than the one and receives no more than the other, and over the devices the two are
equal, whatever part of the padded buffers the routing fills. A collective permute counts its
result on the share of the chips it delivers to (XLA splits a cyclic shift into two permutes,
each chip receiving in one of them)."""
import math
import re
from typing import Optional

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all",
               "collective-permute")


_SHAPE = re.compile(r"\b(pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f16|bf16|f32|f64|f8e4m3fn|"
                    r"f8e5m2)\[([\d,]*)\]")
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "f8e4m3fn": 8, "f8e5m2": 8, "s16": 16,
         "u16": 16, "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64,
         "f64": 64}
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(%?([^\s,)]*)")
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*(.*?)\s[\w.-]+\(")
# What a multi-slice program sends over the data-center network: host transfers that the
# megascale runtime carries, one per collective's share that leaves the slice.
_DCN_SEND = re.compile(r"=\s*\((.*?)\)\s+send\(.*_xla_megascale_transfer_type=\"?([A-Z_]+)")
_PARTITIONS = re.compile(r"^HloModule\b.*?\bnum_partitions=(\d+)", re.MULTILINE)
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_DCN_KINDS = {"ALL_GATHER": "all-gather", "REDUCE_SCATTER": "reduce-scatter",
              "ALL_REDUCE": "all-reduce", "ALL_TO_ALL": "all-to-all",
              "ONE_TO_ONE": "collective-permute"}


def _array_bytes(hlo_type: str) -> int:
  """Bytes of the arrays in an HLO type: "bf16[8,128]{1,0}", or every one of a tuple's."""
  return sum(math.prod(int(d) for d in dims.split(",") if d) * _BITS[dtype] // 8
             for dtype, dims in _SHAPE.findall(hlo_type))


def _tuple_elements(hlo_type: str) -> list[str]:
  """A tuple type's top-level elements; [hlo_type] for an array."""
  if not hlo_type.startswith("("):
    return [hlo_type]
  elements, depth, start = [], 0, 1
  for i, char in enumerate(hlo_type):
    depth += char in "([{"
    depth -= char in ")]}"
    if (char == "," and depth == 1) or depth == 0:
      elements.append(hlo_type[start:i])
      start = i + 1
    if depth == 0:
      break
  return elements


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """Bytes of each kind of collective's results on one chip per step, from compiled HLO text;
  of a multi-slice program, also what each kind sends across slices ("<kind> across slices").

  Each collective counts as often as the program runs it: in a while loop's body (a scanned
  layer stack), as many times as its condition's bound. One collective may appear in several
  computations (TPU's async collective fusions copy it): its channel_id counts it once.
  """
  found: dict[str, tuple[str, float, int]] = {}  # channel (or line) -> (key, bytes, runs).
  computations, entry = _computations(hlo_text)
  partitions = _PARTITIONS.search(hlo_text)
  for name, runs in _runs(computations, entry).items():
    for index, line in enumerate(computations[name]):
      op, send = _OP.search(line), _DCN_SEND.search(line)
      if op:
        key, result = op.group(2), op.group(1)
        elements = _tuple_elements(result)
        # An async start's result is (operands, outputs, ...); all-reduce-start's, the outputs.
        if op.group(3) and key != "all-reduce" and len(elements) > 1:
          result = elements[1]
        if key == "ragged-all-to-all":
          result = min(result, _defined_type(computations[name], op.group(4)) or result,
                       key=_array_bytes)
      elif send:  # (payload, u32[], token[]).
        key = f"{_DCN_KINDS.get(send.group(2), send.group(2).lower())} across slices"
        result = _tuple_elements(f"({send.group(1)})")[0]
      else:
        continue
      channel = re.search(r"channel_id=(\d+)", line)
      identity = f"{key} {channel.group(1)}" if channel else f"{name} {index}"
      size = _array_bytes(result)
      if key == "collective-permute" and partitions:
        size *= _receiving_share(line, int(partitions.group(1)))
      earlier = found.get(identity, (key, 0, 0))
      found[identity] = (key, max(earlier[1], size), max(earlier[2], runs))
  totals = {kind: 0 for kind in COLLECTIVES}
  for key, size, runs in found.values():
    totals[key] = totals.get(key, 0) + size * runs
  return {kind: round(total) for kind, total in totals.items()}


def _receiving_share(line: str, partitions: int) -> float:
  """The share of the program's chips a collective permute delivers to (its pairs' targets);
  all of them where its line names no pairs."""
  pairs = _PAIRS.search(line)
  if not pairs:
    return 1.0
  return len(set(re.findall(r"\{\d+,(\d+)\}", pairs.group(1)))) / partitions


def _defined_type(lines: list[str], value: str) -> Optional[str]:
  """The HLO type of the instruction that defines %value among a computation's lines."""
  for line in lines:
    definition = _DEFINITION.match(line)
    if definition and definition.group(1) == value:
      return definition.group(2)
  return None


_HEADER = re.compile(r"^(ENTRY\s+)?%([^\s(]+)\s*\(.*\{\s*$")
_CALLEE = re.compile(r"\b(calls|to_apply|body|condition)=%([^\s,)}]+)")
_LOOP_BOUND = re.compile(r"s32\[\](?:\{[^}]*\})? constant\((\d+)\)")
_CALLEES = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], Optional[str]]:
  """The HLO module's computations (name -> instruction lines) and the entry's name."""
  computations, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = header.group(2)
      computations[current] = []
      entry = current if header.group(1) else entry
    elif line.rstrip() == "}":  # Not "}}, ...": a Pallas kernel's config spans lines.
      current = None
    elif current is not None:
      computations[current].append(line)
  return computations, entry


def _runs(computations: dict[str, list[str]], entry: Optional[str]) -> dict[str, int]:
  """How many times a step runs each computation reached from the entry (all once, if the
  text has no entry)."""
  if entry is None:
    return {name: 1 for name in computations}
  runs: dict[str, int] = {}

  def visit(name: str, times: int) -> None:
    runs[name] = runs.get(name, 0) + times
    for line in computations.get(name, ()):
      calls = _CALLEE.findall(line)
      callees = [callee for _, callee in calls]
      for group in _CALLEES.findall(line):
        callees += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
      trips = 1
      condition = dict(calls).get("condition")
      if condition:  # A while loop: its body runs up to its condition's bound.
        bound = _LOOP_BOUND.search("\n".join(computations.get(condition, ())))
        trips = int(bound.group(1)) if bound else 1
      for callee in callees:
        if callee in computations:
          visit(callee, times * (trips if callee == dict(calls).get("body") else 1))

  visit(entry, 1)
  return runs
