"""The OpenAI-compatible HTTP API on the generation engine: /v1/models, /v1/completions and
/v1/chat/completions, whole or streamed as server-sent events, with `usage` counts. FastAPI
and uvicorn serve it (the `serve` command); the engine steps in a thread of its own, and each
request's progress reaches its handler through an asyncio queue.

Errors are OpenAI's JSON ({"error": {"message", "type", "param", "code"}}) with the status
they call for, and the server goes on serving: a prompt that fills the context, bad sampling
settings, malformed JSON (400), an unknown model (404). A client that disconnects cancels its
requests, whose slots free at the engine's next step.

Sampling is the engine's: temperature, top_p, top_k and ignore_eos (vLLM's extensions), seed
(none: a random one), stop, max_tokens (none: up to the context's end), n (at most the
slots), logit_bias, presence_penalty and frequency_penalty, logprobs (of each chosen token,
under the model's own distribution; no alternatives). A completion ends at any of the
checkpoint's EOS ids (tokenizers.stop_ids), a chat reply also at its template's end of turn.
What the engine does not do (echo, best_of, suffix, tools, response formats) is refused with
a 400 naming the parameter, never ignored; other unknown fields (user, ...) are.
"""
import asyncio
import contextlib
import json
import threading
import time
import uuid

import fastapi
import jax
from absl import logging
import pydantic
import uvicorn
from fastapi import responses

from levanter_flax import models
from levanter_flax.core.errors import UserError
from levanter_flax.generate import prompts, trained
from levanter_flax.generate.engine import Engine, Request, SamplingParams
from levanter_flax.models import common
from levanter_flax.parallel import partitioning

# How often a request that streams nothing asks whether its client is still there.
_DISCONNECT_POLL_S = 0.5


class ApiError(Exception):
  """An error answered as OpenAI answers it."""

  def __init__(self, status: int, message: str, param: str | None = None,
               kind: str = "invalid_request_error"):
    super().__init__(message)
    self.status, self.message, self.param, self.kind = status, message, param, kind


class _Sampled(pydantic.BaseModel):
  """The fields both endpoints take; of the others, those that would change the output are
  refused (_UNSUPPORTED), the rest (user, ...) ignored."""
  model_config = pydantic.ConfigDict(extra="ignore")
  model: str
  max_tokens: int | None = None
  max_completion_tokens: int | None = None
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  n: int = 1
  seed: int | None = None
  stop: str | list[str] | None = None
  stream: bool = False
  stream_options: dict | None = None  # {"include_usage": true}: a last chunk with usage.
  logprobs: bool | int | None = None  # Completions: an int; chat: a bool.
  ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever comes (benchmarks).
  logit_bias: dict[str, float] | None = None  # {token id: bias}, as OpenAI's.
  presence_penalty: float | None = None
  frequency_penalty: float | None = None


class CompletionRequest(_Sampled):
  prompt: str | list[str] | list[int] | list[list[int]]
  max_tokens: int | None = 16  # OpenAI's default for completions.
  echo: bool | None = None
  best_of: int | None = None
  suffix: str | None = None


class ChatMessage(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="ignore")
  role: str
  content: str | list[dict] | None = None


class ChatRequest(_Sampled):
  messages: list[ChatMessage]
  tools: list | None = None
  tool_choice: str | dict | None = None
  response_format: dict | None = None


# Each request field the engine cannot honour: its value where it changes nothing.
_UNSUPPORTED = {"echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),
                "tools": (None, []), "tool_choice": (None, "none"),
                "response_format": (None, {"type": "text"})}


def _refuse_unsupported(body: _Sampled) -> None:
  for name, harmless in _UNSUPPORTED.items():
    if name in type(body).model_fields and getattr(body, name) not in harmless:
      raise ApiError(400, f"{name} is not supported by this server", name)


def _logit_bias(biases: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
  """OpenAI's {"token id": bias} as the engine's pairs."""
  pairs = []
  for token, bias in (biases or {}).items():
    try:
      pairs.append((int(token), float(bias)))
    except ValueError:
      raise ApiError(400, f"logit_bias maps token ids to biases; {token!r} is not a token id",
                     "logit_bias") from None
  return tuple(pairs)


class Server:
  """What the endpoints serve: the engine (stepping in its own thread between start and stop),
  the model's name, its tokenizer, and its chat template (None: no chat endpoint)."""

  def __init__(self, engine: Engine, model_name: str, tokenizer, template=None,
               reply_stop_ids: tuple[int, ...] = (), context=contextlib.nullcontext):
    self.engine, self.model_name, self.tokenizer = engine, model_name, tokenizer
    self.template, self.reply_stop_ids = template, reply_stop_ids
    self.created = int(time.time())
    self._context = context
    self._stopped = threading.Event()
    self._ready = threading.Event()
    self._thread = None

  def start(self, warm_up: bool = True) -> None:
    """Starts the engine's thread, and returns once it serves: after compiling every step
    shape with warm_up. Its compiles happen in its context (the mesh and axis rules, which
    are per thread and part of what a compiled step is kept by)."""
    def run():
      with self._context():
        if warm_up:
          logging.info("Compiled %d step shapes", self.engine.warm_up())
        self._ready.set()
        self.engine.serve_forever(self._stopped)
    self._thread = threading.Thread(target=run, name="engine", daemon=True)
    self._thread.start()
    while not self._ready.wait(1.0):
      if not self._thread.is_alive():
        raise RuntimeError("the engine's thread ended while it warmed up; its log says why")

  def stop(self) -> None:
    """Returns once the requests the engine holds have finished and its thread has ended."""
    self._stopped.set()
    self.engine.wake()
    self._thread.join()

  def sampling(self, body: _Sampled, stop_ids: tuple[int, ...]) -> SamplingParams:
    if body.model != self.model_name:
      raise ApiError(404, f"The model {body.model!r} does not exist; this server serves "
                     f"{self.model_name!r}", "model", "not_found_error")
    _refuse_unsupported(body)
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is not None and max_tokens <= 0:
      raise ApiError(400, f"max_tokens must be at least 1; got {max_tokens}", "max_tokens")
    if not 1 <= body.n <= self.engine.slots:
      raise ApiError(400, f"n must be in [1, {self.engine.slots}] (the server's slots); got "
                     f"{body.n}", "n")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    sampling = SamplingParams(
        max_tokens=max_tokens or self.engine.max_len, temperature=body.temperature,
        top_k=body.top_k, top_p=body.top_p,
        seed=(uuid.uuid4().int if body.seed is None else body.seed) % 2**32,
        stop=tuple(s for s in stop if s), stop_ids=stop_ids,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0, logit_bias=_logit_bias(body.logit_bias))
    try:
      sampling.check(self.engine.model_cfg.vocab_size)
    except UserError as e:
      raise ApiError(400, str(e)) from None
    return sampling

  def encode(self, prompt) -> list[list[int]]:
    """A completion request's prompt(s) as token ids: text, texts, ids, or lists of ids."""
    if isinstance(prompt, str):
      return [self.tokenizer.encode(prompt).tolist()]
    if prompt and all(isinstance(t, int) for t in prompt):
      return [list(prompt)]
    return [self.tokenizer.encode(p).tolist() if isinstance(p, str) else list(p)
            for p in prompt]

  def submit(self, prompts: list[list[int]], sampling: SamplingParams, n: int,
             changed: asyncio.Queue) -> list[Request]:
    """n requests per prompt (request i with seed + i), queued on the engine, each change of
    theirs put on `changed`; all refused, or none."""
    vocab = self.engine.model_cfg.vocab_size
    if not prompts:
      raise ApiError(400, "prompt is empty", "prompt")
    for prompt in prompts:
      if len(prompt) >= self.engine.max_len:
        raise ApiError(400, f"This model's context is {self.engine.max_len} tokens, and the "
                       f"prompt has {len(prompt)}: none are left to generate", "prompt")
      if not prompt or min(prompt) < 0 or max(prompt) >= vocab:
        raise ApiError(400, f"a prompt must hold 1 or more token ids in [0, {vocab})", "prompt")
    loop = asyncio.get_running_loop()
    listener = lambda request: loop.call_soon_threadsafe(changed.put_nowait, request)
    try:
      return self.engine.submit_all([p for p in prompts for _ in range(n)],
                                    sampling.apart(n * len(prompts)), listener)
    except UserError as e:
      raise ApiError(400, str(e)) from None

  async def updates(self, requests: list[Request], changed: asyncio.Queue,
                    http: fastapi.Request):
    """Yields (choice index, request) at each change of any of `requests` until all have
    finished; if the client goes away, stops and cancels them."""
    index = {id(r): i for i, r in enumerate(requests)}
    loop = asyncio.get_running_loop()
    next_look = loop.time() + _DISCONNECT_POLL_S
    try:
      while not all(r.finished for r in requests):
        try:
          request = await asyncio.wait_for(changed.get(), max(0.0, next_look - loop.time()))
        except asyncio.TimeoutError:
          request = None
        if loop.time() >= next_look:
          if await http.is_disconnected():
            return
          next_look = loop.time() + _DISCONNECT_POLL_S
        if request is not None:
          yield index[id(request)], request
    finally:  # Also when the streaming response is cancelled by a disconnect.
      for request in requests:
        if not request.finished:
          self.engine.cancel(request)


def build_app(server: Server) -> fastapi.FastAPI:
  """The FastAPI app of the three endpoints."""
  app = fastapi.FastAPI(title="levanter_flax", docs_url=None, redoc_url=None, openapi_url=None)

  @app.exception_handler(ApiError)
  async def api_error(_, e: ApiError):
    return _error(e.status, e.message, e.param, e.kind)

  @app.exception_handler(fastapi.exceptions.RequestValidationError)
  async def invalid(_, e):
    first = next(iter(e.errors()), {})
    if first.get("type") == "json_invalid":  # Its loc is the character it failed at.
      reason = first.get("ctx", {}).get("error", "malformed")
      at = first.get("loc", ("body", "?"))[-1]
      return _error(400, f"The request body is not valid JSON: {reason} at character {at}")
    where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
    return _error(400, first.get("msg", "invalid request") + (f" ({where})" if where else ""),
                  where)

  @app.get("/health")
  async def health():
    return server.engine.load()

  @app.get("/v1/models")
  async def list_models():
    return {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                        "created": server.created, "owned_by": "levanter_flax",
                                        "max_model_len": server.engine.max_len}]}

  @app.post("/v1/completions")
  async def completions(body: CompletionRequest, http: fastapi.Request):
    sampling = server.sampling(body, () if body.ignore_eos else server.tokenizer.stop_ids)
    return await _respond(server, http, body, server.encode(body.prompt), sampling, chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(body: ChatRequest, http: fastapi.Request):
    if server.template is None:
      raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
    sampling = server.sampling(body, () if body.ignore_eos else server.reply_stop_ids)
    messages = [{"role": m.role, "content": _text(m.content)} for m in body.messages]
    try:
      text = server.template.render(messages, True, "messages")
    except UserError as e:
      raise ApiError(400, str(e), "messages") from None
    return await _respond(server, http, body, [server.tokenizer.encode(text).tolist()], sampling,
                          chat=True)

  return app


def _text(content) -> str:
  """A message's content: its text, or its text parts joined."""
  if content is None or isinstance(content, str):
    return content or ""
  return "".join(part.get("text", "") for part in content if part.get("type") == "text")


async def _respond(server: Server, http: fastapi.Request, body: _Sampled,
                   prompts: list[list[int]], sampling: SamplingParams, chat: bool):
  changed = asyncio.Queue()
  requests = server.submit(prompts, sampling, body.n, changed)  # Refused before any answer.
  head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
          "object": "chat.completion" if chat else "text_completion",
          "created": int(time.time()), "model": server.model_name}
  updates = server.updates(requests, changed, http)
  if not body.stream:
    async for _ in updates:
      pass
    if any(r.finish_reason == "error" for r in requests):
      raise ApiError(500, "generation failed; the server's log says why", kind="server_error")
    return {**head, "usage": _usage(requests), "choices": [
        _choice(server, i, r, chat, body.logprobs) for i, r in enumerate(requests)]}
  chunk_head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
  include_usage = bool((body.stream_options or {}).get("include_usage"))

  async def events():
    sent, closed = [0] * len(requests), [False] * len(requests)

    def chunk(index: int, request: Request):
      """The text since the last chunk, and the finish reason once it has finished."""
      text = _settled(request)
      delta, sent[index] = text[sent[index]:], len(text)
      closed[index] = request.finished
      if not (delta or request.finished):
        return None
      finish = _reason(request) if request.finished else None
      choice = ({"index": index, "delta": {"role": "assistant", "content": delta},
                 "finish_reason": finish} if chat
                else {"index": index, "text": delta, "finish_reason": finish})
      return _event({**chunk_head, "choices": [choice]})
    async with contextlib.aclosing(updates) as changes:
      async for index, request in changes:
        if not closed[index] and (event := chunk(index, request)):
          yield event
    if not all(r.finished for r in requests):
      return  # The client is gone.
    if any(r.finish_reason == "error" for r in requests):
      yield _event({"error": {"message": "generation failed; the server's log says why",
                              "type": "server_error", "param": None, "code": None}})
      return
    for index, request in enumerate(requests):  # Those whose last change came after the end.
      if not closed[index] and (event := chunk(index, request)):
        yield event
    if include_usage:
      yield _event({**chunk_head, "choices": [], "usage": _usage(requests)})
    yield "data: [DONE]\n\n"
  return responses.StreamingResponse(events(), media_type="text/event-stream")


def _settled(request: Request) -> str:
  """The text no later token can change: all of it once finished; before, less a trailing
  partial character and the last (longest stop string - 1) characters, which may begin one."""
  if request.finished:
    return request.text
  text = request.text.rstrip("\ufffd")
  hold = max(map(len, request.sampling.stop), default=1) - 1
  return text[:len(text) - hold] if hold else text


def _choice(server: Server, index: int, request: Request, chat: bool, logprobs) -> dict:
  logprobs = logprobs is not None and logprobs is not False  # Completions' 0: chosen tokens'.
  pieces = [server.tokenizer.decode([t]) for t in request.tokens] if logprobs else []
  if chat:
    return {"index": index, "finish_reason": _reason(request),
            "message": {"role": "assistant", "content": request.text},
            "logprobs": {"content": [
                {"token": piece, "logprob": logprob, "bytes": list(piece.encode()),
                 "top_logprobs": []} for piece, logprob in zip(pieces, request.logprobs)]}
            if logprobs else None}
  return {"index": index, "finish_reason": _reason(request), "text": request.text,
          "logprobs": {"tokens": pieces, "token_logprobs": request.logprobs,
                       "top_logprobs": None, "text_offset": None} if logprobs else None}


def _reason(request: Request) -> str:
  """OpenAI's finish reasons are stop and length; a cancelled request's client is gone."""
  return "length" if request.finish_reason == "length" else "stop"


def _usage(requests: list[Request]) -> dict:
  prompt = sum(len(r.prompt) for r in requests)
  completion = sum(len(r.tokens) for r in requests)
  return {"prompt_tokens": prompt, "completion_tokens": completion,
          "total_tokens": prompt + completion}


def _error(status: int, message: str, param: str | None = None,
           kind: str = "invalid_request_error"):
  return responses.JSONResponse(status_code=status, content={
      "error": {"message": message, "type": kind, "param": param, "code": None}})


def _event(chunk: dict) -> str:
  return f"data: {json.dumps(chunk)}\n\n"


def load_server(workdir: str, hf_dir: str, *, model_name: str = "", chat_template: str = "",
                slots: int = 8, max_len: int = 0, prefill_chunk: int = 128,
                decode_steps: int = 8, tensor_parallel: int = 1,
                cache_dtype: str = "") -> Server:
  """The server of a run's newest checkpoint or an HF checkpoint directory, on a mesh of every
  device: `tensor_parallel` ways over the model's heads and widths, the rest over the slots.
  cache_dtype: the KV cache's (compute.cache_dtype), "" for the model config's."""
  from levanter_flax.data import chat  # pylint: disable=g-import-not-at-top
  directory = trained.model_directory(workdir, hf_dir)
  if jax.device_count() % tensor_parallel:  # Said before the model loads.
    raise UserError(f"--tensor_parallel {tensor_parallel} must divide the {jax.device_count()} "
                    f"devices")
  if workdir:
    model_cfg, params, saved = trained.run_params(directory)
    tokenizer = trained.run_tokenizer(directory, saved)
    template = _optional(lambda: trained.chat_template(saved, tokenizer, chat_template),
                         chat_template)
  else:
    model_cfg, params, tokenizer = trained.model_and_tokenizer(directory, is_run=False)
    template = _optional(lambda: chat.load_template(str(directory / "tokenizer.json"),
                                                    chat_template), chat_template)
  if cache_dtype:
    model_cfg = common.with_compute(model_cfg, cache_dtype=cache_dtype)
  reply_stop_ids = () if template is None else prompts.reply_stop_ids(
      template, tokenizer, [{"role": "user", "content": "Hello"}], "the chat template")
  mesh = partitioning.make_mesh((("data", -1), ("model", tensor_parallel)))
  partitioner = partitioning.Partitioner(
      mesh, partitioning.ShardingConfig(rules=models.family(model_cfg).partition_rules))
  with partitioner.activation_context():
    engine = Engine(model_cfg, params, slots=slots, max_len=max_len or None,
                    prefill_chunk=prefill_chunk, decode_steps=decode_steps, tokenizer=tokenizer,
                    param_shardings=partitioner.param_shardings(params),
                    batch_sharding=partitioner.batch_sharding())
  return Server(engine, model_name or directory.name, tokenizer, template, reply_stop_ids,
                partitioner.activation_context)


def _optional(load, template_file: str):
  """The chat template `load` finds; None where there is none, unless a file was given."""
  try:
    return load()
  except UserError as e:
    if template_file:
      raise
    logging.warning("No chat template (%s): /v1/chat/completions is off", e)
    return None


class _Uvicorn(uvicorn.Server):
  """uvicorn's server, but a SIGTERM or SIGINT it ended on gracefully is not raised again once
  it has: the process exits 0, its requests answered. It says where it serves once it does
  (not when a busy port stops it)."""

  def __init__(self, config: uvicorn.Config, model_name: str):
    super().__init__(config)
    self.model_name = model_name

  async def startup(self, sockets=None) -> None:
    await super().startup(sockets)
    if self.started:
      host, port = self.servers[0].sockets[0].getsockname()[:2]
      logging.info("Serving %s on http://%s:%d/v1", self.model_name, host, port)

  def handle_exit(self, sig, frame) -> None:
    super().handle_exit(sig, frame)
    self._captured_signals.clear()  # What uvicorn raises again after its shutdown.


def serve(server: Server, host: str, port: int, warm_up: bool = True) -> None:
  """Serves until SIGTERM or SIGINT, which stop new connections and wait for the running
  requests; then the engine's thread ends. warm_up: compile every step shape first."""
  server.start(warm_up)
  try:
    _Uvicorn(uvicorn.Config(build_app(server), host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=None), server.model_name).run()
  finally:
    server.stop()
