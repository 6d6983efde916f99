"""lm-eval-harness on our model: `LevanterLM`, an `lm_eval` LM, and the tasks it runs.

LevanterLM answers lm-eval's three request kinds on the mesh:
  - loglikelihood: TemplateLM splits each (context, continuation) into tokens as lm-eval's
    Hugging Face backend (HFLM) does (the pair encoded whole, split at the context's length;
    an empty context becomes HFLM's prefix token, LevanterLM.prefix_token_id), and each pair
    is scored as HFLM scores it (left-truncated to seq_len + 1 tokens), so the numbers are
    HFLM's on the same weights;
  - loglikelihood_rolling: a text's disjoint seq_len windows (lm-eval's
    get_rolling_token_windows), scored as above and summed;
  - generate_until: on the generation engine (generate/engine.py), whose slots are the batch
    size's rows; a request ends at an EOS (the corpus's, the tokenizer config's), a stop
    string, or max_gen_toks, and its text is cut at the first stop string, as HFLM cuts it.
Scored rows are sorted by length and run in batches of a fixed number of rows (a multiple of
the mesh's data-parallel size), each padded to a power-of-two length: a few compiled shapes,
not one per request.

Tasks are lm-eval's built-in names or those of a directory of task YAMLs (`include_path`);
`load_tasks` checks them all, data included, before anything runs. lm_eval is imported here
only: loop.py imports this module when the in-run harness is on.
"""
import contextlib
import dataclasses
import functools
import json
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from lm_eval.api.model import TemplateLM
from lm_eval.models import utils as lm_utils
from lm_eval import utils as lm_eval_utils

from levanter_flax.generate.engine import Engine, SamplingParams
from levanter_flax import models
from levanter_flax.core import progress
from levanter_flax.core.errors import UserError
from levanter_flax.models import common

# Shortest padded length: below it, more shapes would cost more compiles than the padding.
_MIN_LENGTH = 16
# lm-eval's own default for a task that sets no max_gen_toks (HFLM's too).
DEFAULT_MAX_GEN_TOKS = 256


def padded_length(length: int, cap: int) -> int:
  """The compiled length for `length` tokens: the next power of two (at least _MIN_LENGTH), at
  most `cap`."""
  return min(cap, max(_MIN_LENGTH, 1 << max(length - 1, 0).bit_length()))


def data_parallel_size(batch_sharding: jax.sharding.NamedSharding) -> int:
  """How many ways the batch sharding splits the rows."""
  axes = batch_sharding.spec[0] if batch_sharding.spec else None
  axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
  return math.prod(batch_sharding.mesh.shape[axis] for axis in axes)


@dataclasses.dataclass(frozen=True)
class Scored:
  """One loglikelihood request as the model sees it: inputs, their next tokens, and how many of
  the last targets are the continuation's."""
  inputs: list[int]
  targets: list[int]
  span: int


def scored(context: Sequence[int], continuation: Sequence[int], seq_len: int) -> Scored:
  """HFLM's scoring of a pair: context + continuation cut to its last seq_len + 1 tokens; the
  model reads all but the last and predicts all but the first."""
  whole = (list(context) + list(continuation))[-(seq_len + 1):]
  return Scored(whole[:-1], whole[1:], min(len(continuation), len(whole) - 1))


def _token_scores(model, params, inputs, targets):
  """(log-probability of each target [batch, length], whether it is the argmax), float32."""
  logits = model.apply({"params": params}, inputs).astype(jnp.float32)
  logprobs = jax.nn.log_softmax(logits, axis=-1)
  chosen = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
  return chosen, jnp.argmax(logits, axis=-1) == targets


class LevanterLM(TemplateLM):
  """Our model as an lm_eval LM (see the module's docstring).

  params may be host arrays or already on the mesh (the training state's): they are placed
  with `param_shardings`, a no-op for the latter; None: use_params gives them later. Batches are sharded with `batch_sharding`.
  Call it inside the partitioner's activation_context, as the train and eval steps are.
  """

  def __init__(self, model_cfg: Any, params: Any, tokenizer, *, param_shardings: Any,
               batch_sharding: jax.sharding.NamedSharding, batch_size: int,
               max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, seed: int = 0):
    super().__init__()
    if tokenizer.vocab_size > model_cfg.vocab_size:
      raise UserError(f"the tokenizer's {tokenizer.vocab_size} tokens exceed the model's "
                      f"vocab_size {model_cfg.vocab_size}")
    # XLA's attention takes any padded length; splash needs multiples of its blocks.
    self._model_cfg = common.with_compute(model_cfg, attention_impl="xla")
    self._tokenizer = tokenizer
    self._param_shardings, self._batch_sharding = param_shardings, batch_sharding
    self._params = None if params is None else jax.device_put(params, param_shardings)
    self._parallel = data_parallel_size(batch_sharding)
    self._max_rows = -(-batch_size // self._parallel) * self._parallel
    self.max_gen_toks, self._seed = max_gen_toks, seed
    self._score = jax.jit(functools.partial(_token_scores, models.build(self._model_cfg)),
                          in_shardings=(param_shardings, batch_sharding, batch_sharding),
                          out_shardings=(batch_sharding, batch_sharding))
    self._engine = None  # Built at the first generation.

  def use_params(self, params: Any) -> None:
    """Scores and generates with `params` from now on (the training state's, at each harness
    run): the same shapes, so nothing compiles again."""
    self._params = jax.device_put(params, self._param_shardings)
    if self._engine is not None:
      self._engine.use_params(self._params)

  # What TemplateLM and lm-eval's tasks ask of a tokenizer-backed LM, as HFLM answers it from
  # the tokenizer_config.json's tokens; without one, the corpus EOS, which began every document.
  @property
  def eot_token_id(self) -> int:
    """The token a generation ends at: the config's eos_token."""
    return self._eot[0]

  @property
  def prefix_token_id(self) -> int:
    """What rolling windows and empty contexts follow: the config's bos_token, else eos_token."""
    return self._prefix[0]

  @property
  def _prefix(self) -> tuple[int, str]:
    return self._tokenizer.special_tokens.get("bos_token", self._eot)

  @property
  def _eot(self) -> tuple[int, str]:
    return self._tokenizer.special_tokens.get("eos_token",
                                              (self._tokenizer.eos_id, self._tokenizer.eos_text))

  @property
  def max_length(self) -> int:
    return self._model_cfg.seq_len

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    """As HFLM encodes: with the special tokens the tokenizer file puts around a text (Llama
    3's BOS), unless told not to or the text begins with the prefix token's own text."""
    del kwargs
    if add_special_tokens is None:
      add_special_tokens = not string.startswith(self._prefix[1])
    return self._tokenizer.encode(string, add_special_tokens=add_special_tokens).tolist()

  def tok_decode(self, tokens: Sequence[int]) -> str:
    return self._tokenizer.decode(tokens)

  # Log-likelihoods.
  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                            ) -> list[tuple[float, bool]]:
    del disable_tqdm, kwargs
    rows = [scored(context, continuation, self.max_length)
            for _, context, continuation in requests]
    answers = self._score_rows(rows)
    for (request, _, _), answer in zip(requests, answers):
      if request[0] is not None:  # Rolling windows have no string pair to cache.
        self.cache_hook.add_partial("loglikelihood", request, answer)
    return answers

  def _score_rows(self, rows: list[Scored]) -> list[tuple[float, bool]]:
    answers = [None] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i].inputs))
    batch_rows = self._batch_rows(len(order))
    for start in self._batch_starts(len(order), batch_rows, "harness: log-likelihoods"):
      batch = order[start:start + batch_rows]
      length = padded_length(len(rows[batch[0]].inputs), self.max_length)
      inputs = np.zeros((batch_rows, length), np.int32)
      targets = np.zeros((batch_rows, length), np.int32)
      for slot, i in enumerate(batch):
        inputs[slot, :len(rows[i].inputs)] = rows[i].inputs
        targets[slot, :len(rows[i].targets)] = rows[i].targets
      logprobs, greedy = jax.device_get(self._score(self._params, inputs, targets))
      for slot, i in enumerate(batch):
        end = len(rows[i].inputs)
        span = slice(end - rows[i].span, end)
        answers[i] = (float(logprobs[slot, span].sum()), bool(greedy[slot, span].all()))
    return answers

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """Each text's log-likelihood over its disjoint seq_len windows, as HFLM computes it."""
    windows, owners = [], []
    for index, (text,) in enumerate(request.args for request in requests):
      for context, continuation in map(lm_eval_utils.make_disjoint_window,
                                       lm_eval_utils.get_rolling_token_windows(
                                           token_list=self.tok_encode(text),
                                           prefix_token=self.prefix_token_id,
                                           max_seq_len=self.max_length, context_len=1)):
        windows.append(((None, None), context, continuation))
        owners.append(index)
    totals = [0.0] * len(requests)
    for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
      totals[owner] += logprob
    for request, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
    return totals

  # Generation.
  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Each request's continuation, grouped by its generation kwargs, cut at the first of its
    stop strings (`until`, and the EOS's text)."""
    del disable_tqdm
    groups = {}
    for index, request in enumerate(requests):
      groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
    texts = [None] * len(requests)
    for indices in groups.values():
      gen_kwargs = requests[indices[0]].args[1]
      kwargs = lm_utils.normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
      until = lm_utils.handle_stop_sequences(kwargs.pop("until", None), eos=self._eot[1])
      sampling = self._sampling(kwargs, until)
      contexts = [self.tok_encode(requests[i].args[0]) for i in indices]
      for index, text in zip(indices, self._generate(contexts, sampling)):
        texts[index] = lm_utils.postprocess_generated_text(text, until, None)
        self.cache_hook.add_partial("generate_until", requests[index].args, texts[index])
    return texts

  def _sampling(self, kwargs: dict, until: list[str]) -> SamplingParams:
    """lm-eval's normalized generation kwargs as our sampling settings."""
    max_gen = kwargs.pop("max_gen_toks")
    if not 0 < max_gen < self.max_length:
      raise UserError(f"a task's max_gen_toks {max_gen} leaves no room for a context in the "
                      f"model's seq_len {self.max_length}")
    known = {"do_sample", "temperature", "top_k", "top_p"}
    if set(kwargs) - known:
      logging.warning("Generation kwargs %s are not supported; ignored", sorted(set(kwargs) - known))
    temperature = float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0
    return SamplingParams(
        max_tokens=max_gen, temperature=temperature, top_k=int(kwargs.get("top_k") or 0),
        top_p=float(kwargs.get("top_p") or 1.0), seed=self._seed,
        stop=tuple(s for s in until if s and s != self._eot[1]),  # The EOT stops by its id.
        stop_ids=tuple(sorted({*self._tokenizer.stop_ids, self.eot_token_id})))

  def _generate(self, contexts: list[list[int]], sampling: SamplingParams) -> list[str]:
    """Each context's text, cut at its first stop string; request i samples with seed
    sampling.seed + i."""
    room = self.max_length - sampling.max_tokens
    engine = self._generation_engine()
    # Left-truncated as HFLM truncates; an empty context starts a document.
    prompts = [(context or [self.prefix_token_id])[-room:] for context in contexts]
    requests = engine.submit_all(prompts, sampling.apart(len(prompts)))
    try:
      for request in progress.iterate(requests, "harness: generation", total=len(requests),
                                      unit="requests"):
        while not request.finished:
          engine.step()
    finally:  # Training, between harness runs, needs the cache's memory; a failure, a clean slate.
      engine.reset()
    return [request.text for request in requests]

  def _generation_engine(self) -> Engine:
    """Slots as many as a batch's rows, on the mesh of the params and batches."""
    if self._engine is None:
      self._engine = Engine(self._model_cfg, self._params, slots=self._max_rows,
                            tokenizer=self._tokenizer, param_shardings=self._param_shardings,
                            batch_sharding=self._batch_sharding)
    return self._engine

  def _batch_rows(self, count: int) -> int:
    """Rows per batch for `count` requests: the batch size, or as few as hold them all (a
    multiple of the data-parallel size), so a batch size above the requests pads no rows."""
    return min(self._max_rows, -(-count // self._parallel) * self._parallel)

  def _batch_starts(self, count: int, batch_rows: int, what: str):
    """The first request of each batch of `count`, shown as progress in batches."""
    return progress.iterate(range(0, count, batch_rows), what, total=-(-count // batch_rows),
                            unit="batches")


# The tasks.
def task_names(spec: str, what: str) -> list[str]:
  """Comma-separated task names, each once, in order."""
  names = list(dict.fromkeys(name.strip() for name in spec.split(",") if name.strip()))
  if not names:
    raise UserError(f"{what} names no lm-eval task; give one or more, comma-separated")
  return names


def load_tasks(names: Sequence[str], include_path: str = ""):
  """A TaskManager that knows every task of `names`, each of which was loaded once, data
  included: an unknown name, or a task whose data cannot be read (offline: not in the hub
  cache; a data file gone), is one line naming it, before any model runs.

  Only the directory's tasks are indexed when it holds them all: indexing lm-eval's thousands
  of built-in ones takes seconds.
  """
  with _their_bars_on_a_terminal_only():
    return _load_tasks(names, include_path)


def _load_tasks(names: Sequence[str], include_path: str):
  from lm_eval.tasks import TaskManager  # pylint: disable=g-import-not-at-top  # Loads lm_eval's registry.
  manager = None
  if include_path:
    manager = TaskManager(include_path=include_path, include_defaults=False)
    if not all(name in manager.all_tasks for name in names):
      manager = None
  manager = manager or TaskManager(include_path=include_path or None)
  for name in names:
    if name not in manager.all_tasks:
      where = f"built in or in {include_path}" if include_path else "built in"
      raise UserError(f"unknown lm-eval task {name!r}: no task, group or tag of that name is "
                      f"{where}")
    try:
      manager.load([name])
    except OSError as e:  # Offline and not cached (ConnectionError), a data file gone.
      raise UserError(f"lm-eval task {name!r} cannot load its data: {_first_line(e)} (tasks run "
                      f"offline on data already on disk: a hub cache's dataset, or local "
                      f"files)") from None
    except Exception as e:  # pylint: disable=broad-except  # A bad YAML: lm-eval raises many kinds.
      raise UserError(f"lm-eval task {name!r} cannot be loaded: {type(e).__name__}: "
                      f"{_first_line(e)}") from None
  return manager


def _first_line(error: Exception) -> str:
  text = str(error).strip()
  return text.splitlines()[0] if text else type(error).__name__


def evaluate(lm: LevanterLM, names: Sequence[str], manager, *, limit: int | float | None = None,
             num_fewshot: int | None = None) -> dict:
  """lm-eval's simple_evaluate of `names` on our LM: its results dict. `limit`: documents per
  task, or below 1 a fraction of them."""
  from lm_eval import evaluator  # pylint: disable=g-import-not-at-top
  with _their_bars_on_a_terminal_only():
    return evaluator.simple_evaluate(model=lm, tasks=list(names), task_manager=manager,
                                     limit=limit, num_fewshot=num_fewshot, log_samples=False)


@contextlib.contextmanager
def _their_bars_on_a_terminal_only():
  """lm-eval's and datasets' own tqdm bars, off unless on a terminal: in a log file they are
  carriage-return noise, and progress.py writes lines there instead. lm-eval builds each
  task's requests, and tokenizes them, under bars it never lets a caller turn off, so its
  modules' tqdm is swapped."""
  if progress.on_terminal():
    yield
    return
  import datasets  # pylint: disable=g-import-not-at-top
  from lm_eval.api import model as lm_eval_model, task as lm_eval_task  # pylint: disable=g-import-not-at-top
  modules = (lm_eval_model, lm_eval_task)
  bars, were_disabled = [m.tqdm for m in modules], datasets.are_progress_bars_disabled()
  for module, bar in zip(modules, bars):
    module.tqdm = functools.partial(_disabled, bar)
  datasets.disable_progress_bars()
  try:
    yield
  finally:
    for module, bar in zip(modules, bars):
      module.tqdm = bar
    if not were_disabled:
      datasets.enable_progress_bars()


def _disabled(bar, *args, **kwargs):
  return bar(*args, **(kwargs | {"disable": True}))  # Over a caller's disable=False too.


def scalar_metrics(results: dict, prefix: str = "harness") -> dict[str, float]:
  """`<prefix>/<task>/<metric>` for each numeric result; a metric under a filter other than
  lm-eval's "none" is `<metric>/<filter>` (exact_match/strict-match)."""
  scalars = {}
  for task, values in results.get("results", {}).items():
    for key, value in values.items():
      if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
        continue  # alias, sample counts, "N/A" stderrs
      metric, filter_name = key.split(",", 1)
      name = metric if filter_name == "none" else f"{metric}/{filter_name}"
      scalars[f"{prefix}/{task}/{name}"] = float(value)
  return scalars


def table(results: dict) -> str:
  """lm-eval's own results table (and its groups', if any)."""
  from lm_eval.utils import make_table  # pylint: disable=g-import-not-at-top
  text = make_table(results)
  if results.get("groups"):
    text += "\n" + make_table(results, "groups")
  return text


class InRun:
  """The harness inside training (config.trainer.eval_harness_*): its tasks loaded when the run
  starts, then run on the current params at each harness step."""

  def __init__(self, run, tokenizer, param_shardings: Any,
               batch_sharding: jax.sharding.NamedSharding):
    trainer = run.trainer
    if jax.process_count() > 1:
      raise UserError("config.trainer.eval_harness_every_steps: the in-run harness runs on one "
                      "process; evaluate the checkpoints with levanter-flax evaluate")
    self._names = task_names(trainer.eval_harness_tasks, "config.trainer.eval_harness_tasks")
    self._manager = load_tasks(self._names, trainer.eval_harness_include_path)
    self._limit = trainer.eval_harness_limit or None
    # Microbatch-sized, as the eval: what fits in memory for training fits here.
    batch_size = trainer.batch_size // trainer.gradient_accumulation_steps
    self._lm = LevanterLM(run.model, None, tokenizer, param_shardings=param_shardings,
                          batch_sharding=batch_sharding, batch_size=batch_size, seed=trainer.seed)

  def __call__(self, params: Any) -> dict[str, float]:
    """harness/<task>/<metric> of `params` (the model's, as the eval step takes them)."""
    self._lm.use_params(params)
    return scalar_metrics(evaluate(self._lm, self._names, self._manager, limit=self._limit))
