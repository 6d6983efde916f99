"""The generation engine: continuous batching over a fixed number of slots, each with its own
position in one KV cache. `sample`, the lm-eval harness and the OpenAI server all generate
through it.

The cache is per slot, not paged: a row per slot, written at each slot's own index
(models/attention.append_to_cache; a sliding-window layer's rows are a ring of its window). A
request takes a free slot, its prompt is prefilled in chunks of `prefill_chunk` tokens
(waiting requests prefilled together, as a group of rows of the cache), then each step decodes
one token for every decoding slot; a request that stops frees its slot for the next at once.
While no prompt prefills, a step dispatches `decode_steps` decode steps back to back, each
taking its inputs (the tokens drawn, the positions, the draws' counts) from the one before on
the device, and the host reads their tokens once: a v5e chip spent 1.7 to 2.3 ms a step on
the host's side (sending the inputs, reading the tokens, the requests' bookkeeping), as much
as the device's work. A request that stops within them frees its slot at their end; the steps
it took past its stop are discarded.

The rows are as long as the longest live request needs, rounded up to a power of two (at
least 64, at most max_len): the cache grows (or shrinks) by one copy when that bucket changes,
and every step attends to whole rows. Cutting a max_len cache to a bucket at each step
instead would copy the bucket in every layer at every step (on the CPU, a 100M model's
16-slot step took 2.5 times as long). Paging would let short requests lend their rows to long
ones; whole rows keep a few shapes, compiled once each, and memory at most slots x max_len
(and one layer's entry more while the rows change).

Sampling is per request: temperature (0: greedy), top-k, top-p, a seed, stop token ids, stop
strings (on the text, with the engine's tokenizer), max_tokens, OpenAI's logit bias and
presence and frequency penalties, and the log-probability of each chosen token under the
model's own distribution (before the bias, penalties, temperature and filters, as vLLM's). A
request's n-th token is drawn with fold_in(key(seed), n), so it is the same alone or among
others, in any slot. Beside the cache, each slot keeps its logit bias and penalties, set at
its request's first prefill chunk, and (while a request's penalties need them) its
completion's tokens so far: the decode step takes no more per request than its settings, and
a step with no biased or penalized row draws as if there were none.

On a mesh (`param_shardings` and `batch_sharding`, inside the partitioner's
activation_context), the params keep their layout (tensor-parallel where the rules split
them) and the cache is split as the model's activations are: slots over the batch axes, key
and value heads over the heads' axes.

It imports models and core only; the tokenizer is any object with decode(ids) -> str.
"""
import dataclasses
import functools
import threading
from typing import Any, Callable, Sequence

from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from levanter_flax import models
from levanter_flax.core.errors import UserError
from levanter_flax.parallel import partitioning

# The shortest rows: below it, more buckets would cost more compiles than they save.
_MIN_BUCKET = 64
# The most tokens one request may bias: each prefill carries this many (token, bias) pairs per
# row, a fixed shape compiled once.
MAX_LOGIT_BIAS = 300


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request samples."""
  max_tokens: int = 64
  temperature: float = 1.0  # 0: greedy.
  top_k: int = 0  # 0: no limit.
  top_p: float = 1.0  # 1: no limit.
  seed: int = 0
  stop: tuple[str, ...] = ()  # The text ends before the first of these (needs a tokenizer).
  stop_ids: tuple[int, ...] = ()  # The completion ends before the first of these tokens.
  # OpenAI's: subtracted from a token's logit once it is in the completion, and once for each
  # time it is.
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit) pairs.

  def apart(self, count: int) -> list["SamplingParams"]:
    """These settings for `count` requests, request i with seed + i: equal prompts sample
    apart."""
    return [dataclasses.replace(self, seed=(self.seed + i) % 2**32) for i in range(count)]

  def check(self, vocab_size: int, prefix: str = "") -> None:
    """One line naming the setting (with `prefix`, e.g. "--" for flags) for a bad value."""
    if self.max_tokens <= 0:
      raise UserError(f"{prefix}max_tokens must be positive; got {self.max_tokens}")
    if not 0 <= self.temperature < float("inf"):  # NaN fails it too.
      raise UserError(f"{prefix}temperature must be >= 0 and finite; got {self.temperature}")
    if not 0 <= self.top_p <= 1:
      raise UserError(f"{prefix}top_p must be in [0, 1]; got {self.top_p}")
    if self.top_k < 0:
      raise UserError(f"{prefix}top_k must be >= 0 (0: no limit); got {self.top_k}")
    if self.top_k > vocab_size:  # lax.top_k cannot take more tokens than there are.
      raise UserError(f"{prefix}top_k {self.top_k} exceeds the model's vocabulary of "
                      f"{vocab_size} tokens; use at most {vocab_size}, or 0 for no limit")
    if not 0 <= self.seed < 2**32:
      raise UserError(f"{prefix}seed must be in [0, 2**32); got {self.seed}")
    for name in ("presence_penalty", "frequency_penalty"):
      if not -2 <= getattr(self, name) <= 2:  # OpenAI's range; NaN fails it too.
        raise UserError(f"{prefix}{name} must be in [-2, 2]; got {getattr(self, name)}")
    if len(self.logit_bias) > MAX_LOGIT_BIAS:
      raise UserError(f"{prefix}logit_bias holds {len(self.logit_bias)} tokens; at most "
                      f"{MAX_LOGIT_BIAS} may be biased")
    for token, bias in self.logit_bias:
      if not 0 <= token < vocab_size:
        raise UserError(f"{prefix}logit_bias names token {token}, outside the model's "
                        f"vocabulary [0, {vocab_size})")
      if not -100 <= bias <= 100:
        raise UserError(f"{prefix}logit_bias of token {token} must be in [-100, 100]; got {bias}")


@dataclasses.dataclass(eq=False)
class Request:
  """A prompt and how it samples; the engine fills in the rest as it generates. `listener`
  (if any) is called from the engine's thread after each change."""
  prompt: list[int]
  sampling: SamplingParams
  listener: Callable[["Request"], None] | None = None
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  text: str = ""  # With a tokenizer: the completion's text, cut at a stop string.
  finish_reason: str | None = None  # "stop", "length", "cancelled" or "error" once finished.
  stop_id: int | None = None  # The stop id that ended it (not in tokens), if one did.
  cancelled: bool = False
  _done: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)
  _slot: int = -1
  _prefilled: int = 0

  @property
  def finished(self) -> bool:
    return self.finish_reason is not None

  def wait(self, timeout: float | None = None) -> bool:
    return self._done.wait(timeout)


def sample_tokens(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  keys: jax.Array, drawn_from: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array]:
  """(next token [rows], its log-probability under the model's logits [rows]) from
  last-position logits [rows, vocab], each row with its own settings and key; the token is
  drawn from `drawn_from` (penalized's) where given. Top-k applies first, then top-p to what
  it kept; the sort they need runs only when a row asks for one, and the draw only when a row
  samples."""
  logits = logits.astype(jnp.float32)
  drawn_from = logits if drawn_from is None else drawn_from.astype(jnp.float32)
  vocab = logits.shape[-1]
  greedy = temperature == 0
  scaled = drawn_from / jnp.where(greedy, 1.0, temperature)[:, None]

  def filtered(scaled):
    ordered = -jnp.sort(-scaled, axis=-1)
    kth = jnp.take_along_axis(ordered, (jnp.where(top_k > 0, top_k, vocab) - 1)[:, None], -1)
    ordered = jnp.where(ordered < kth, -jnp.inf, ordered)
    cumulative = jnp.cumsum(jax.nn.softmax(ordered, axis=-1), axis=-1)
    # The smallest set whose probability reaches top_p: keep tokens at least as likely as its last.
    last = jnp.minimum(jnp.sum(cumulative < top_p[:, None], axis=-1, keepdims=True), vocab - 1)
    # A row without top-p keeps every token top-k kept, whatever float32's cumulative sum says.
    last = jnp.where(top_p[:, None] >= 1, vocab - 1, last)
    threshold = jnp.maximum(kth, jnp.take_along_axis(ordered, last, axis=-1))
    return jnp.where(scaled < threshold, -jnp.inf, scaled)

  def drawn(scaled):
    scaled = jax.lax.cond(jnp.any(~greedy & ((top_k > 0) | (top_p < 1))), filtered,
                          lambda x: x, scaled)
    return jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)

  best = jnp.argmax(drawn_from, axis=-1).astype(jnp.int32)
  # A batch of greedy rows (evaluation, most benchmarks) draws no noise.
  tokens = jnp.where(greedy, best, jax.lax.cond(jnp.all(greedy), lambda _: best, drawn, scaled))
  logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], -1)[:, 0]
  return tokens, logprobs


def penalized(logits: jax.Array, completions: jax.Array, drawn: jax.Array, presence: jax.Array,
              frequency: jax.Array, bias_ids: jax.Array, bias: jax.Array) -> jax.Array:
  """OpenAI's adjusted logits [rows, vocab]: each row's bias (bias_ids [rows, k], bias [rows,
  k]; padded with zeros) added, and for each token of its completion so far (the first
  `drawn` of completions [rows, n]) the presence penalty once and the frequency penalty per
  time subtracted."""
  rows = jnp.arange(logits.shape[0])[:, None]
  held = jnp.arange(completions.shape[1]) < drawn[:, None]
  counts = jnp.zeros(logits.shape, jnp.float32).at[rows, completions].add(held)
  biased = logits.astype(jnp.float32).at[rows, bias_ids].add(bias)
  return biased - presence[:, None] * (counts > 0) - frequency[:, None] * counts


def _keys(seeds: jax.Array, counts: jax.Array) -> jax.Array:
  """A request's key for its counts-th token: fold_in(key(seed), count)."""
  return jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seeds, counts)


class Engine:
  """Generates for many requests at once (see the module's docstring).

  slots: how many requests decode together; max_len: the cache's length per slot, prompt and
  completion together (default and most: the model's seq_len); prefill_chunk: prompt tokens a
  slot prefills per step; decode_steps: decode steps dispatched before the host reads their
  tokens, while no prompt prefills. tokenizer: decodes completions for stop strings and `text`.
  """

  def __init__(self, model_cfg: Any, params: Any, *, slots: int = 8, max_len: int | None = None,
               prefill_chunk: int = 128, decode_steps: int = 8, tokenizer=None,
               param_shardings: Any = None, batch_sharding: NamedSharding | None = None):
    max_len = max_len or model_cfg.seq_len
    if not 0 < max_len <= model_cfg.seq_len:
      raise UserError(f"the engine's max_len {max_len} must be in [1, the model's seq_len "
                      f"{model_cfg.seq_len}]")
    if slots <= 0 or prefill_chunk <= 0 or decode_steps <= 0:
      raise UserError(f"the engine needs slots, prefill_chunk and decode_steps > 0; got {slots}, "
                      f"{prefill_chunk}, {decode_steps}")
    self.model_cfg, self.slots, self.max_len = model_cfg, slots, max_len
    self.prefill_chunk = min(prefill_chunk, max_len)
    self.decode_steps = decode_steps
    self.tokenizer = tokenizer
    self._model = models.build(model_cfg, decode=True)
    self._param_shardings = param_shardings
    self._batch_sharding = batch_sharding
    self.params = None
    if params is not None:
      self.use_params(params)
    self._batch_axes = _axes(self._model, lambda n: (n, max_len))
    self._length_axes = _axes(self._model, lambda n: (2, n))
    self._abstract_caches = {}  # Rows' length -> _abstract_cache's.
    # A prefill's rows split over the batch's axes as its activations do.
    self._min_rows = 1 if batch_sharding is None else partitioning.axes_size(
        batch_sharding.mesh, batch_sharding.spec[0] if batch_sharding.spec else None)
    self._cache_shardings = self._shardings_of_cache()
    self._cache = None  # [slots, self._length] rows, allocated at the first step; reset drops it.
    self._sampled = None  # Each slot's bias, penalties and completion (_abstract_sampled's).
    self._length = 0
    self._waiting: list[Request] = []
    self._running: list[Request | None] = [None] * slots
    self._lock = threading.Condition()
    self._prefill = {}  # (rows, cache length) -> jitted prefill.
    self._decode = {}  # cache length -> jitted decode.
    self._samplers = {}  # rows (None: decode's) -> the jitted sampler of their steps.

  # The public interface.
  def cache_bytes_per_device(self) -> int:
    """What the KV cache holds on each device at its longest (rows of max_len): the memory a
    generation adds to what is in use, besides its step's own temporaries."""
    abstract = self._abstract_cache(self.max_len)
    sampled = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self._abstract_sampled()))
    if self._cache_shardings is None:
      return sampled + sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
    return sampled + partitioning.per_device_bytes(abstract, self._cache_shardings)

  def use_params(self, params: Any) -> None:
    """Generates with `params` from now on (the same shapes: nothing compiles again); None lets
    the engine's go."""
    self.params = (params if self._param_shardings is None or params is None
                   else jax.device_put(params, self._param_shardings))

  def submit(self, prompt: Sequence[int], sampling: SamplingParams,
             listener: Callable[[Request], None] | None = None) -> Request:
    """Queues a request; it runs once a slot is free (step or serve_forever)."""
    self.check(prompt, sampling)
    request = Request(list(prompt), sampling, listener)
    with self._lock:
      self._waiting.append(request)
      self._lock.notify_all()
    return request

  def check(self, prompt: Sequence[int], sampling: SamplingParams) -> None:
    """What submit refuses, in one line: an empty prompt, one that fills the context, bad
    sampling settings."""
    if not prompt:
      raise UserError("a prompt is empty: there is nothing to continue")
    if len(prompt) >= self.max_len:
      raise UserError(f"a prompt of {len(prompt)} tokens leaves no room to generate in the "
                      f"context of {self.max_len} tokens")
    if sampling.stop and self.tokenizer is None:
      raise UserError("stop strings need the engine's tokenizer")
    sampling.check(self.model_cfg.vocab_size)

  def cancel(self, request: Request) -> None:
    """Ends `request` at the next step (finish_reason "cancelled"), freeing its slot."""
    request.cancelled = True
    with self._lock:
      self._lock.notify_all()

  def submit_all(self, prompts: Sequence[Sequence[int]], samplings: Sequence[SamplingParams],
                 listener: Callable[[Request], None] | None = None) -> list[Request]:
    """Queues every prompt, or none: all are checked first."""
    for prompt, sampling in zip(prompts, samplings, strict=True):
      self.check(prompt, sampling)
    return [self.submit(p, s, listener) for p, s in zip(prompts, samplings)]

  def generate(self, prompts: Sequence[Sequence[int]],
               sampling: SamplingParams | Sequence[SamplingParams]) -> list[Request]:
    """Each prompt's finished request, stepping in this thread until all are done."""
    requests = self.submit_all(prompts, [sampling] * len(prompts)
                               if isinstance(sampling, SamplingParams) else sampling)
    try:
      while not all(r.finished for r in requests):
        self.step()
    except BaseException:
      self.reset()
      raise
    return requests

  def load(self) -> dict[str, int]:
    """{"slots", "running" (requests in slots), "waiting" (for one)}."""
    with self._lock:
      return {"slots": self.slots, "running": sum(r is not None for r in self._running),
              "waiting": len(self._waiting)}

  @property
  def busy(self) -> bool:
    return bool(self._waiting) or any(r is not None for r in self._running)

  def serve_forever(self, stopped: threading.Event) -> None:
    """Steps while there is work, waits while there is none; returns once `stopped` is set and
    every request has finished (a server's thread)."""
    while True:
      with self._lock:
        while not self.busy and not stopped.is_set():
          self._lock.wait(0.5)
        if not self.busy and stopped.is_set():
          return
      try:
        self.step()
      except Exception:  # pylint: disable=broad-except  # Its requests fail; the next may not.
        logging.exception("A generation step failed; its requests end with finish_reason "
                          "'error'")
        self.reset("error")

  def warm_up(self) -> int:
    """Compiles every step shape now (each prefill's rows and cache length, each decode's
    cache length), by steps that write nothing, rather than at a request's first need of it:
    a server's times to first token then hold from its first request. Returns how many."""
    with self._lock:
      assert not self.busy, "warm_up with requests held"
      lengths = sorted({_bucket(n, self.max_len, _MIN_BUCKET) for n in range(1, self.max_len + 1)})
      rows = sorted({_bucket(n, self.slots, self._min_rows) for n in range(1, self.slots + 1)})
      none = [None] * self.slots
      for length in lengths:
        self._resize_to(length)
        for count in rows:
          fn = self._prefill.get((count, length)) or self._compile(count, length)
          self._cache, self._sampled, *_ = fn(
              self.params, self._cache, self._sampled, np.arange(count, dtype=np.int32),
              np.zeros((count, self.prefill_chunk), np.int32), np.zeros(count, np.int32),
              np.zeros(count, np.int32), self._settings(none[:count]),
              _adjustments(none[:count]))
        fn = self._decode.get(length) or self._compile(None, length)
        zeros = np.zeros(self.slots, np.int32)
        following = (zeros[:, None], zeros, zeros, self._settings(none))
        for _ in range(2):  # From the host's inputs, then from the step before's on the device.
          self._cache, self._sampled, _, _, following = fn(
              self.params, self._cache, self._sampled, np.arange(self.slots, dtype=np.int32),
              *following, ())
      for length in lengths:  # Every resize between them, from the longest rows now.
        for other in [n for n in lengths if n != length]:
          self._resize_to(other)
          self._resize_to(length)
      jax.block_until_ready(self._cache)
      return len(lengths) * (len(rows) + 1)

  def _compiled(self) -> set:
    """The step shapes compiled so far."""
    return {*self._prefill, *(("decode", n) for n in self._decode)}

  def reset(self, reason: str = "cancelled") -> None:
    """Ends every request it holds (finish_reason `reason`) and drops the KV cache until the
    next step allocates it again: the in-run harness gives training its memory back after each
    run, and a failed step (whose cache was donated) leaves nothing behind."""
    with self._lock:
      for request in [*self._running, *self._waiting]:
        if request is not None and not request.finished:
          self._finish(request, reason)
      self._running = [None] * self.slots
      self._waiting.clear()
      self._cache, self._sampled, self._length = None, None, 0

  def wake(self) -> None:
    with self._lock:
      self._lock.notify_all()

  def step(self) -> None:
    """Admits waiting requests to free slots, prefills one chunk of the prefilling ones, and
    decodes one token for the decoding ones (decode_steps tokens while none prefills)."""
    with self._lock:
      for request in [*self._running, *self._waiting]:
        if request is not None and request.cancelled and not request.finished:
          self._finish(request, "cancelled")
      self._waiting = [r for r in self._waiting if not r.finished]
      while self._waiting and None in self._running:
        request = self._waiting.pop(0)
        request._slot = self._running.index(None)
        self._running[request._slot] = request
    prefilling = [r for r in self._running if r is not None and r._prefilled < len(r.prompt)]
    decoding = [r for r in self._running if r is not None and r._prefilled == len(r.prompt)
                and r.tokens and not r.finished and r not in prefilling]
    # No more steps than the longest-running request may still take.
    steps = 1 if prefilling or not decoding else min(
        self.decode_steps, max(r.sampling.max_tokens - len(r.tokens) for r in decoding))
    # Rows long enough for every live request's tokens by the end of this step (a request's
    # steps past its max_tokens write tokens that are dropped, wherever they land).
    needed = [min(r._prefilled + self.prefill_chunk, len(r.prompt)) if r in prefilling
              else len(r.prompt) + len(r.tokens)
              + min(steps, r.sampling.max_tokens - len(r.tokens)) - 1
              for r in self._running if r is not None]
    if needed:
      self._resize_to(_bucket(max(needed), self.max_len, _MIN_BUCKET))
    if prefilling:
      self._prefill_chunk(prefilling)
    if decoding:
      self._decode_steps(decoding, steps)

  # Steps.
  def _prefill_chunk(self, requests: list[Request]) -> None:
    rows = _bucket(len(requests), self.slots, self._min_rows)
    chunk = self.prefill_chunk
    # Padding rows are other slots, with no real token: nothing of theirs is written.
    others = [s for s in range(self.slots) if s not in {r._slot for r in requests}]
    slot_ids = np.array([r._slot for r in requests] + others[:rows - len(requests)], np.int32)
    tokens = np.zeros((rows, chunk), np.int32)
    starts = np.zeros(rows, np.int32)
    counts = np.zeros(rows, np.int32)
    for row, r in enumerate(requests):
      piece = r.prompt[r._prefilled:r._prefilled + chunk]
      starts[row], counts[row] = r._prefilled, len(piece)
      tokens[row, :len(piece)] = piece
    padded = requests + [None] * (rows - len(requests))
    fn = self._prefill.get((rows, self._length)) or self._compile(rows, self._length)
    self._cache, self._sampled, new, logprobs = fn(
        self.params, self._cache, self._sampled, slot_ids, tokens, starts, counts,
        self._settings(padded), _adjustments(padded))
    new, logprobs = jax.device_get((new, logprobs))
    with self._lock:
      for row, r in enumerate(requests):
        r._prefilled += int(counts[row])
        if r._prefilled == len(r.prompt):
          self._record(r, int(new[row]), float(logprobs[row]))

  def _decode_steps(self, requests: list[Request], steps: int) -> None:
    """`steps` decode steps, each fed the one before's tokens on the device; the host reads
    them once, and records each request's until it ends."""
    last = np.zeros((self.slots, 1), np.int32)
    positions = np.zeros(self.slots, np.int32)
    active = np.zeros(self.slots, np.int32)  # Idle slots' tokens are not real: not written.
    per_slot: list[Request | None] = [None] * self.slots
    for r in requests:
      last[r._slot], positions[r._slot] = r.tokens[-1], len(r.prompt) + len(r.tokens) - 1
      active[r._slot] = 1
      per_slot[r._slot] = r
    fn = self._decode.get(self._length) or self._compile(None, self._length)
    slot_ids = np.arange(self.slots, dtype=np.int32)
    following = (last, positions, active, self._settings(per_slot))
    drawn = []
    for _ in range(steps):
      self._cache, self._sampled, new, logprobs, following = fn(
          self.params, self._cache, self._sampled, slot_ids, *following, ())
      drawn.append((new, logprobs))
    drawn = jax.device_get(drawn)
    with self._lock:
      for new, logprobs in drawn:
        for r in requests:
          if not r.finished:
            self._record(r, int(new[r._slot]), float(logprobs[r._slot]))

  def _settings(self, requests: Sequence[Request | None]) -> tuple[np.ndarray, ...]:
    """Each row's (temperature, top_k, top_p, seed, tokens drawn so far); greedy for none."""
    pick = lambda f, default, dtype: np.array(
        [default if r is None else f(r) for r in requests], dtype)
    return (pick(lambda r: r.sampling.temperature, 0.0, np.float32),
            pick(lambda r: r.sampling.top_k, 0, np.int32),
            pick(lambda r: r.sampling.top_p, 1.0, np.float32),
            pick(lambda r: r.sampling.seed, 0, np.uint32),
            pick(lambda r: len(r.tokens), 0, np.int32))

  # Bookkeeping, under the lock.
  def _record(self, request: Request, token: int, logprob: float) -> None:
    """Appends a drawn token to `request`, or ends it (a stop token, a stop string, its
    max_tokens, the context's end)."""
    sampling = request.sampling
    if token in sampling.stop_ids:
      request.stop_id = token
      return self._finish(request, "stop")
    request.tokens.append(token)
    request.logprobs.append(logprob)
    if self.tokenizer is not None:
      try:
        request.text = self.tokenizer.decode(request.tokens)
      except Exception as e:  # pylint: disable=broad-except  # An id past the tokenizer's.
        logging.warning("A completion's tokens do not decode (%s); it ends with 'error'", e)
        return self._finish(request, "error")
      cuts = [i for i in (request.text.find(s) for s in sampling.stop) if i >= 0]
      if cuts:
        request.text = request.text[:min(cuts)]
        return self._finish(request, "stop")
    if (len(request.tokens) >= sampling.max_tokens
        or len(request.prompt) + len(request.tokens) >= self.max_len):
      return self._finish(request, "length")
    _notify(request)

  def _finish(self, request: Request, reason: str) -> None:
    request.finish_reason = reason
    if request._slot >= 0 and self._running[request._slot] is request:
      self._running[request._slot] = None
    request._done.set()
    _notify(request)

  def lowered_decode_forward(self, params: Any, length: int, sharding: NamedSharding):
    """The decode step's forward (every slot's token through the model, its cache rows `length`
    long; not the sampler) lowered for abstract `params` (ShapeDtypeStructs) and inputs laid
    out by `sharding`, under its mesh, so that the model traces for those devices' platform: a
    compile ahead of time for devices this host may lack (bench/decode_roofline.py
    --topology). For an engine without a mesh of its own."""
    if self._batch_sharding is not None:
      raise ValueError("lowered_decode_forward lays out its inputs by `sharding`: the engine "
                       "must have no batch_sharding of its own")
    abstract = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    cache = jax.tree.map(lambda x: abstract(x.shape, x.dtype), self._abstract_cache(length))
    slots = self.slots
    with jax.set_mesh(sharding.mesh):
      return self._forward(None, length).lower(
          params, cache, abstract((slots,), jnp.int32), abstract((slots, 1), jnp.int32),
          abstract((slots,), jnp.int32), abstract((slots,), jnp.int32))

  # The compiled steps.
  def _compile(self, rows: int | None, length: int):
    """The prefill of `rows` slots' chunks (rows None: the decode step of every slot, one token
    each: tokens [slots, 1], starts their positions, counts 1 where a slot decodes), on a cache
    of rows `length` long. A prefill also takes each row's logit bias and penalties
    (_adjustments'), set where its request's first chunk is. Returns (cache, sampled, tokens
    drawn [rows], their log-probabilities [rows]), and a decode step also the next decode
    step's (tokens, starts, counts, settings): each slot's token drawn, one position on.

    Two compiled functions: the model's forward for this shape, and the sampler for the rows'
    count, shared by every cache length. Sampling's sort over the vocabulary (top-k, top-p) is
    most of a step's compile on a TPU (7 of 12.6 s for a 100M model's, scanned, on v5e): once
    per row count, not once per shape.
    """
    forward = self._forward(rows, length)
    if rows not in self._samplers:
      self._samplers[rows] = self._sampler(rows)
    sampler = self._samplers[rows]

    def step(params, cache, sampled, slot_ids, tokens, starts, counts, settings, adjustments):
      cache, last = forward(params, cache, slot_ids, tokens, starts, counts)
      return (cache, *sampler(last, sampled, slot_ids, starts, counts, settings, adjustments))
    (self._decode if rows is None else self._prefill)[
        length if rows is None else (rows, length)] = step
    return step

  def _forward(self, rows: int | None, length: int):
    """(params, cache, slot_ids, tokens, starts, counts) -> (cache, each row's last logits
    [rows, vocab], float32) of _compile's step."""
    model, axes = self._model, self._batch_axes

    def forward(params, cache, slot_ids, tokens, starts, counts):
      rows_of = None if rows is None else slot_ids  # Decoding: every slot, in order.
      part = jax.tree.map(lambda c, a: _take_rows(c, a, rows_of), cache, axes)
      part = _with_index(part, starts)
      length = tokens.shape[1]
      # Clipped: a chunk's padding past the context must still index the positions' table.
      positions = jnp.minimum(starts[:, None] + jnp.arange(length), self.max_len - 1)
      logits, variables = model.apply(
          {"params": params, "cache": part}, tokens, positions=positions,
          token_mask=jnp.arange(length) < counts[:, None],
          logits_at=jnp.maximum(counts - 1, 0)[:, None], mutable=["cache"])
      cache = jax.tree.map(lambda c, p, a: _put_rows(c, p, a, rows_of), cache,
                           variables["cache"], axes)
      return cache, logits[:, 0].astype(jnp.float32)
    return self._jit(forward, lambda replicated: (
        (self._param_shardings, self._cache_shardings) + (replicated,) * 4,
        (self._cache_shardings, replicated)))

  def _sampler(self, rows: int | None):
    """(last logits, sampled, slot_ids, starts, counts, settings, adjustments) -> (sampled,
    tokens drawn [rows], their log-probabilities [rows], and decoding the next step's inputs)
    of _compile's step."""
    slots = self.slots

    def sample(last, sampled, slot_ids, starts, counts, settings, adjustments):
      temperature, top_k, top_p, seeds, drawn = settings
      if adjustments:
        first = jnp.where((starts == 0) & (counts > 0), slot_ids, slots)  # slots: dropped.
        sampled = {**sampled, **{name: sampled[name].at[first].set(value, mode="drop") for
                                 name, value in zip(("bias_ids", "bias", "penalties"), adjustments)}}
      mine = jax.tree.map(lambda x: x[slot_ids], sampled)
      # Rows drawing a token whose request biases or penalizes (a finished one's slot does not).
      adjusted = (counts > 0) & (jnp.any(mine["bias"] != 0, axis=1)
                                 | jnp.any(mine["penalties"] != 0, axis=1))
      drawn_from = jax.lax.cond(
          jnp.any(adjusted),
          lambda: penalized(last, mine["completion"], drawn, mine["penalties"][:, 0],
                            mine["penalties"][:, 1], mine["bias_ids"], mine["bias"]),
          lambda: last)
      new, logprobs = sample_tokens(last, temperature, top_k, top_p, _keys(seeds, drawn),
                                    drawn_from)
      # A penalized row keeps its token as its completion's drawn-th (an earlier chunk's draw is
      # overwritten by the last chunk's); a step without one writes nothing.
      sampled["completion"] = jax.lax.cond(
          jnp.any(adjusted), lambda c: c.at[jnp.where(counts > 0, slot_ids, slots), drawn].set(
              new, mode="drop"), lambda c: c, sampled["completion"])
      if rows is not None:
        return sampled, new, logprobs
      following = (new[:, None], starts + counts, counts,
                   (temperature, top_k, top_p, seeds, drawn + counts))
      return sampled, new, logprobs, following
    return self._jit(sample, lambda replicated: (replicated, replicated))

  def _jit(self, fn, layout: Callable[[NamedSharding], tuple]):
    """fn jitted, its argument 1 (the state it updates) donated; on a mesh, laid out as
    layout(the replicated sharding) says: (in_shardings, out_shardings)."""
    if self._batch_sharding is None:
      return jax.jit(fn, donate_argnums=(1,))
    in_shardings, out_shardings = layout(
        NamedSharding(self._batch_sharding.mesh, PartitionSpec()))
    return jax.jit(fn, donate_argnums=(1,), in_shardings=in_shardings,
                   out_shardings=out_shardings)

  def _shardings_of_cache(self):
    """Slots over the batch's mesh axes, key and value heads over the heads' (where they
    divide); None off a mesh."""
    if self._batch_sharding is None:
      return None
    mesh = self._batch_sharding.mesh
    # The logical axis rules in context (the partitioner's activation_context); without them,
    # the batch sharding's axes and whole heads.
    batch_axes, heads_axes = nn.logical_to_mesh_axes(("batch", "heads"))
    if batch_axes is None and heads_axes is None:
      batch_axes = self._batch_sharding.spec[0] if self._batch_sharding.spec else None
    abstract = self._abstract_cache(self.max_len)

    def spec(leaf, axis):
      entries = [None] * leaf.ndim
      entries[axis] = _dividing(mesh, batch_axes, leaf.shape[axis])
      if leaf.ndim - axis == 4:  # [slots, kv heads, length, head_dim]
        entries[axis + 1] = _dividing(mesh, heads_axes, leaf.shape[axis + 1])
      return NamedSharding(mesh, PartitionSpec(*entries))
    return jax.tree.map(spec, abstract, self._batch_axes)

  def _resize_to(self, length: int) -> None:
    """The cache with rows `length` long: allocated, or each entry grown (zeros after its rows)
    or cut (its rows' first positions: every live request's tokens lie within) by a copy of
    its own. The old entry is let go before the next is copied, so a resize holds one entry
    twice at most, not the whole cache. The slots' sampling state is allocated with the
    cache."""
    if self._sampled is None:
      self._sampled = jax.tree.map(
          lambda x: jnp.zeros(x.shape, x.dtype, device=None if self._batch_sharding is None
                              else NamedSharding(self._batch_sharding.mesh, PartitionSpec())),
          self._abstract_sampled())
    if self._cache is not None and length == self._length:  # Most steps.
      return
    abstract = self._abstract_cache(length)
    shardings = (jax.tree.map(lambda _: None, abstract) if self._cache_shardings is None
                 else self._cache_shardings)
    if self._cache is None:
      self._cache = jax.tree.map(lambda x, sharding: jnp.zeros(x.shape, x.dtype, device=sharding),
                                 abstract, shardings)
    else:
      leaves, structure = jax.tree.flatten(self._cache)
      self._cache = None
      for i, (shape, axis, sharding) in enumerate(zip(
          [x.shape for x in jax.tree.leaves(abstract)], jax.tree.leaves(self._length_axes),
          jax.tree.leaves(shardings, is_leaf=lambda x: x is None))):
        if axis >= 0 and leaves[i].shape[axis] != shape[axis]:
          leaves[i] = _fitted(leaves[i], shape[axis], axis, sharding)
      self._cache = structure.unflatten(leaves)
    self._length = length

  def _abstract_sampled(self) -> dict[str, jax.ShapeDtypeStruct]:
    """Each slot's logit bias, its (presence, frequency) penalties, and its completion so far
    (whose tokens the penalties count)."""
    return {"completion": jax.ShapeDtypeStruct((self.slots, self.max_len), jnp.int32),
            "bias_ids": jax.ShapeDtypeStruct((self.slots, MAX_LOGIT_BIAS), jnp.int32),
            "bias": jax.ShapeDtypeStruct((self.slots, MAX_LOGIT_BIAS), jnp.float32),
            "penalties": jax.ShapeDtypeStruct((self.slots, 2), jnp.float32)}

  def _abstract_cache(self, length: int):
    """The cache's entries' shapes and dtypes for rows `length` long (an init traced once)."""
    if length not in self._abstract_caches:
      self._abstract_caches[length] = _abstract_init(self._model, (self.slots, length))
    return self._abstract_caches[length]


def _notify(request: Request) -> None:
  """Calls the request's listener; one that fails (a server shutting down) fails alone."""
  if request.listener:
    try:
      request.listener(request)
    except Exception:  # pylint: disable=broad-except
      logging.exception("A request's listener failed")


def _adjustments(requests: Sequence[Request | None]) -> tuple[np.ndarray, ...]:
  """Each row's logit bias as token ids and biases [rows, MAX_LOGIT_BIAS] (padded with zeros),
  and its (presence, frequency) penalties [rows, 2]."""
  ids = np.zeros((len(requests), MAX_LOGIT_BIAS), np.int32)
  biases = np.zeros((len(requests), MAX_LOGIT_BIAS), np.float32)
  penalties = np.zeros((len(requests), 2), np.float32)
  for row, r in enumerate(requests):
    if r is not None:
      penalties[row] = r.sampling.presence_penalty, r.sampling.frequency_penalty
      if r.sampling.logit_bias:
        ids[row, :len(r.sampling.logit_bias)], biases[row, :len(r.sampling.logit_bias)] = zip(
            *r.sampling.logit_bias)
  return ids, biases, penalties


def _bucket(n: int, cap: int, minimum: int) -> int:
  """The next power of two from n (at least `minimum`), at most `cap`: a few compiled shapes."""
  return min(cap, max(minimum, 1 << max(n - 1, 0).bit_length()))


def _dividing(mesh, axes, size: int):
  """`axes` (a PartitionSpec entry) if their mesh size divides `size`, else None."""
  return axes if axes is not None and size % partitioning.axes_size(mesh, axes) == 0 else None


def _abstract_init(model: nn.Module, shape: tuple[int, int]):
  """The cache's entries as ShapeDtypeStructs for tokens of `shape`: traced alone, with no
  array made, so that it runs where the mesh's devices are compile-only (aot's plan)."""
  return jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(shape, jnp.int32)))["cache"]


def _axes(model: nn.Module, shape: Callable[[int], tuple[int, int]]):
  """Each cache entry's axis whose size follows n in the init input's shape(n) (its slots' or
  its positions'; -1 where none does: the index has no positions)."""
  one, two = (_abstract_init(model, shape(n)) for n in (1, 3))
  return jax.tree.map(lambda a, b: next((i for i, (x, y) in enumerate(zip(a.shape, b.shape))
                                         if x != y), -1), one, two)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _fitted(leaf: jax.Array, length: int, axis: int, sharding) -> jax.Array:
  """A cache entry with its positions' axis `length` long: cut, or zeros after."""
  if leaf.shape[axis] > length:
    fitted = jax.lax.slice_in_dim(leaf, 0, length, axis=axis)
  else:
    fitted = jnp.pad(leaf, [(0, length - leaf.shape[axis]) if i == axis else (0, 0)
                            for i in range(leaf.ndim)])
  return fitted if sharding is None else jax.lax.with_sharding_constraint(fitted, sharding)


def _take_rows(leaf: jax.Array, axis: int, rows: jax.Array | None) -> jax.Array:
  """`rows` of a cache entry along its slot axis (None: all)."""
  return leaf if rows is None else jnp.take(leaf, rows, axis=axis)


def _put_rows(leaf: jax.Array, part: jax.Array, axis: int, rows: jax.Array | None) -> jax.Array:
  """_take_rows' inverse: `part` written back into `leaf`."""
  if rows is None:
    return part
  return jnp.moveaxis(jnp.moveaxis(leaf, axis, 0).at[rows].set(jnp.moveaxis(part, axis, 0)),
                      0, axis)


def _with_index(cache, starts: jax.Array):
  """The cache with every layer's index set to each row's start: the engine's positions, not
  the cache's own count, say where each slot writes."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.broadcast_to(starts, x.shape).astype(x.dtype)
      if getattr(path[-1], "key", None) == "index" else x, cache)
