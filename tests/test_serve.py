"""`levanter-flax serve`: a real server process on 127.0.0.1, talked to with the official
`openai` client, streaming and not; transformers' greedy text; slots reused under load; bad
input answered and survived; a client gone mid-stream; SIGTERM."""
import concurrent.futures
import json
import os
import re
import signal
import socket
import sys
import time

import httpx
import pytest
import torch
import transformers

import forkserver
from conftest import REPO, xla_flags
from test_chat import CHATML, make_tokenizer

openai = pytest.importorskip("openai")

CONTEXT = 4096  # Long enough that a request to its end takes many seconds.
SLOTS = 4
MODEL = "tiny"


def make_model(directory):
  """A seeded Llama with a byte-level BPE and ChatML, as a hub snapshot holds them; a peaked
  head, so that no greedy choice is a near tie."""
  make_tokenizer(directory, template=CHATML, eos_token="<|im_end|>")
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
      tie_word_embeddings=False, eos_token_id=0, bos_token_id=None))
  with torch.no_grad():
    model.lm_head.weight.mul_(30.0)
  model.save_pretrained(directory)
  return model.eval()


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start(directory, *flags):
  """A server process on a free port, and its base URL once it answers."""
  port = free_port()
  process = forkserver.Popen(
      [sys.executable, "-m", "levanter_flax.commands.serve", f"--init_from_hf={directory}",
       f"--port={port}", f"--slots={SLOTS}", f"--model_name={MODEL}", *flags],
      cwd=REPO, env={**os.environ, "XLA_FLAGS": xla_flags(1)}, stdout=forkserver.subprocess.PIPE,
      stderr=forkserver.subprocess.PIPE, text=True)
  url = f"http://127.0.0.1:{port}"
  deadline = time.time() + 180
  while time.time() < deadline:
    if process.poll() is not None:
      raise AssertionError(f"the server exited: {process.communicate()[1][-3000:]}")
    try:
      if httpx.get(f"{url}/v1/models", timeout=1).status_code == 200:
        return process, url
    except httpx.HTTPError:
      time.sleep(0.3)
  process.kill()
  raise AssertionError("the server did not answer within 180 s")


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
  directory = tmp_path_factory.mktemp("tiny")
  return directory, make_model(directory)


@pytest.fixture(scope="module")
def served(hf):
  process, url = start(hf[0])
  yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
  process.send_signal(signal.SIGTERM)
  process.communicate(timeout=60)


def hf_greedy(hf, text: str, max_tokens: int, logit_bias: dict[int, float] | None = None) -> str:
  """transformers' greedy completion (with `logit_bias` as its sequence_bias)."""
  directory, model = hf
  tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory /
                                                                      "tokenizer.json"))
  ids = tokenizer(text, return_tensors="pt").input_ids
  with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         do_sample=False, eos_token_id=[], pad_token_id=0,
                         sequence_bias={(t,): b for t, b in (logit_bias or {}).items()} or None)
  return tokenizer.decode(out[0, ids.shape[1]:])


@pytest.mark.slow
def test_completions_whole_and_streamed_are_transformers_greedy_text(served, hf):
  url, client = served
  assert [m.id for m in client.models.list().data] == [MODEL]
  prompt = "hello there, how are"
  whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    logprobs=1)
  choice = whole.choices[0]
  assert choice.text == hf_greedy(hf, prompt, 12) and choice.finish_reason == "length"
  assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
  assert len(choice.logprobs.token_logprobs) == 12 and all(
      p <= 0 for p in choice.logprobs.token_logprobs)
  chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                          temperature=0, stream=True,
                                          stream_options={"include_usage": True}))
  assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
  assert chunks[-1].usage.completion_tokens == 12
  # Seeded sampling: the same text twice; n samples apart.
  sampled = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, seed=3,
                                       n=2).choices for _ in range(2)]
  assert [c.text for c in sampled[0]] == [c.text for c in sampled[1]]
  assert sampled[0][0].text != sampled[0][1].text
  # Streamed, the two finish in the same step: each still gets its last text and one finish.
  texts, finishes = ["", ""], [[], []]
  for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, seed=3, n=2,
                                         stream=True):
    for choice in chunk.choices:
      texts[choice.index] += choice.text
      finishes[choice.index] += [choice.finish_reason] if choice.finish_reason else []
  assert texts == [c.text for c in sampled[0]] and finishes == [["length"], ["length"]]
  # OpenAI's logit_bias is transformers' sequence_bias of single tokens.
  bias = {77: 4.0, 101: -100.0, 250: 2.5}
  biased = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                     logit_bias={str(t): b for t, b in bias.items()})
  assert biased.choices[0].text == hf_greedy(hf, prompt, 12, bias) != choice.text


@pytest.mark.slow
def test_chat_renders_the_template_and_stops_at_its_end_of_turn(served, hf):
  url, client = served
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
  reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40,
                                         temperature=0)
  rendered = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
              "<|im_start|>assistant\n")
  expected = hf_greedy(hf, rendered, 40)
  text = reply.choices[0].message.content
  # transformers ran on past the end-of-turn; the server stops before it.
  assert expected.startswith(text) and "<|im_end|>" not in text
  if "<|im_end|>" in expected:
    assert reply.choices[0].finish_reason == "stop" and expected.index("<|im_end|>") == len(text)
  streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40,
                                            temperature=0, stream=True)
  assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text


@pytest.mark.slow
def test_32_concurrent_requests_on_4_slots_equal_each_alone(served):
  url, client = served
  prompts = [f"question {i}: how are you" for i in range(32)]
  ask = lambda i: client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=8 + i % 5,
                                            seed=i, temperature=0.0 if i % 2 else 0.8).choices[0]
  with concurrent.futures.ThreadPoolExecutor(32) as pool:
    together = list(pool.map(ask, range(32)))
  for i in (0, 1, 17, 30, 31):
    alone = ask(i)
    assert (alone.text, alone.finish_reason) == (together[i].text, together[i].finish_reason)


@pytest.mark.slow
def test_bad_requests_get_openai_errors_and_the_server_goes_on(served):
  url, client = served

  def refused(status, pattern, **kwargs):
    with pytest.raises(openai.APIStatusError) as raised:
      client.completions.create(**{"model": MODEL, "prompt": "hi", **kwargs})
    assert raised.value.status_code == status
    assert re.search(pattern, raised.value.message), raised.value.message
  refused(400, f"context is {CONTEXT} tokens, and the prompt has {CONTEXT + 5}",
          prompt=[5] * (CONTEXT + 5))
  refused(404, "The model 'nope' does not exist", model="nope")
  refused(400, "max_tokens must be at least 1; got 0", max_tokens=0)
  refused(400, f"n must be in \\[1, {SLOTS}\\]", n=SLOTS + 1)
  refused(400, "top_p must be in", top_p=2.0)
  refused(400, "prompt is empty", prompt=[])
  malformed = httpx.post(f"{url}/v1/completions", content=b'{"model": "tiny", "prompt": ',
                         headers={"content-type": "application/json"})
  assert malformed.status_code == 400 and malformed.json()["error"]["message"] == (
      "The request body is not valid JSON: Expecting value at character 28")
  for name, value in [("echo", True), ("best_of", 3)]:
    refused(400, f"{name} is not supported by this server$", **{name: value})
  refused(400, "presence_penalty must be in \\[-2, 2\\]; got 2.5", presence_penalty=2.5)
  refused(400, "logit_bias maps token ids to biases; 'x' is not a token id", logit_bias={"x": 1})
  refused(400, "logit_bias names token 320, outside", logit_bias={"320": 1})
  tools = httpx.post(f"{url}/v1/chat/completions", json={
      "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "f"}}]})
  assert tools.status_code == 400 and tools.json()["error"]["param"] == "tools"
  nulls = httpx.post(f"{url}/v1/completions", json={  # As some clients send the defaults.
      "model": MODEL, "prompt": "hi", "max_tokens": 2, "presence_penalty": None,
      "frequency_penalty": None, "logit_bias": None, "echo": None, "best_of": None})
  assert nulls.status_code == 200, nulls.text
  missing = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL})
  assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages"
  assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage


@pytest.mark.slow
def test_a_client_gone_frees_its_slot(served):
  """Four streams that would run to the context's end take every slot; their clients leave
  after the first chunk: the slots free at once. So does a whole answer's, when its client
  stops waiting."""
  url, client = served

  def slots_free_soon() -> float:
    gone = time.time()
    while time.time() < gone + 30 and httpx.get(f"{url}/health").json()["running"]:
      time.sleep(0.05)
    assert httpx.get(f"{url}/health").json() == {"slots": SLOTS, "running": 0, "waiting": 0}
    return time.time() - gone
  streams = [client.completions.create(model=MODEL, prompt="hello", max_tokens=CONTEXT - 10,
                                       temperature=1.0, seed=i, stream=True,
                                       extra_body={"ignore_eos": True})
             for i in range(SLOTS)]
  for stream in streams:
    next(iter(stream))
  assert httpx.get(f"{url}/health").json()["running"] == SLOTS
  for stream in streams:
    stream.close()
  # Each had ~4000 tokens to go, many seconds; a cancelled one ends at the engine's next step.
  assert slots_free_soon() < 2.0
  with pytest.raises(httpx.TimeoutException):
    httpx.post(f"{url}/v1/completions", timeout=1.0, json={
        "model": MODEL, "prompt": "hello", "max_tokens": CONTEXT - 10, "ignore_eos": True})
  assert slots_free_soon() < 3.0  # Looked for every 0.5 s, after a step that may compile.
  assert client.completions.create(model=MODEL, prompt="hi", max_tokens=3).usage


@pytest.mark.slow
def test_sigterm_finishes_the_running_requests_then_exits_0(hf, tmp_path):
  process, url = start(hf[0], "--nowarm_up")
  client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    running = pool.submit(lambda: (client.completions.create(
        model=MODEL, prompt="hello", max_tokens=1500, temperature=1.0, seed=0), time.time()))
    while httpx.get(f"{url}/health").json()["running"] == 0:
      time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    signalled = time.time()
    finished, answered = running.result(timeout=120)
  # Answered whole after the signal (an EOS may end it before max_tokens).
  assert answered > signalled and finished.usage.completion_tokens > 0
  assert finished.choices[0].finish_reason in ("stop", "length")
  _, stderr = process.communicate(timeout=60)
  assert process.returncode == 0, stderr[-3000:]
  assert f"Serving {MODEL} on {url}/v1" in stderr
  with pytest.raises(httpx.HTTPError):
    httpx.get(f"{url}/v1/models", timeout=2)


def test_a_workdir_with_no_checkpoint_is_one_line(tmp_path):
  result = forkserver.run([sys.executable, "-m", "levanter_flax.commands.serve",
                           f"--workdir={tmp_path}"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert result.stderr.strip().splitlines()[-1] == (
      f"levanter_flax: error: {tmp_path} has no config.json: not a levanter_flax workdir")


def test_completions_end_at_every_eos_id_of_generation_config_as_transformers(hf, tmp_path):
  """A checkpoint whose generation_config.json ends generations at a list of ids (Qwen2.5-
  Instruct's, Llama-3-Instruct's), none of them the tokenizer's <|endoftext|>: each prompt's
  greedy reply equals transformers' generate, which stops at any of them."""
  import shutil
  from fastapi import testclient
  from levanter_flax.generate import server as server_lib
  directory, model = hf
  for path in directory.iterdir():
    shutil.copy(path, tmp_path / path.name)
  tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path /
                                                                      "tokenizer.json"))
  prompts = ["hello there, how are", "abc", "the cat sat", "42 is"]

  def greedy(prompt, ends):
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
      out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                           do_sample=False, eos_token_id=ends, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()
  # The 4th token of each greedy continuation (or <|im_end|>) ends them all.
  ends = sorted({2, *(greedy(p, [])[3] for p in prompts)} - {0})
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
  (tmp_path / "config.json").write_text(json.dumps(
      json.loads((tmp_path / "config.json").read_text()) | {"eos_token_id": 2}))
  expected = []
  for prompt in prompts:
    generated = greedy(prompt, ends)
    stopped = next((i for i, t in enumerate(generated) if t in ends), None)
    expected.append((tokenizer.decode(generated[:stopped]), "length" if stopped is None
                     else "stop"))
  assert all(finish == "stop" for _, finish in expected)
  served = server_lib.load_server("", str(tmp_path), model_name=MODEL, slots=SLOTS, max_len=64)
  served.start(warm_up=False)
  try:
    with testclient.TestClient(server_lib.build_app(served)) as client:
      for prompt, (text, finish) in zip(prompts, expected):
        choice = client.post("/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}).json()[
                "choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (text, finish), prompt
  finally:
    served.stop()


def test_a_tensor_parallel_that_does_not_divide_the_devices_names_the_flag(hf):
  import jax
  from levanter_flax.core.errors import UserError
  from levanter_flax.generate import server as server_lib
  with pytest.raises(UserError, match=f"^--tensor_parallel 3 must divide the "
                                      f"{jax.device_count()} devices$"):
    server_lib.load_server("", str(hf[0]), tensor_parallel=3)


def test_the_cache_dtype_flag_sets_the_engines_cache(hf):
  """--cache_dtype=bfloat16 on a float32 checkpoint: the engine's keys and values are bfloat16."""
  import jax
  import jax.numpy as jnp
  from levanter_flax.generate import server as server_lib
  served = server_lib.load_server("", str(hf[0]), slots=2, max_len=32, cache_dtype="bfloat16")
  assert served.engine.model_cfg.compute.cache_dtype == "bfloat16"
  served.engine.generate([[1, 2, 3]], server_lib.SamplingParams(max_tokens=2, temperature=0))
  floats = {leaf.dtype for leaf in jax.tree.leaves(served.engine._cache)
            if jnp.issubdtype(leaf.dtype, jnp.floating)}
  assert floats == {jnp.dtype(jnp.bfloat16)}
