"""The jitted train and eval steps: the model's token losses, the objective's loss on them
(objectives/), gradients, optimizer update. Nothing here depends on which objective trains."""
import collections
import concurrent.futures
import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from absl import logging

from levanter_flax import models
from levanter_flax.objectives import base as objective_base, next_token
from levanter_flax.optim import optimizers, spikes
from levanter_flax.parallel import partitioning
from levanter_flax.models import common, lora, moe, pipeline

if TYPE_CHECKING:  # settings.py imports batch_search.py, which imports this module.
  from levanter_flax.config import settings

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]


@flax.struct.dataclass
class TrainState:
  """`params` are what trains. With LoRA (config.model.lora) they are the adapters, and the
  base model's params are `frozen`: no gradient, no optimizer state, and not in the
  checkpoints (`checkpointed`), which would repeat them every time; the run saves them once
  (restore.py). An objective that needs a reference model (DPO) keeps it without LoRA as
  `reference`, the initial params, saved once the same way; with LoRA its reference is the
  base, `frozen`."""
  step: jax.Array
  params: Any
  opt_state: Any
  frozen: Any = None
  reference: Any = None

  @property
  def model_params(self) -> Any:
    """What the model applies: the params, with the frozen base if there is one."""
    return lora.merged(self.frozen, self.params)

  @property
  def reference_params(self) -> Any:
    """The reference model's params (applied by the model without LoRA): the frozen copy of
    the initial params, or LoRA's base; None if neither."""
    return self.frozen if self.reference is None else self.reference

  @property
  def checkpointed(self) -> dict:
    """What a checkpoint holds: every field but the frozen base and the reference, as the tree
    that checkpoints held before there were those, so that those restore."""
    return {"step": self.step, "params": self.params, "opt_state": self.opt_state}

  @classmethod
  def from_checkpointed(cls, saved: dict, frozen: Any = None,
                        reference: Any = None) -> "TrainState":
    return cls(**saved, frozen=frozen, reference=reference)


def init_state(model: nn.Module, optimizer: optax.GradientTransformation,
               rng: jax.Array, keep_reference: bool = False) -> TrainState:
  """Fresh state; with LoRA the base is frozen and only the adapters train. keep_reference
  (the objective needs a reference model) without LoRA: a copy of the params is the reference
  (ShardedSteps.init leaves it out)."""
  params = models.init_params(model.config, rng)
  frozen = reference = None
  if model.config.lora.rank:
    lora.check_targets(model.config, params)
    frozen, params = lora.split(params)
  elif keep_reference:
    reference = copied(params)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=optimizer.init(params), frozen=frozen, reference=reference)


def copied(params: Any) -> Any:
  """Params in buffers of their own: the reference must not be donated with the params."""
  return jax.tree.map(jnp.copy, params)


NEXT_TOKEN = next_token.NextToken()


@dataclasses.dataclass(frozen=True)
class Reference:
  """The reference model an objective compares the policy with: `model` (the model without
  LoRA) on `params` (TrainState.reference_params), held constant."""
  model: nn.Module
  params: Any


def blockwise_cross_entropy(hidden: jax.Array, embedding: jax.Array, labels: jax.Array,
                            block_size: int, temperature: float = 1.0) -> jax.Array:
  """Cross-entropy of each label under logits = hidden @ embedding.T / temperature, one
  vocabulary block at a time; labels' shape.

  A scan keeps a running max and sum of exponentials per token (an online
  logsumexp), and picks each label's logit out of the block that holds it. Its
  body is checkpointed, so the backward pass recomputes each block's logits
  too: neither pass ever holds [tokens, vocab] floats, only [tokens,
  block_size]. Logits are float32, as in the plain loss. No row of the
  embedding is looked up by label: under ZeRO-3 such a gather from the split
  table is a whole batch's worth of all-reduced rows.
  """
  shape = labels.shape
  hidden = hidden.reshape(-1, hidden.shape[-1])
  labels = labels.reshape(-1)
  vocab_size = embedding.shape[0]
  num_blocks = -(-vocab_size // block_size)
  padded = jnp.pad(embedding, ((0, num_blocks * block_size - vocab_size), (0, 0)))
  # Each block split as the head is for tensor parallelism (vocab), and along its width for
  # ZeRO-3: each step of the scan gathers one block, never the whole head.
  blocks = common.constrain(padded.reshape(num_blocks, block_size, -1).astype(hidden.dtype),
                     None, "vocab", "zero3")

  @jax.checkpoint
  def add_block(carry, block):
    running_max, running_sum, label_logits = carry
    index, weights = block
    logits = _tempered((hidden @ weights.T).astype(jnp.float32), temperature)
    in_vocab = index * block_size + jnp.arange(block_size) < vocab_size
    logits = jnp.where(in_vocab, logits, -jnp.inf)
    new_max = jnp.maximum(running_max, logits.max(axis=-1))
    running_sum = (running_sum * jnp.exp(running_max - new_max)
                   + jnp.exp(logits - new_max[:, None]).sum(axis=-1))
    column = labels - index * block_size
    label_logits += jnp.where(column[:, None] == jnp.arange(block_size), logits, 0).sum(axis=-1)
    return (new_max, running_sum, label_logits), None
  start = (jnp.full(labels.shape, -jnp.inf, jnp.float32), jnp.zeros(labels.shape, jnp.float32),
           jnp.zeros(labels.shape, jnp.float32))
  (running_max, running_sum, label_logits), _ = jax.lax.scan(
      add_block, start, (jnp.arange(num_blocks), blocks))
  return (running_max + jnp.log(running_sum) - label_logits).reshape(shape)


def next_token_loss(model: nn.Module, params, tokens: jax.Array,
                    eos_id: int | None = None) -> jax.Array:
  """Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1], in float32."""
  return loss_and_parts(model, params, {"tokens": tokens}, eos_id)[1]["loss"]


def segment_ids(tokens: jax.Array, eos_id: int) -> jax.Array:
  """Which document each token of a packed window is in: the loader puts EOS after every
  document, so each EOS starts a segment. It ends the document before it as a target
  (predicted from that document) and opens the next as its first input, as a BOS would."""
  return jnp.cumsum(tokens == eos_id, axis=1)


def loss_and_parts(model: nn.Module, params, batch: Batch, eos_id: int | None = None,
                   objective: objective_base.Objective = NEXT_TOKEN, totals: Any = None,
                   auxiliary_share: float = 1.0, rngs: dict | None = None,
                   reference: Reference | None = None) -> tuple[jax.Array, Metrics]:
  """(the training loss, its parts): "loss", the objective's loss on the model's token losses
  (and the reference's, where it needs them), the objective's metrics, and each auxiliary loss
  the model sows into its "losses" collection (a mixture's "router_aux_loss"), averaged over
  the layers that sow it, and the router's metrics (moe.py: "router/..."). The training loss
  adds each auxiliary loss times its weight (moe.loss_coefficients) to the objective's.

  With an eos_id (data.document_masking), each document of a window is computed as if alone:
  attention within it, positions from 0. rngs: the model's ("dropout": LoRA's in training).

  A microbatch passes its whole batch's `totals` (objective.totals) and its share of the batch
  (`auxiliary_share`, which scales the auxiliary losses), so that the microbatches' losses and
  parts sum to the batch's, however its weight falls among them.
  """
  tokens, temperature = batch["tokens"], objective.logit_temperature
  losses, sown = _token_losses(model, params, tokens, eos_id, rngs, temperature)
  reference_losses = None
  if reference is not None:
    reference_losses = _token_losses(reference.model, jax.lax.stop_gradient(reference.params),
                                     tokens, eos_id, temperature=temperature)[0]
  loss, metrics = objective.loss(losses, reference_losses, batch,
                                 objective.totals(batch) if totals is None else totals)
  auxiliary = {**_sown_losses(sown), **_router_metrics(sown), **_expert_loads(sown)}
  auxiliary = jax.tree.map(lambda value: value * auxiliary_share, auxiliary)
  return (loss + _weighted(auxiliary, moe.loss_coefficients(model.config)),
          {"loss": loss, **metrics, **auxiliary})


def _weighted(auxiliary: Metrics, coefficients: dict[str, float]) -> jax.Array:
  """The sum of the auxiliary losses times their weights; metrics without one add nothing."""
  return sum(coefficients[name] * value for name, value in auxiliary.items()
             if name in coefficients)


def _token_losses(model: nn.Module, params, tokens: jax.Array, eos_id: int | None,
                  rngs: dict | None = None, temperature: float = 1.0) -> tuple[jax.Array, Any]:
  """(float32 cross-entropy of predicting each of tokens[:, 1:] from the tokens before it, by
  the softmax of the logits / temperature; what the model sowed)."""
  block_size = model.config.compute.cross_entropy_block_size
  segments = None if eos_id is None else segment_ids(tokens, eos_id)
  apply = functools.partial(model.apply, {"params": params}, tokens, segment_ids=segments,
                            mutable=["losses", "router", moe.BALANCE], rngs=rngs)
  if block_size:
    hidden, sown = apply(return_hidden=True)
    return blockwise_cross_entropy(hidden[:, :-1], model.output_embedding(params), tokens[:, 1:],
                                   block_size, temperature), sown
  logits, sown = apply()
  return optax.softmax_cross_entropy_with_integer_labels(
      _tempered(logits[:, :-1].astype(jnp.float32), temperature), tokens[:, 1:]), sown


def _tempered(logits: jax.Array, temperature: float) -> jax.Array:
  """logits / temperature; at 1 (every objective but a sampling one) no op in the step."""
  return logits if temperature == 1 else logits / temperature


def _sown_losses(sown) -> Metrics:
  """name -> the mean of what every layer sowed under it."""
  values = collections.defaultdict(list)
  for path, value in jax.tree_util.tree_leaves_with_path(sown.get("losses", {})):
    name = next(key.key for key in reversed(path) if isinstance(key, jax.tree_util.DictKey))
    values[name].append(jnp.reshape(value, -1))  # Scanned layers sow a stack.
  return {name: jnp.concatenate(parts).mean() for name, parts in values.items()}


def _router_metrics(sown) -> Metrics:
  """A mixture's router metrics: router/layer_<i>/load_max_over_mean for each layer, and
  router/entropy and router/dropped_fraction averaged over layers."""
  router = sown.get("router", {})
  if not router:
    return {}
  per_layer = collections.defaultdict(list)
  for path, value in sorted(jax.tree_util.tree_leaves_with_path(router),
                            key=lambda leaf: _layer_index(leaf[0])):
    per_layer[path[-2].key].append(jnp.reshape(value, -1))  # Scanned layers sow a stack.
  per_layer = {name: jnp.concatenate(parts) for name, parts in per_layer.items()}
  return {**{f"router/layer_{i}/load_max_over_mean": load
             for i, load in enumerate(per_layer["load_max_over_mean"])},
          "router/entropy": per_layer["entropy"].mean(),
          "router/dropped_fraction": per_layer["dropped_fraction"].mean()}


def _expert_loads(sown) -> dict:
  """Sigmoid routers' copies per expert, {moe.BALANCE: {MoeBlock path: load}}; {} without."""
  loads = {"/".join(key.key for key in path[:-2]): value
           for path, value in jax.tree_util.tree_leaves_with_path(sown.get(moe.BALANCE, {}))}
  return {moe.BALANCE: loads} if loads else {}


def _layer_index(path) -> int:
  """An unrolled layer's index from its name (layers_12), 0 for a scanned stack."""
  name = next((key.key for key in path if isinstance(key, jax.tree_util.DictKey)
               and key.key.rsplit("_", 1)[-1].isdigit()), "_0")
  return int(name.rsplit("_", 1)[-1])


def accumulated_loss_and_grads(model: nn.Module, params, batch: Batch, num_microbatches: int,
                               eos_id: int | None = None,
                               objective: objective_base.Objective = NEXT_TOKEN, frozen=None,
                               dropout_key: jax.Array | None = None,
                               reference: Reference | None = None,
                               unreduced: tuple[str, int] | None = None):
  """The batch's loss parts (loss_and_parts') and the training loss's gradient, summed over
  microbatches by a lax.scan.

  The gradient is of `params` alone: a LoRA model's `frozen` base is applied with them but
  gets none. dropout_key: LoRA's dropout, folded with each microbatch's index.

  Microbatch i is rows i, i + n, i + 2n, ... of every batch entry, so that each one is spread
  over every device of the batch axis, and peak activation memory is that of one microbatch.
  Each divides its sums by what the whole batch holds (objective.totals), so the microbatches'
  losses and gradients add up to the batch's, as without accumulation.

  unreduced: (mesh axis, its size) of the batch over which the gradients of the microbatches
  are kept apart, one per shard of the axis, until the last microbatch: one reduction over it
  a step, not one a microbatch (for the axis that spans TPU slices: the data-center network
  carries one reduction whatever the accumulation). Each shard then computes its share of a
  microbatch as a vmapped batch of its own; a mixture's router loss is its share's.
  """
  totals = objective.totals(batch)
  shares = unreduced[1] if unreduced and num_microbatches > 1 else 1

  def parts_and_grads(p, b, index=0):
    rngs = None if dropout_key is None else {"dropout": jax.random.fold_in(dropout_key, index)}
    (_, parts), grads = jax.value_and_grad(
        lambda p: loss_and_parts(model, lora.merged(frozen, p), b, eos_id, objective, totals,
                                 1 / (num_microbatches * shares), rngs, reference),
        has_aux=True)(p)
    return parts, grads
  if num_microbatches == 1:
    return parts_and_grads(params, batch)
  if shares > 1:
    parts_and_grads = _per_share(parts_and_grads, *unreduced)

  def split(rows):
    return nn.with_logical_constraint(pipeline.microbatches(rows, num_microbatches),
                                      (None, "batch", *_within_row(rows)))
  microbatches = jax.tree.map(split, batch)

  def add(sums, indexed):
    index, microbatch = indexed
    return jax.tree.map(jnp.add, sums, parts_and_grads(params, microbatch, index)), None
  zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(
      parts_and_grads, params, jax.tree.map(lambda m: m[0], microbatches)))
  sums, _ = jax.lax.scan(add, zeros, (jnp.arange(num_microbatches), microbatches))
  if shares > 1:  # The one reduction over the unreduced axis.
    sums = jax.tree.map(lambda total: total.sum(axis=0), sums)
  return sums


def _within_row(rows: jax.Array) -> tuple[str, ...]:
  """The logical axes of a batch entry after its rows: a sequence's ("length"), or none."""
  return ("length",) * (rows.ndim - 1)


def _per_share(parts_and_grads, axis: str, shares: int):
  """parts_and_grads on a microbatch cut into `shares` equal blocks of rows, each computed
  apart on its shard of mesh axis `axis` (vmapped over it): their results stacked, unreduced.
  A block's rows are those the batch sharding already puts there, so no row moves."""
  def per_share(p, b, index=0):
    split = lambda rows: nn.with_logical_constraint(
        rows.reshape(shares, rows.shape[0] // shares, *rows.shape[1:]),
        ("unreduced", "batch", *_within_row(rows)))
    with nn.logical_axis_rules(_rules_within_share(axis)):
      return jax.vmap(parts_and_grads, in_axes=(None, 0, None), spmd_axis_name=axis)(
          p, jax.tree.map(split, b), index)
  return per_share


def _rules_within_share(axis: str) -> tuple:
  """The logical axis rules with `axis` the vmapped blocks' ("unreduced") and no other's: within
  a block, the batch is split over the rest of its axes."""
  rules = []
  for name, axes in nn.get_logical_axis_rules():
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    rules.append((name, tuple(a for a in axes if a != axis) or None))
  return (("unreduced", axis), *rules)


def make_train_step(model: nn.Module, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, num_microbatches: int = 1,
                    eos_id: int | None = None, seed: int = 0,
                    objective: objective_base.Objective = NEXT_TOKEN,
                    unreduced: tuple[str, int] | None = None
                    ) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
  """eos_id: mask attention per document (see loss_and_parts). seed: of LoRA's dropout, whose
  key is folded with the step, so that a resumed run drops what an uninterrupted one would.
  objective: what the loss is, on batches of its entries (against TrainState.reference_params
  where it needs a reference model). unreduced: see accumulated_loss_and_grads."""
  uses_dropout = bool(model.config.lora.rank and model.config.lora.dropout)
  bias_update_rate = moe.bias_update_rate(model.config)
  reference_model = _reference_model(model, objective)
  own_metric = lambda name: name.startswith(f"{objective.name}/")

  def train_step(state: TrainState, batch: Batch):
    """One update; a non-finite loss or gradient leaves params and optimizer state as they were.

    The step still counts (its batch is consumed), and train/nonfinite says it
    was skipped; the loop then warns or halts per trainer.nan_policy. Under
    trainer.spike_policy=skip the optimizer (spikes.py) gives a spike a zero update, counted
    in train/spike_skipped_steps.
    """
    dropout_key = (jax.random.fold_in(jax.random.key(seed), state.step) if uses_dropout
                   else None)
    reference = reference_model and Reference(reference_model, state.reference_params)
    parts, grads = accumulated_loss_and_grads(model, state.params, batch, num_microbatches,
                                              eos_id, objective, state.frozen, dropout_key,
                                              reference, unreduced)
    parts = dict(parts)
    expert_loads = parts.pop(moe.BALANCE, None)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(parts["loss"]) & jnp.isfinite(grad_norm)
    # Microbatch 0 (rows 0, n, 2n, ...: on every device), for optimizers that probe the loss.
    hessian_batch = jax.tree.map(lambda rows: rows[::num_microbatches], batch)
    updates, opt_state = optimizer.update(
        grads, state.opt_state, state.params, loss=parts["loss"],
        loss_fn=lambda params: loss_and_parts(model, lora.merged(state.frozen, params),
                                              hessian_batch, eos_id, objective,
                                              reference=reference)[0])
    params = optax.apply_updates(state.params, updates)
    if expert_loads is not None and bias_update_rate:  # A frozen base (LoRA) keeps its biases.
      params = moe.updated_biases(params, expert_loads, bias_update_rate)
    if_finite = lambda new, old: jnp.where(finite, new, old)
    new_state = state.replace(step=state.step + 1,
                              params=jax.tree.map(if_finite, params, state.params),
                              opt_state=jax.tree.map(if_finite, opt_state, state.opt_state))
    metrics = {
        **{name if own_metric(name) else f"train/{name}": value for name, value in parts.items()},
        "train/grad_norm": grad_norm,
        "train/param_norm": optax.tree.norm(new_state.params),
        "train/update_norm": optax.tree.norm(updates),
        "train/learning_rate": schedule(state.step),
        "train/nonfinite": 1.0 - finite.astype(jnp.float32),
        "train/loss_tokens": loss_tokens(batch),
    }
    skipped = spikes.skipped_spikes(new_state.opt_state)
    if skipped is not None:
      metrics["train/spike_skipped_steps"] = skipped.astype(jnp.float32)
      metrics["train/spike"] = (skipped - spikes.skipped_spikes(state.opt_state)).astype(
          jnp.float32)
    return new_state, metrics
  return train_step


def loss_tokens(batch: Batch) -> jax.Array:
  """How many targets train/loss averages: every token but each row's first, or those with a
  weight (a preference row's: both replies')."""
  if "loss_weights" in batch:
    return (batch["loss_weights"][:, 1:] > 0).sum().astype(jnp.float32)
  rows, length = batch["tokens"].shape
  return jnp.float32(rows * (length - 1))


def _reference_model(model: nn.Module, objective: objective_base.Objective) -> nn.Module | None:
  """The model the objective's reference params are applied with (without LoRA), or None."""
  return models.build(lora.without_lora(model.config)) if objective.needs_reference else None


def make_eval_step(model: nn.Module, eos_id: int | None = None,
                   objective: objective_base.Objective = NEXT_TOKEN
                   ) -> Callable[[Any, Batch], Any]:
  """(params, batch) -> objective.eval_rows: per window, what the host averages over its eval
  set, leaving out the rows that only pad the last batch. The params are the model's whole
  (TrainState.model_params); with a reference model, (those, the reference's)."""
  reference_model = _reference_model(model, objective)

  def eval_step(params, batch: Batch):
    reference_losses = None
    if reference_model:
      params, reference_params = params
      reference_losses = _token_losses(reference_model, reference_params, batch["tokens"],
                                       eos_id, temperature=objective.logit_temperature)[0]
    losses = _token_losses(model, params, batch["tokens"], eos_id,
                           temperature=objective.logit_temperature)[0]
    return objective.eval_rows(losses, reference_losses, batch)
  return eval_step


@dataclasses.dataclass(frozen=True)
class ShardedSteps:
  """The train state's layout and the jitted functions that create and advance it."""
  abstract_state: TrainState  # ShapeDtypeStructs, each with its sharding.
  state_shardings: TrainState  # NamedShardings.
  batch_sharding: jax.sharding.NamedSharding
  seq_len: int  # Tokens per sequence of a batch.
  objective: objective_base.Objective  # What the batches hold, and the loss.
  init: Callable[[jax.Array], TrainState]
  train_step: Callable[[TrainState, Batch], tuple[TrainState, Metrics]]
  eval_step: Callable[[Any, Batch], jax.Array]
  # (model params, tokens) -> each target's log-probability at the objective's
  # logit_temperature, float32[rows, seq_len - 1]: the sampling policy's, for an objective that
  # trains on what it samples.
  log_probs: Callable[[Any, jax.Array], jax.Array]
  unmatched_params: frozenset[str]  # Those no partition rule matches.
  pipeline_schedule: pipeline.Schedule | None = None  # How the layers are pipelined, if at all.

  def abstract_inputs(self, batch_size: int) -> tuple[TrainState, Batch]:
    """train_step's arguments as ShapeDtypeStructs with their shardings, for global batches of
    `batch_size` sequences: what an ahead-of-time compile takes, allocating nothing."""
    entries = {"tokens": ((self.seq_len,), jnp.int32),
               **self.objective.batch_entries(self.seq_len)}
    return self.abstract_state, {
        name: jax.ShapeDtypeStruct((batch_size, *shape), dtype, sharding=self.batch_sharding)
        for name, (shape, dtype) in entries.items()}

  def eval_params(self, state: TrainState) -> Any:
    """What eval_step takes of the state: the model's params; with a reference model, and the
    reference's."""
    if self.objective.needs_reference:
      return state.model_params, state.reference_params
    return state.model_params

  def flops_per_token(self, cfg) -> float:
    """The model FLOPs of a trained token in this step (models.flops_per_token): LoRA's frozen
    base gets no weight gradient, and a reference model runs forward too."""
    state = self.abstract_state
    return models.flops_per_token(cfg, state.model_params, frozen=state.frozen,
                                  reference=self.objective.needs_reference)

  def int8_flops_per_token(self, cfg) -> float:
    """Of flops_per_token's, those int8 products carry (models.int8_flops_per_token)."""
    state = self.abstract_state
    return models.int8_flops_per_token(cfg, state.model_params, frozen=state.frozen,
                                       reference=self.objective.needs_reference)

  def layout_table(self) -> str:
    return partitioning.layout_table(self.abstract_state.model_params,
                                     self.state_shardings.model_params,
                                     self.abstract_state.opt_state, self.state_shardings.opt_state,
                                     self.unmatched_params)


# The steps of the last few builds: a process's runs of equal settings on an equal mesh (a
# notebook's lf.train again, a resume in the same process, a test suite's tiny runs) share
# their jitted steps, which then trace and compile nothing again.
_BUILT: "collections.OrderedDict[tuple, ShardedSteps]" = collections.OrderedDict()
_BUILDS_KEPT = 4


def build(run: "settings.RunConfig", partitioner: partitioning.Partitioner,
          eos_id: int | None = None,
          objective: objective_base.Objective = NEXT_TOKEN) -> ShardedSteps:
  """The run's init, train and eval steps, laid out with `partitioner` and jitted with
  explicit shardings; those of an earlier build of equal settings, where one is kept.

  Reads run.model, run.optimizer (its schedule over trainer.num_train_steps) and
  trainer.gradient_accumulation_steps. The partitioner is the caller's, made from the mesh
  and run.sharding: call (and trace) the functions inside its activation_context().

  eos_id: mask attention per document, each ending at this token (data.document_masking;
  see loss_and_parts); None: no mask. objective: what the run trains by (objectives.of_run):
  its batches' entries (abstract_inputs), its loss and eval, and whether the state keeps a
  reference model.

  model.compute.attention_impl 'auto' is resolved here for the mesh's devices, which need not
  be this host's (a TPU step compiled ahead of time on a CPU).
  """
  key = (run.model, run.optimizer, run.trainer, partitioner.config, partitioner.mesh, eos_id,
         objective)
  if key in _BUILT:
    _BUILT.move_to_end(key)
    return _BUILT[key]
  _BUILT[key] = _build(run, partitioner, eos_id, objective)
  while len(_BUILT) > _BUILDS_KEPT:
    _BUILT.popitem(last=False)
  return _BUILT[key]


def _build(run: "settings.RunConfig", partitioner: partitioning.Partitioner,
           eos_id: int | None, objective: objective_base.Objective) -> ShardedSteps:
  if moe.section_of(run.model) is not None:
    moe.check_expert_axis(run.model.moe, partitioner.logical_axis_size("experts"))
  pipeline_schedule = _pipeline_schedule(run, partitioner)
  pipelined = scheduled_by(pipeline_schedule, run.trainer.pipeline)
  platform = partitioner.mesh.devices.flat[0].platform
  attention = common.attention_implementation(run.model, platform)
  common.check_attention_platform(attention, platform)
  model = models.build(common.with_compute(run.model, attention_impl=attention))
  schedule = optimizers.learning_rate_schedule(run.optimizer, run.trainer.num_train_steps)
  optimizer = optimizers.make_optimizer(run.optimizer, schedule)
  if run.trainer.spike_policy != "none":
    optimizer = spikes.skip_spikes(optimizer, run.trainer.spike_window, run.trainer.spike_threshold)
  init = functools.partial(init_state, model, optimizer,
                           keep_reference=objective.needs_reference)
  with jax.sharding.use_abstract_mesh(partitioner.mesh.abstract_mesh):  # The mesh's platform.
    shapes = jax.eval_shape(init, jax.random.key(0))
  frozen_shardings = lambda tree: None if tree is None else partitioner.param_shardings(tree)
  shardings = TrainState(
      step=partitioner.replicated,
      params=partitioner.param_shardings(shapes.params),
      opt_state=partitioner.opt_state_shardings(optimizer, shapes.opt_state, shapes.params),
      frozen=frozen_shardings(shapes.frozen), reference=frozen_shardings(shapes.reference))
  batch = partitioner.batch_sharding()
  replicated = partitioner.replicated
  train_step = make_train_step(model, optimizer, schedule, run.trainer.gradient_accumulation_steps,
                               eos_id, run.trainer.seed, objective,
                               _cross_slice_batch_axis(run, partitioner, shardings.params))
  eval_params = shardings.model_params
  if objective.needs_reference:
    eval_params = (eval_params, shardings.reference_params)
  return ShardedSteps(
      abstract_state=jax.tree.map(
          lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings),
      state_shardings=shardings,
      batch_sharding=batch,
      seq_len=run.model.seq_len,
      objective=objective,
      # Without the reference: the caller copies it from whatever params the run starts on
      # (restore.py), so a start holds the params at most twice (policy and reference).
      init=jax.jit(lambda rng: init(rng).replace(reference=None),
                   out_shardings=shardings.replace(reference=None)),
      train_step=jax.jit(pipelined(train_step), in_shardings=(shardings, batch),
                         out_shardings=(shardings, replicated), donate_argnums=(0,)),
      eval_step=jax.jit(pipelined(make_eval_step(model, eos_id, objective)),
                        in_shardings=(eval_params, batch), out_shardings=replicated),
      log_probs=jax.jit(pipelined(lambda params, tokens: -_token_losses(
          model, params, tokens, eos_id, temperature=objective.logit_temperature)[0]),
                        in_shardings=(shardings.model_params, batch), out_shardings=batch),
      unmatched_params=frozenset(partitioner.unmatched(shapes.model_params)),
      pipeline_schedule=pipeline_schedule,
  )


def _pipeline_schedule(run, partitioner: partitioning.Partitioner) -> pipeline.Schedule | None:
  """The pipeline's schedule on the partitioner's mesh (None: no stage axis), checked."""
  family = models.family(run.model)
  schedule = pipeline.check(run.trainer.pipeline, partitioner.logical_axis_size(pipeline.LAYERS),
                            run.model, family.name, family.layer_stacks is not None)
  if schedule is None and run.trainer.pipeline != pipeline.PipelineConfig():
    logging.warning("trainer.pipeline is set, but trainer.device_mesh has no stage axis of more "
                    "than one device: the layers are not pipelined")
  return schedule


def scheduled_by(schedule: pipeline.Schedule | None, config: pipeline.PipelineConfig):
  """f -> f tracing its model pipelined by `config` (models/pipeline.py), where the mesh has
  stages; f itself where it has none."""
  if schedule is None:
    return lambda f: f

  def wrap(f):
    @functools.wraps(f)
    def traced_pipelined(*args):
      with pipeline.scheduled(config):
        return f(*args)
    return traced_pipelined
  return wrap


def _cross_slice_batch_axis(run, partitioner: partitioning.Partitioner,
                            param_shardings) -> tuple[str, int] | None:
  """(axis, size): the batch's mesh axis that spans TPU slices (trainer.dcn_mesh) and splits no
  parameter, over which accumulated gradients stay unreduced until the step's end; None on one
  slice, or where ZeRO-3 splits the parameters over it too (its accumulator would then be
  whole on every device)."""
  mesh = partitioner.mesh
  if len({getattr(d, "slice_index", 0) for d in mesh.devices.flat}) < 2:
    return None
  spans = dict(run.trainer.dcn_mesh)
  splits_parameters = {axis for sharding in jax.tree.leaves(param_shardings)
                       for entry in sharding.spec if entry
                       for axis in ((entry,) if isinstance(entry, str) else entry)}
  batch = partitioner.logical_axes["batch"]
  for axis in (batch,) if isinstance(batch, str) else tuple(batch or ()):
    if spans.get(axis, 1) != 1 and axis not in splits_parameters:  # -1: every slice.
      return axis, mesh.shape[axis]
  return None


def compile_in_background(steps: ShardedSteps, partitioner: partitioning.Partitioner,
                          batch_size: int) -> concurrent.futures.Future:
  """The train step compiled for global batches of `batch_size` sequences (on
  steps.abstract_inputs), in a thread.

  Compiling takes seconds on a CPU and minutes for a large model on a GPU;
  started once the layout is known, it overlaps creating or restoring the
  state and starting the input. The future holds the compiled step (called
  like train_step) or the error compiling raised.
  """
  def compile_step():
    with partitioner.activation_context():  # Its mesh and axis rules are per thread.
      return steps.train_step.lower(*steps.abstract_inputs(batch_size)).compile()
  executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile-train-step")
  try:
    return executor.submit(compile_step)
  finally:
    executor.shutdown(wait=False)
