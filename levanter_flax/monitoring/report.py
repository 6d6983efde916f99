"""Runs compared from their workdirs: a table of each run's summary, plots of loss and
throughput against steps, and the profiler's trace summarized. The report command's library."""
import collections
import math
import re
import statistics
from typing import Optional, Sequence

from etils import epath

from levanter_flax.core import paths
from levanter_flax.core.errors import UserError
from levanter_flax.monitoring.history import Run, load_run


def summary(run: Run) -> dict[str, Optional[float]]:
  """The table's row: None where the run did not log what a column needs."""
  def last(key):
    values = run.values(key)
    return values[-1] if values else None

  def median(key):
    values = run.values(key)
    return statistics.median(values) if values else None

  eval_losses = [v for v in run.values("eval/loss") if not math.isnan(v)]
  times = [[r["time"] for r in segment if "time" in r] for segment in run.segments]
  skipped = [max((r.get("train/skipped_steps", 0.0) for r in segment), default=0.0)
             for segment in run.segments]
  return {
      "final eval loss": eval_losses[-1] if eval_losses else None,
      "best eval loss": min(eval_losses) if eval_losses else None,
      "tokens": last("data/tokens"),
      "median tokens/s": median("train/tokens_per_second"),
      "median MFU": median("train/mfu"),
      "wall time (s)": sum(t[-1] - t[0] for t in times if t) if any(times) else None,
      "NaN skips": sum(skipped),
      "restarts": max(len(run.segments) - 1, 0),
  }


def format_table(runs: Sequence[Run]) -> str:
  rows = [summary(run) for run in runs]
  columns = ["run", *rows[0]]
  cells = [[run.name, *(_format(column, row[column]) for column in rows[0])]
           for run, row in zip(runs, rows)]
  widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
  lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
  lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
  return "\n".join(lines)


def _format(column: str, value: Optional[float]) -> str:
  if value is None:
    return "-"
  if column in ("tokens", "NaN skips", "restarts"):
    return f"{value:.0f}"
  if column == "median MFU":
    return f"{100 * value:.2f}%"
  if column in ("median tokens/s", "wall time (s)"):
    return f"{value:.1f}"
  return f"{value:.4f}"


def plot(runs: Sequence[Run], output_dir: epath.Path) -> list[epath.Path]:
  """One PNG per view, every run on the same axes; "reward" where a run logged GRPO's."""
  import matplotlib  # pylint: disable=g-import-not-at-top  # Only the report needs it.
  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top

  paths.make_dirs(output_dir, "--output_dir")
  views = {
      "loss_vs_step": [("train/loss", "step", "train loss"), ("eval/loss", "step", "eval loss")],
      "loss_vs_tokens": [("train/loss", "tokens", "train loss"), ("eval/loss", "tokens", "eval loss")],
      "throughput": [("train/tokens_per_second", "step", "tokens/s"), ("train/mfu", "step", "MFU")],
      "learning_rate": [("train/learning_rate", "step", "learning rate")],
  }
  if any(run.points("rl/reward_mean")[0] for run in runs):  # A GRPO run's.
    views["reward"] = [("rl/reward_mean", "step", "reward (mean over completions)"),
                       ("rl/reward_std", "step", "reward std"),
                       ("grpo/clip_region", "step", "clipped tokens")]
  written = []
  for view, panels in views.items():
    figure, axes = pyplot.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for axis, (key, x_name, label) in zip(axes[0], panels):
      for run in runs:
        steps, values = run.points(key)
        xs = steps if x_name == "step" else [run.series.get("data/tokens", {}).get(s) for s in steps]
        kept = [(x, v) for x, v in zip(xs, values) if x is not None]
        if kept:
          axis.plot(*zip(*kept), marker="o" if key.startswith("eval/") else None, label=run.name)
      axis.set_xlabel(x_name)
      axis.set_ylabel(label)
      axis.grid(alpha=0.3)
      if axis.lines:
        axis.legend()
      else:
        axis.text(0.5, 0.5, f"{key} was not logged", ha="center", transform=axis.transAxes)
    figure.tight_layout()
    path = output_dir / f"{view}.png"
    try:
      with path.open("wb") as f:
        figure.savefig(f, format="png", dpi=100)
    except OSError as e:
      raise UserError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
      pyplot.close(figure)
    written.append(path)
  return written


# The trainer's trace annotations (loop.py): each step, and the parts of it that are not compute.
PHASES = ("train", "data_wait", "eval", "checkpoint")
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DATA_MOVEMENT = ("copy", "transpose", "bitcast", "reshape", "pad", "slice", "dynamic-slice",
                  "dynamic-update-slice", "concatenate", "broadcast", "iota")


def op_kind(event_name: str) -> str:
  """What an XLA op of a trace is. A TPU's trace names each op by its HLO instruction
  ("%fusion.12 = bf16[..] fusion(..), kind=kOutput, calls=.."), where an output fusion is a
  matmul's; the parameters' names show the optimizer's update and the weights' casts. A CPU's
  names the op alone ("dot.3", "ynn_fusion.7": XNNPACK's matmuls)."""
  name, _, instruction = event_name.lstrip("%").partition(" = ")
  opcode = re.search(r"\s([a-z][a-z0-9-]*)\(", instruction)
  opcode = opcode.group(1) if opcode else re.sub(r"[._]\d+$", "", name)
  if opcode == "custom-call" or "custom_call_target" in instruction:
    return "attention kernel" if re.search("splash|flash|attention", name) else "other kernel"
  if "state_opt_state" in instruction:
    return "optimizer update"
  if "kind=kOutput" in instruction or re.search("dot|convolution|ynn", opcode):
    return "matmul"
  if "convert" in name and "state_params" in instruction:
    return "weight cast"
  if opcode.removesuffix("-start").removesuffix("-done") in _COLLECTIVES:
    return "collective"
  if opcode.removesuffix("-start").removesuffix("-done") in _DATA_MOVEMENT:
    return "copy, transpose, layout"
  if opcode in ("while", "conditional", "call"):
    return "control flow"
  return "elementwise, norms, reductions"


def _self_times(events: list) -> list[tuple[object, int]]:
  """(event, its duration less that of the events inside it) for one trace line's events: a
  loop's op holds its body's."""
  times, open_events = {}, []
  for event in sorted(events, key=lambda e: (e.start_ns, -e.duration_ns)):
    while open_events and open_events[-1].end_ns <= event.start_ns:
      open_events.pop()
    times[id(event)] = event.duration_ns
    if open_events:
      times[id(open_events[-1])] -= event.duration_ns
    open_events.append(event)
  return [(event, times[id(event)]) for event in events]


def profile_summary(workdir: epath.Path, top_ops: int = 5) -> Optional[str]:
  """Where the newest profile's time went: per step, per loop phase, per kind of XLA op, and
  the busiest ops.

  None when the run was not profiled. XLA op time is summed over the device's
  (or, on CPU, the host's compute) threads, so it can exceed the wall time.
  """
  traces = sorted(workdir.glob("plugins/profile/*/*.xplane.pb"))
  if not traces:
    return None
  from jax.profiler import ProfileData  # pylint: disable=g-import-not-at-top  # Only for traces.
  phases: dict[str, list] = collections.defaultdict(list)
  ops: collections.Counter = collections.Counter()
  kinds: collections.Counter = collections.Counter()
  end = 0  # Of the last step's compute, which outlasts its annotation.
  for plane in ProfileData.from_serialized_xspace(traces[-1].read_bytes()).planes:
    for line in plane.lines:
      xla_line = line.name == "XLA Ops" or line.name.startswith("tf_XLA")
      events = [e for e in line.events
                if not (xla_line and e.name.startswith(("ThunkExecutor", "Threadpool")))]
      if xla_line:
        for event, duration in _self_times(events):
          ops[event.name.lstrip("%").split(" = ")[0]] += duration
          kinds[op_kind(event.name)] += duration
          end = max(end, event.end_ns)
      for event in events:
        if not xla_line and event.name in PHASES:
          phases[event.name].append(event)
          end = max(end, event.end_ns)
  if not phases["train"]:
    return f"{traces[-1]}: no train steps traced"
  wall = end - min(e.start_ns for e in phases["train"])
  steps = len(phases["train"])
  lines = [f"{traces[-1]}: {steps} steps in {wall / 1e6:.1f} ms, {wall / steps / 1e6:.2f} ms per step"]
  for name in PHASES[1:]:
    total = sum(e.duration_ns for e in phases[name])
    lines.append(f"  {name:<12} {total / 1e6:9.2f} ms  {100 * total / wall:5.1f}% of the window")
  for kind, total in kinds.most_common():
    lines.append(f"  {kind:<31} {total / steps / 1e6:9.2f} ms a step  "
                 f"{100 * total / wall:5.1f}% of the window")
  for name, total in ops.most_common(top_ops):
    lines.append(f"  XLA {name:<40} {total / 1e6:9.2f} ms")
  return "\n".join(lines)


def run_names(workdirs: Sequence[epath.Path]) -> list[str]:
  """The directory names, or the whole paths where two names would be the same."""
  names = [w.name for w in workdirs]
  return names if len(set(names)) == len(names) else [str(w) for w in workdirs]


def report(workdirs: Sequence[epath.Path], output_dir: epath.Path) -> str:
  runs = [load_run(w, n) for w, n in zip(workdirs, run_names(workdirs))]
  plots = plot(runs, output_dir)
  profiles = [p for p in (profile_summary(w) for w in workdirs) if p]
  return "\n\n".join([format_table(runs), "Plots: " + ", ".join(str(p) for p in plots), *profiles])
