"""Pipeline parallelism: a scanned layer stack split into stages over the `stage` mesh axis,
the batch cut into microbatches that flow through them (trainer.pipeline).

Stage s of N holds layers s*C .. s*C + C - 1 of each of R repeats (C = layers / (N * R)): with
R = 1 consecutive layers (GPipe), with R > 1 every N*C-th chunk (the circular schedule, as
MaxText's). Each iteration every stage runs its chunk on one microbatch, then the activations
move one stage on (a collective permute over `stage`); microbatch m reaches stage s, repeat r at
iteration r*M + m + s, so a step takes M*R + N - 1 iterations, N - 1 of them partly idle (the
bubble). The backward pass is the loop's transpose: all forwards, then all backwards.

The params keep the unstaged layout [layers, ...] (checkpoints, export and any other mesh read
them as they are); partitioning splits their layer dimension over `stage`, so that for R = 1
each stage's chunk is already on its devices. A step's functions trace the model inside
`scheduled(config)`; stack_layers (common.py) asks `schedule_in_context` whether to pipeline.
Imports jax, flax and core only.
"""
import contextlib
import dataclasses
import math
import threading
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from levanter_flax.core import checks
from levanter_flax.core.errors import UserError
from levanter_flax.core.schema import setting

# The logical axis of a layer stack's leading dimension and of the stages' activations: the
# partitioner maps it onto the mesh's `stage` axis, whose size is the stages'.
LAYERS = "layers"


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """How a `stage` axis of trainer.device_mesh pipelines the layers (config.trainer.pipeline)."""
  microbatches: int = setting(
      0, "Microbatches each batch (each accumulation microbatch) is cut into to flow through "
      "the stages, at least the stages; 0: as many as the stages. More shrink the bubble, "
      "(stages - 1) / (microbatches * repeats + stages - 1)")
  repeats: int = setting(
      1, "Chunks of layers each stage holds, every stages-th chunk (the circular schedule): "
      "the bubble shrinks by this factor, at the cost of repeats times the sends")
  remat_stages: bool = setting(
      False, "Keep only each iteration's stage inputs for the backward pass, which recomputes "
      "the stage's layers (as model.compute.remat says within them): memory for M*R + N - 1 "
      "microbatches' inputs instead of every layer's, for one more forward pass")

  def __post_init__(self):
    checks.ranges(self, "trainer.pipeline", {"microbatches": checks.at_least(0, "0: the stages")})
    checks.positive(self, "trainer.pipeline", ("repeats",))


class Schedule(NamedTuple):
  """N stages, M microbatches, R repeats; remat: the stages rematerialised (remat_stages)."""
  stages: int
  microbatches: int
  repeats: int
  remat: bool = False

  @property
  def iterations(self) -> int:
    return self.microbatches * self.repeats + self.stages - 1

  @property
  def bubble(self) -> float:
    """The fraction of stage-iterations idle: (N - 1) / (M*R + N - 1)."""
    return (self.stages - 1) / self.iterations

  def describe(self) -> str:
    return (f"{self.stages} stages x {self.repeats} repeats, {self.microbatches} microbatches: "
            f"{self.iterations} iterations, bubble {self.bubble:.1%}"
            + (", stages rematerialised" if self.remat else ""))


def schedule_of(config: PipelineConfig, stages: int) -> Schedule | None:
  """The schedule on a mesh of `stages` stages; None (no pipeline) for one."""
  if stages <= 1:
    return None
  return Schedule(stages, config.microbatches or stages, config.repeats, config.remat_stages)


def check(config: PipelineConfig, stages: int, model_config, family_name: str,
          stacks_apart: bool) -> Schedule | None:
  """The schedule, or one line naming the setting that cannot pipeline `model_config`.
  stacks_apart: the family stacks its kinds of layer apart (DeepSeek's dense, then mixtures)."""
  schedule = schedule_of(config, stages)
  if schedule is None:
    return None
  where = f"trainer.device_mesh stage={stages}"
  if stacks_apart:
    raise UserError(f"{where}: {family_name} stacks its kinds of layer apart (dense, then "
                    f"mixtures), which cannot be pipelined; use a mesh without stage")
  if not model_config.compute.scan_layers:
    raise UserError(f"{where} pipelines a scanned layer stack: set "
                    f"config.model.compute.scan_layers=True")
  if schedule.microbatches < stages:
    raise UserError(f"trainer.pipeline.microbatches ({schedule.microbatches}) must be at least "
                    f"the stages ({where})")
  if model_config.num_layers % (stages * schedule.repeats):
    raise UserError(f"{where} x trainer.pipeline.repeats ({schedule.repeats}) = "
                    f"{stages * schedule.repeats} must divide config.model.num_layers "
                    f"({model_config.num_layers})")
  return schedule


def check_batch(schedule: Schedule | None, rows: int, data_parallel: int) -> None:
  """Each microbatch (rows per accumulation microbatch / microbatches) splits over the batch's
  axes."""
  if schedule and rows % (schedule.microbatches * data_parallel):
    raise UserError(f"config.trainer.batch_size / gradient_accumulation_steps ({rows}) must be "
                    f"divisible by trainer.pipeline.microbatches ({schedule.microbatches}) x the "
                    f"activation axis size ({data_parallel})")


_CONTEXT = threading.local()


@contextlib.contextmanager
def _within(name: str, value):
  """_CONTEXT.<name> is `value` within it, its value before after."""
  previous = getattr(_CONTEXT, name, None)
  setattr(_CONTEXT, name, value)
  try:
    yield
  finally:
    setattr(_CONTEXT, name, previous)


def scheduled(config: PipelineConfig):
  """Within it, a model traced on a mesh with a `stage` axis pipelines its layer stack."""
  return _within("config", config)


def unrolled_loops():
  """Within it, a pipeline's loops (its iterations, each stage's layers) trace unrolled: the
  compiler's cost model counts a loop's body once (the planner counts a pipelined step's
  FLOPs by it)."""
  return _within("unrolled", True)


def stage_axes() -> tuple[str, ...]:
  """The mesh axes the stages are on, by the logical axis rules in context."""
  axes = dict(nn.get_logical_axis_rules()).get(LAYERS)
  return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def schedule_in_context() -> Schedule | None:
  """The schedule of the step being traced (scheduled()) on the mesh in context; None if none."""
  config = getattr(_CONTEXT, "config", None)
  if config is None:
    return None
  mesh = jax.sharding.get_abstract_mesh()
  return schedule_of(config, math.prod(mesh.shape[axis] for axis in stage_axes()))


def in_stage() -> bool:
  """Whether the model being traced is one stage's chunk, vmapped over the stages."""
  return bool(getattr(_CONTEXT, "in_stage", False))


def _tracing_a_stage():
  return _within("in_stage", True)


def microbatches(rows: jax.Array, count: int) -> jax.Array:
  """[batch, ...] -> [count, batch / count, ...]: microbatch i is rows i, i + count, ...,
  so that each one is spread over every device of the batch axis (a pipeline's cut, and
  gradient accumulation's)."""
  if rows.shape[0] % count:
    raise UserError(f"a batch of {rows.shape[0]} rows cannot be cut into {count} microbatches")
  return rows.reshape(rows.shape[0] // count, count, *rows.shape[1:]).swapaxes(0, 1)


def _rows(micro: jax.Array) -> jax.Array:
  """microbatches' inverse."""
  return micro.swapaxes(0, 1).reshape(-1, *micro.shape[2:])


def run(layer_cls, cfg, stack: nn.Module, x: jax.Array, shared, per_layer,
        schedule: Schedule, collections: tuple[str, ...], summed: tuple[str, ...]) -> jax.Array:
  """The layers of `stack` (a layer_cls module whose params are stacked [layers, ...], as
  stack_layers' scan makes them) applied to x [batch, length, embed] as `schedule` pipelines
  them. What the layers sow into `collections` is put in `stack`'s as the scan would: per
  layer, each microbatch's mean (their sum for the collections in `summed`: counts)."""
  stages, count, repeats, remat = schedule
  params = stack.variables["params"]
  num_layers = jax.tree.leaves(params)[0].shape[0]
  chunk = num_layers // (stages * repeats)

  def staged(a):  # [layers, ...] -> [stage, repeat, layer in the chunk, ...]
    return a.reshape(repeats, stages, chunk, *a.shape[1:]).swapaxes(0, 1)
  stage_params = jax.tree.map(staged, params)
  values = None if per_layer is None else staged(jnp.asarray(per_layer))
  batch = x.shape[0]
  inputs = _constrain(microbatches(x, count), None)
  shared = jax.tree.map(
      lambda a: microbatches(jnp.broadcast_to(a, (batch, *a.shape[1:])), count), shared)
  dropout = stack.make_rng("dropout") if stack.has_rng("dropout") else None
  layer = _Named(layer_cls, cfg, stack.name)
  unrolled = bool(getattr(_CONTEXT, "unrolled", False))

  @_tracing_a_stage()
  def stage(p, h, sh, vals, index, step):
    """One stage's chunk on one microbatch; index: the stage's, step: r*M + m."""
    repeat = step // count
    p = jax.tree.map(lambda a: a[repeat] if repeats > 1 else a[0], p)
    vals = None if vals is None else vals[repeat] if repeats > 1 else vals[0]

    def one_layer(h, xs):
      p_layer, value, j = xs
      rngs = None
      if dropout is not None:  # Per layer and microbatch, whatever the stages.
        layer_index = (repeat * stages + index) * chunk + j
        rngs = {"dropout": jax.random.fold_in(jax.random.fold_in(dropout, step % count),
                                              layer_index)}
      extra = () if value is None else (value,)
      h, sown = layer.apply({"params": {stack.name: p_layer}}, h, sh, *extra, rngs=rngs,
                            mutable=list(collections))
      return h, {collection: tree[stack.name] for collection, tree in sown.items() if tree}
    return jax.lax.scan(one_layer, h, (p, vals, jnp.arange(chunk)), unroll=unrolled)

  per_stage = jax.vmap(jax.checkpoint(stage) if remat else stage, spmd_axis_name=stage_axes())
  indices = jnp.arange(stages)

  def iteration(carry, t):
    """state: each stage's input at iteration t; queue: the microbatches waiting for stage 0,
    the one it takes at iteration t + p at position p (t + 1 + p once rolled below)."""
    state, queue = carry
    step = jnp.clip(t - indices, 0, count * repeats - 1)  # Microbatch step % M, repeat step // M.
    sh = jax.tree.map(lambda a: a[step % count], shared)
    out, sown = per_stage(stage_params, _constrain(state, LAYERS), sh, values, indices, step)
    out = _constrain(out, LAYERS)
    # The last stage's output waits for its next repeat (or the end) at position M - N, which
    # stage 0 reaches M - N + 1 iterations on; static positions keep the queue laid out as the
    # batch (a position picked by t made XLA gather it).
    done = t - (stages - 1)
    finished = (done >= 0) & (done < count * repeats)
    last = nn.with_logical_constraint(out[-1], ("batch", "length", _SENT))  # On every stage.
    queue = jnp.roll(queue, -1, axis=0)
    queue = _constrain(queue.at[count - stages].set(
        jnp.where(finished, last, queue[count - stages])), None, _SENT)
    # Each stage's output moves one stage on; none from the last to the first.
    sent = _constrain(out[:-1], LAYERS, _SENT)
    return (jnp.concatenate([queue[:1], sent], axis=0), queue), sown

  state = jnp.concatenate([inputs[:1], jnp.zeros((stages - 1, *inputs.shape[1:]), inputs.dtype)])
  (_, queue), sown = jax.lax.scan(iteration, (state, _constrain(inputs, None, _SENT)),
                                  jnp.arange(schedule.iterations), unroll=unrolled)
  for collection, tree in _per_layer(sown, schedule, summed).items():
    for name, value in tree.items():
      stack.put_variable(collection, name, value)
  # Microbatch m's last output was queued at iteration (R-1)M + m + N - 1, M - 1 - m
  # iterations before the end: at position m - N + 1.
  outputs = jnp.roll(queue, stages - 1, axis=0)
  return _rows(outputs)


class _Named(nn.Module):
  """A layer applied alone under its stack's name: what matches a layer's params by name (LoRA's
  targets, layers/self_attn/q_proj) sees the names the scanned stack has."""
  layer_cls: Any
  config: Any
  stack_name: str

  @nn.compact
  def __call__(self, *args):
    return self.layer_cls(self.config, False, name=self.stack_name)(*args)


def _per_layer(sown: dict, schedule: Schedule, summed: tuple[str, ...]) -> dict:
  """The loop's sown values [iterations, stage, layer in the chunk, ...] as [layers, ...],
  each layer's combined over the microbatches it ran."""
  stages, count, repeats, _ = schedule
  m, r, s = jnp.meshgrid(jnp.arange(count), jnp.arange(repeats), jnp.arange(stages),
                         indexing="ij")
  t = r * count + m + s  # When stage s ran microbatch m of repeat r.

  def per_layer(collection, a):
    a = a[t, s]  # [M, R, N, chunk, ...]: layer (r*N + s)*chunk + j.
    a = a.reshape(count, -1, *a.shape[4:])
    return a.sum(0) if collection in summed else a.mean(0)
  return {collection: jax.tree.map(lambda a, c=collection: per_layer(c, a), dict(tree))
          for collection, tree in sown.items() if tree}


# The width of the activations a stage sends (and the queue's) splits over the tensor axis,
# which the layers' outputs are replicated over: each of its devices sends its share, not all
# of them the whole (over the data-center network, when the stages are slices), and the
# receiver gathers it within its slice.
_SENT = "mlp"


def _constrain(x: jax.Array, first: Any, width: str = "embed") -> jax.Array:
  """[first, microbatch rows, length, width] laid out: rows over the batch's axes."""
  return nn.with_logical_constraint(x, (first, "batch", "length", width))
