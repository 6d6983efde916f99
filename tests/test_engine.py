"""The generation engine: greedy equals transformers' generate per family, a request samples the
same alone or among others and in any slot, slots are reused, stops, logprobs, cancelling,
and a mesh."""
import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from levanter_flax import models
from levanter_flax.core.errors import UserError
from levanter_flax.generate import engine as engine_lib
from levanter_flax.generate.engine import Engine, SamplingParams
from levanter_flax.hf import snapshot
from levanter_flax.parallel import partitioning
from test_hf import hf_model
from levanter_flax.models import attention, common
from levanter_flax.models.llama import LlamaConfig
from levanter_flax.models.mistral import MistralConfig
from test_sample import MODELS, full_forward_greedy

GREEDY = SamplingParams(max_tokens=8, temperature=0)
PROMPTS = [[3, 14, 15, 9, 26], [8, 9], [1, 2, 3, 4, 5, 6, 7], [40]]


class ByteText:
  """A tokenizer's decode for the tests: token t is the character chr(ord('a') + t % 26)."""
  def decode(self, ids):
    return "".join(chr(ord("a") + t % 26) for t in ids)


def random_model(name="llama", scale=8.0):
  cfg = MODELS[name]
  params = models.build(cfg).init(jax.random.key(1), jnp.zeros((1, cfg.seq_len), jnp.int32))
  # Larger weights make the next token depend on the context, not only the last token.
  return cfg, jax.tree.map(lambda x: x * scale if x.ndim > 1 else x, params["params"])


@pytest.mark.slow
@pytest.mark.parametrize("family", models.FAMILIES)
def test_greedy_equals_transformers_generate(family, tmp_path):
  """Each family's HF checkpoint: the engine (2 slots for 4 prompts, prefill chunks of 3) gives
  generate(do_sample=False)'s tokens, prompt by prompt."""
  hf = hf_model(family)
  hf.save_pretrained(tmp_path)
  cfg, params = snapshot.load(tmp_path)
  engine = Engine(cfg, params, slots=2, prefill_chunk=3)
  got = engine.generate(PROMPTS, GREEDY)
  for prompt, request in zip(PROMPTS, got):
    with torch.no_grad():
      said = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         pad_token_id=0)[0, len(prompt):].tolist()
    assert request.tokens == said, family
    assert request.finish_reason == "length"


@pytest.mark.parametrize("family,scan_layers,remat", [
    ("gemma3", False, "none"), ("gemma3", True, "none"), ("gemma3", True, "full"),
    ("mistral", True, "none")])
def test_sliding_window_layers_cache_only_their_window(family, scan_layers, remat, tmp_path):
  """Layers with a window of 4 (Gemma 3's local ones, all of Mistral's) keep a ring of 4
  positions, global ones all 16; prefill chunks of 6 (longer than the window) and completions
  past it still give transformers' greedy tokens, scanned or not, with the training config's
  remat or not."""
  hf = hf_model(family)
  hf.save_pretrained(tmp_path)
  cfg, params = snapshot.load(tmp_path, scan_layers=scan_layers)
  cfg = common.with_compute(cfg, remat=remat)
  engine = Engine(cfg, params, slots=2, prefill_chunk=6)
  prompts = [[3, 14, 15, 9, 26, 5, 35], [8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 10, 11]]
  got = engine.generate(prompts, dataclasses.replace(GREEDY, max_tokens=5))
  for prompt, request in zip(prompts, got):
    with torch.no_grad():
      said = hf.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    assert request.tokens == said
  lengths = [leaf.shape[-2] for path, leaf in jax.tree_util.tree_leaves_with_path(engine._cache)
             if path[-1].key == "keys"]
  windowed = [not g for g in cfg.global_layers] if family == "gemma3" else [True]
  assert lengths == [4 if w else 16 for w in windowed]


def windowed_model():
  """A window of 80 in a context of 160: longer than the shortest rows (64)."""
  cfg = MistralConfig(vocab_size=50, seq_len=160, num_layers=2, num_heads=4, num_kv_heads=2,
                      hidden_dim=16, intermediate_dim=24, sliding_window=80)
  model = models.build(cfg)
  params = jax.tree.map(lambda x: x * 8.0 if x.ndim > 1 else x, model.init(
      jax.random.key(1), jnp.zeros((1, cfg.seq_len), jnp.int32))["params"])
  return cfg, model, params


def test_the_cache_grows_and_shrinks_with_the_live_requests():
  """Rows of 64 (the ring's first 64 slots), grown to 128 (the whole ring of 80, wrapping) for a
  long request, cut back to 64 once it ends while a short one goes on: greedy equals the full
  forward's for both."""
  cfg, model, params = windowed_model()
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 50, 100).tolist(), rng.integers(0, 50, 10).tolist()]
  engine = Engine(cfg, params, slots=2, prefill_chunk=16)
  requests = [engine.submit(prompts[0], dataclasses.replace(GREEDY, max_tokens=10)),
              engine.submit(prompts[1], dataclasses.replace(GREEDY, max_tokens=40))]
  lengths = []
  while engine.busy:
    engine.step()
    lengths.append(engine._length)
  assert lengths[0] == 64 and 128 in lengths and lengths[-1] == 64
  assert [leaf.shape[-2] for leaf in jax.tree.leaves(engine._cache) if leaf.ndim == 4] == [64] * 4
  for prompt, request in zip(prompts, requests):
    assert request.tokens == full_forward_greedy(model, params, prompt, len(request.tokens))
  assert [len(r.tokens) for r in requests] == [10, 40]


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "gemma3_scanned", "deepseek_v3"])
def test_a_bfloat16_cache_keeps_the_float32_caches_greedy_tokens_in_half_the_bytes(name):
  """A float32 model decoding on a bfloat16 cache (compute.cache_dtype): its keys and values
  (a ring where windowed, DeepSeek's latents) rounded to 8 bits of mantissa, the same greedy
  tokens as the float32 cache's for 4 prompts x 16 tokens, with the cache's entries at half
  the bytes. The tokens may part only where the float32 model's two candidates lie within
  0.01 of each other in logit (Gemma 3's soft-capped logits part on one prompt of 4, at its
  first token, whose two candidates are 0.004 apart)."""
  cfg, params = random_model(name)
  sampling = dataclasses.replace(GREEDY, max_tokens=16)
  engines = {dtype: Engine(common.with_compute(cfg, cache_dtype=dtype), params, slots=4,
                           prefill_chunk=4) for dtype in ("auto", "bfloat16")}
  tokens = {dtype: [r.tokens for r in engine.generate(PROMPTS, sampling)]
            for dtype, engine in engines.items()}
  model = models.build(cfg)
  for prompt, exact, rounded in zip(PROMPTS, tokens["auto"], tokens["bfloat16"]):
    if exact != rounded:
      at = next(i for i, (a, b) in enumerate(zip(exact, rounded)) if a != b)
      logits = model.apply({"params": params}, jnp.asarray([prompt + exact[:at]]))[0, -1]
      assert abs(float(logits[exact[at]] - logits[rounded[at]])) < 0.01, (prompt, at)
  assert sum(a == b for a, b in zip(tokens["auto"], tokens["bfloat16"])) >= 3
  entries = {dtype: [leaf for leaf in jax.tree.leaves(engine._cache)
                     if jnp.issubdtype(leaf.dtype, jnp.floating)]
             for dtype, engine in engines.items()}
  assert {leaf.dtype for leaf in entries["auto"]} == {jnp.dtype(jnp.float32)}
  assert {leaf.dtype for leaf in entries["bfloat16"]} == {jnp.dtype(jnp.bfloat16)}
  assert (sum(leaf.nbytes for leaf in entries["bfloat16"]) * 2
          == sum(leaf.nbytes for leaf in entries["auto"]) > 0)


@pytest.mark.parametrize("name", ["gpt2", "mistral", "gemma3", "gemma3_scanned", "deepseek_v3"])
def test_a_decode_steps_write_on_a_tpu_is_the_scatters(name, monkeypatch):
  """On a TPU a decode step selects each row's new keys and values into the cache rather than
  scatter them (attention._write): the same cache, to the bit, and the same greedy tokens as
  the scatter's, whole rows, rings (Mistral's, unscanned Gemma 3's local layers), traced
  windows (scanned Gemma 3's) and latents (DeepSeek's) alike."""
  cfg, params = random_model(name)
  sampling = dataclasses.replace(GREEDY, max_tokens=8)
  runs = []
  for platform in ("cpu", "tpu"):
    monkeypatch.setattr(attention, "platform_in_context", lambda: platform)
    engine = Engine(cfg, params, slots=4, prefill_chunk=4)
    runs.append(([r.tokens for r in engine.generate(PROMPTS, sampling)], engine._cache))
  (scattered, scatter_cache), (selected, select_cache) = runs
  assert selected == scattered
  jax.tree.map(np.testing.assert_array_equal, select_cache, scatter_cache)


@pytest.mark.slow
def test_a_decode_step_compiled_for_a_tpu_copies_no_cache(monkeypatch):
  """The decode step's forward compiled for a v5e chip (Engine.lowered_decode_forward, as
  bench/decode_roofline.py --topology does): no scatter, and no layer's keys or values copied
  to another layout, which XLA does around the scatter (traced as for a CPU, the control)."""
  pytest.importorskip("libtpu")
  from levanter_flax.plan import slices
  device = slices.devices("v5e:1x1")[0]
  cfg = LlamaConfig(vocab_size=256, seq_len=256, num_layers=2, num_heads=4, num_kv_heads=2,
                    hidden_dim=256, intermediate_dim=512, compute=common.ComputeConfig(
                        dtype="bfloat16", param_dtype="bfloat16"))
  replicated = jax.NamedSharding(jax.sharding.Mesh(np.array([device]), ("data",)), jax.P())
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                        jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0))))
  engine = Engine(cfg, None, slots=16, prefill_chunk=64)

  def scatters_and_cache_copies():
    text = engine.lowered_decode_forward(params, 256, replicated).compile().as_text()
    return (" scatter(" in text, any("= bf16[16,2,256,64]" in line and " copy(" in line
                                     for line in text.splitlines()))
  assert scatters_and_cache_copies() == (False, False)
  monkeypatch.setattr(attention, "platform_in_context", lambda: "cpu")
  assert scatters_and_cache_copies() == (True, True)


def test_32_requests_on_4_slots_equal_each_alone():
  """Greedy and seeded sampling, 32 requests of different lengths through 4 slots: the same
  tokens as each request alone on an engine of its own; the slots are reused."""
  cfg, params = random_model()
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.vocab_size, rng.integers(1, 12)).tolist() for _ in range(32)]
  samplings = [SamplingParams(max_tokens=int(rng.integers(1, 9)), seed=i,
                              temperature=0.0 if i % 2 else 0.9, top_k=int(i % 3) * 5)
               for i in range(32)]
  shared = Engine(cfg, params, slots=4, prefill_chunk=4)
  together = shared.generate(prompts, samplings)
  assert not shared.busy
  alone = Engine(cfg, params, slots=4, prefill_chunk=4)
  for prompt, sampling, request in zip(prompts, samplings, together):
    assert alone.generate([prompt], sampling)[0].tokens == request.tokens
    assert len(request.tokens) == sampling.max_tokens


def test_a_seeded_request_samples_the_same_alone_or_among_15_others():
  cfg, params = random_model()
  sampling = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
  engine = Engine(cfg, params, slots=16, prefill_chunk=8)
  alone = engine.generate([PROMPTS[0]], sampling)[0]
  others = [SamplingParams(max_tokens=12, temperature=1.0, seed=100 + i) for i in range(15)]
  # Its own place last, so that it lands in another slot than when alone.
  crowd = engine.generate(PROMPTS[1:2] * 15 + [PROMPTS[0]], others + [sampling])
  assert crowd[-1].tokens == alone.tokens
  # A prefill of 16 rows, not 1: another program, the same numbers but for rounding.
  np.testing.assert_allclose(crowd[-1].logprobs, alone.logprobs, atol=1e-5)
  assert len({tuple(r.tokens) for r in crowd[:15]}) > 1  # Their seeds differ: so do they.
  again = engine.generate([PROMPTS[0]], dataclasses.replace(sampling, seed=8))[0]
  assert again.tokens != alone.tokens


def test_logprobs_are_the_models_own():
  """Each token's log-probability under the full forward's logits at its position."""
  cfg, params = random_model()
  model = models.build(cfg)
  request = Engine(cfg, params, slots=2).generate(
      [PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0.7, seed=1))[0]
  sequence = jnp.asarray([PROMPTS[0] + request.tokens])
  logprobs = jax.nn.log_softmax(model.apply({"params": params}, sequence)[0], axis=-1)
  start = len(PROMPTS[0]) - 1
  expected = [float(logprobs[start + i, t]) for i, t in enumerate(request.tokens)]
  np.testing.assert_allclose(request.logprobs, expected, atol=1e-5)


def test_stop_ids_stop_strings_and_the_context_end():
  cfg, params = random_model()
  engine = Engine(cfg, params, slots=2, tokenizer=ByteText())
  free = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=10, temperature=0))[0]
  assert free.finish_reason == "length" and free.text == ByteText().decode(free.tokens)
  by_id = engine.generate([PROMPTS[0]], dataclasses.replace(GREEDY, max_tokens=10,
                                                            stop_ids=(free.tokens[3],)))[0]
  assert by_id.finish_reason == "stop" and by_id.stop_id == free.tokens[3]
  assert by_id.tokens == free.tokens[:free.tokens.index(free.tokens[3])]  # Left out.
  assert free.stop_id is None
  stop = free.text[4:6]
  by_text = engine.generate([PROMPTS[0]], dataclasses.replace(GREEDY, max_tokens=10,
                                                              stop=("zzzz", stop)))[0]
  assert by_text.finish_reason == "stop" and by_text.text == free.text[:free.text.index(stop)]
  # The context's end (seq_len 24) comes before max_tokens.
  full = engine.generate([list(range(1, 21))], dataclasses.replace(GREEDY, max_tokens=10))[0]
  assert full.finish_reason == "length" and len(full.tokens) == 4


def penalized_greedy(forward, prompt, count, presence=0.0, frequency=0.0, bias=()):
  """OpenAI's penalties and logit bias in NumPy, on the full forward's logits at each step.
  `forward` takes [len(prompt) + count] tokens: causal, a position's logits ignore the padding
  after it, and one compiled shape serves every step."""
  tokens = []
  for _ in range(count):
    sequence = prompt + tokens
    logits = np.asarray(forward(sequence + [0] * (count - len(tokens)))[len(sequence) - 1],
                        np.float64)
    for token, value in bias:
      logits[token] += value
    counts = np.bincount(tokens, minlength=logits.size)
    tokens.append(int(np.argmax(logits - presence * (counts > 0) - frequency * counts)))
  return tokens


def test_logit_bias_and_penalties_equal_numpys_per_request_and_leave_the_slot_clean():
  """Six greedy requests through 2 slots, each with its own penalties and bias: each equals
  the NumPy reference, the plain ones after a penalized one in the same slot equal plain
  greedy, the settings change the tokens, and the log-probabilities stay the model's."""
  cfg, params = random_model()
  model = models.build(cfg)
  settings = [dict(frequency=0.5), dict(), dict(presence=1.0), dict(),
              dict(bias=((7, 3.0), (25, -100.0)), frequency=1.0), dict(presence=-2.0)]
  prompt = [5, 6, 7]
  samplings = [dataclasses.replace(GREEDY, max_tokens=10, presence_penalty=s.get("presence", 0.0),
                                   frequency_penalty=s.get("frequency", 0.0),
                                   logit_bias=s.get("bias", ())) for s in settings]
  # Chunks of 2: the bias and penalties are set at a prompt's first chunk, drawn from at its last.
  requests = Engine(cfg, params, slots=2, prefill_chunk=2).generate([prompt] * 6, samplings)
  apply = jax.jit(lambda tokens: model.apply({"params": params}, tokens[None])[0])
  forward = lambda tokens: apply(jnp.asarray(tokens))
  for request, setting in zip(requests, settings):
    assert request.tokens == penalized_greedy(forward, prompt, 10, **setting)
  plain = requests[1].tokens
  assert requests[3].tokens == plain
  assert all(requests[i].tokens != plain for i in (0, 2, 4, 5))
  assert 25 in plain and 25 not in requests[4].tokens
  logprobs = jax.nn.log_softmax(forward(prompt + requests[4].tokens), axis=-1)
  start = len(prompt) - 1
  np.testing.assert_allclose(
      requests[4].logprobs, [float(logprobs[start + i, t]) for i, t in enumerate(requests[4].tokens)],
      atol=1e-5)


def test_decode_steps_dispatched_together_generate_as_one_at_a_time():
  """Several decode steps per host read (each fed the one before's tokens on the device)
  generate what one step at a time does: sampled and penalized requests, stops by id and
  string and at the context's end within the steps, slots reused by waiting requests."""
  cfg, params = random_model()
  prompts = [PROMPTS[i % 4] for i in range(7)] + [list(range(1, 21))]
  base = SamplingParams(max_tokens=9, temperature=0.9, seed=3)
  samplings = [dataclasses.replace(base, seed=i, max_tokens=3 + i if i < 7 else 10,
                                   frequency_penalty=0.5 * (i % 2), stop_ids=(9,) if i == 2 else (),
                                   stop=("q",) if i == 5 else ()) for i in range(len(prompts))]
  runs = []
  for decode_steps in (1, 5):
    engine = Engine(cfg, params, slots=3, prefill_chunk=4, decode_steps=decode_steps,
                    tokenizer=ByteText())
    runs.append([(r.tokens, r.finish_reason, r.logprobs)
                 for r in engine.generate(prompts, samplings)])
  one, together = runs
  assert [(t, f) for t, f, _ in together] == [(t, f) for t, f, _ in one]
  for (_, _, a), (_, _, b) in zip(one, together):
    np.testing.assert_allclose(b, a, atol=1e-6)
  assert {f for _, f, _ in one} == {"stop", "length"}
  # Steps dispatched together that cross from rows of 64 to 128: the rows grow before them.
  long = dataclasses.replace(cfg, seq_len=128)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (60, 57)]
  grown = [Engine(long, params, slots=2, decode_steps=steps).generate(
      prompts, dataclasses.replace(base, max_tokens=20)) for steps in (1, 8)]
  for alone, together in zip(*grown):
    assert together.tokens == alone.tokens and len(alone.tokens) == 20
    np.testing.assert_allclose(together.logprobs, alone.logprobs, atol=1e-6)


def test_a_cancelled_request_frees_its_slot_at_once():
  cfg, params = random_model()
  engine = Engine(cfg, params, slots=1)
  endless = engine.submit(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0))
  waiting = engine.submit(PROMPTS[1], GREEDY)
  engine.step()
  engine.step()  # The prompt's token, then decode_steps more.
  assert len(endless.tokens) == 1 + engine.decode_steps and not waiting.tokens
  engine.cancel(endless)
  engine.step()
  assert endless.finish_reason == "cancelled" and len(endless.tokens) == 1 + engine.decode_steps
  assert waiting.tokens  # It took the slot in the same step.
  while not waiting.finished:
    engine.step()
  assert waiting.tokens == Engine(cfg, params, slots=1).generate([PROMPTS[1]], GREEDY)[0].tokens


@pytest.mark.slow
def test_warm_up_compiles_every_shape_and_writes_nothing():
  """After warm_up, requests of every length and count compile nothing (no step, no resize of
  the rows), and generate what a cold engine does."""
  cfg, _, params = windowed_model()
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (150, 3, 70, 20, 130, 5, 40)]
  sampling = SamplingParams(max_tokens=4, temperature=0.5, seed=3)
  warm = Engine(cfg, params, slots=2, prefill_chunk=32)
  # Rows of 64, 128 and 160 (the context); prefills of 1 and 2 rows, and the decode.
  assert warm.warm_up() == 3 * (2 + 1)
  # The sampler (its sort over the vocabulary is most of a TPU compile) once per row count.
  assert sorted(warm._samplers, key=str) == [1, 2, None]  # pylint: disable=protected-access
  # pylint: disable=protected-access
  compiled = lambda: (warm._compiled(), engine_lib._fitted._cache_size(),
                      # Each sampler's programs: a decode step fed the one before's device
                      # arrays compiles none more than one fed the host's.
                      sorted((str(rows), s._cache_size()) for rows, s in warm._samplers.items()))
  # pylint: enable=protected-access
  before = compiled()
  tokens = [r.tokens for r in warm.generate(prompts, sampling.apart(7))]
  assert compiled() == before
  cold = Engine(cfg, params, slots=2, prefill_chunk=32)
  assert tokens == [r.tokens for r in cold.generate(prompts, sampling.apart(7))]


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(monkeypatch):
  """serve_forever, as a server runs it: a step that raises ends the requests it held with
  'error' (its donated cache dropped), and the next request generates as on a fresh engine."""
  cfg, params = random_model()
  engine = Engine(cfg, params, slots=2)
  stopped = threading.Event()
  thread = threading.Thread(target=engine.serve_forever, args=(stopped,), daemon=True)
  decode = engine._decode_steps  # pylint: disable=protected-access

  def fails_once(requests, steps):
    monkeypatch.setattr(engine, "_decode_steps", decode)
    raise RuntimeError("injected")
  monkeypatch.setattr(engine, "_decode_steps", fails_once)
  thread.start()
  failed = [engine.submit(p, GREEDY) for p in PROMPTS[:2]]
  assert all(r.wait(60) for r in failed) and {r.finish_reason for r in failed} == {"error"}
  after = engine.submit(PROMPTS[0], GREEDY)
  assert after.wait(60) and after.finish_reason == "length"
  stopped.set()
  engine.wake()
  thread.join(60)
  assert after.tokens == Engine(cfg, params, slots=2).generate([PROMPTS[0]], GREEDY)[0].tokens


@pytest.mark.parametrize("sampling, message", [
    (SamplingParams(max_tokens=0), "max_tokens must be positive; got 0"),
    (SamplingParams(temperature=float("nan")), "temperature must be >= 0 and finite; got nan"),
    (SamplingParams(top_p=1.5), "top_p must be in \\[0, 1\\]; got 1.5"),
    (SamplingParams(top_k=51), "top_k 51 exceeds the model's vocabulary of 50 tokens"),
    (SamplingParams(seed=-1), "seed must be in \\[0, 2\\*\\*32\\); got -1"),
    (SamplingParams(stop=("x",)), "stop strings need the engine's tokenizer"),
    (SamplingParams(presence_penalty=2.5), "presence_penalty must be in \\[-2, 2\\]; got 2.5"),
    (SamplingParams(frequency_penalty=float("nan")), "frequency_penalty must be in"),
    (SamplingParams(logit_bias=((50, 1.0),)),
     "logit_bias names token 50, outside the model's vocabulary \\[0, 50\\)"),
    (SamplingParams(logit_bias=((3, -101.0),)),
     "logit_bias of token 3 must be in \\[-100, 100\\]; got -101.0"),
    (SamplingParams(logit_bias=tuple((i % 50, 1.0) for i in range(301))),
     "logit_bias holds 301 tokens; at most 300 may be biased"),
])
def test_bad_requests_are_refused_in_one_line(sampling, message):
  cfg, params = random_model()
  engine = Engine(cfg, params, slots=1)
  with pytest.raises(UserError, match=message):
    engine.submit(PROMPTS[0], sampling)
  with pytest.raises(UserError, match="a prompt of 24 tokens leaves no room to generate in the "
                                      "context of 24 tokens"):
    engine.submit(list(range(24)), GREEDY)
  with pytest.raises(UserError, match="a prompt is empty"):
    engine.submit([], GREEDY)
  assert not engine.busy


@pytest.mark.slow
def test_a_mesh_of_8_devices_generates_as_one_device():
  """data=4 x model=2: the cache's slots split over data, its heads over model; the params
  tensor-parallel. The same tokens as one device, greedy and sampled, plain and penalized."""
  cfg, params = random_model()
  samplings = [SamplingParams(max_tokens=6, temperature=0.0 if i % 2 else 0.8, seed=i,
                              frequency_penalty=0.5 * (i // 2), logit_bias=((7, 1.0),) * (i // 2))
               for i in range(len(PROMPTS))]
  single = [r.tokens for r in Engine(cfg, params, slots=8).generate(PROMPTS, samplings)]
  mesh = partitioning.make_mesh((("data", 4), ("model", 2)))
  partitioner = partitioning.Partitioner(mesh, partitioning.ShardingConfig(
      rules=models.family(cfg).partition_rules))
  with partitioner.activation_context():
    engine = Engine(cfg, params, slots=8, param_shardings=partitioner.param_shardings(params),
                    batch_sharding=partitioner.batch_sharding())
    sharded = [r.tokens for r in engine.generate(PROMPTS, samplings)]
    cache = engine._cache  # pylint: disable=protected-access
    keys = cache["layers_0"]["self_attn"]["keys"]  # [slots, kv heads, length, head_dim]
    assert keys.sharding.spec == jax.sharding.PartitionSpec("data", "model", None, None)
  assert sharded == single


def test_the_decode_rooflines_bytes_are_the_engines_cache_and_the_weights_read():
  """bench/decode_roofline.py's accounting: its bytes per cached token times the rows are the
  engine's cache (bfloat16 and float32), and a step reads an untied input embedding's slots'
  rows only."""
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).parents[1] / "bench" / "decode_roofline.py"
  spec = importlib.util.spec_from_file_location("decode_roofline", path)
  roofline = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(roofline)
  for cache_dtype in ("auto", "float32"):
    cfg, params = roofline.model("tiny", 48, cache_dtype)
    engine = Engine(cfg, params, slots=4, prefill_chunk=16)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=1, temperature=0))
    cache = sum(leaf.nbytes for leaf in jax.tree.leaves(engine._cache)
                if jnp.issubdtype(leaf.dtype, jnp.floating))
    assert cache == 4 * engine._length * roofline.cache_bytes_per_token(cfg)
  table = params["embed_tokens"]["embedding"]
  every = sum(x.nbytes for x in jax.tree.leaves(params))
  assert not cfg.tie_word_embeddings
  assert roofline.weight_bytes_read(cfg, params, 4) == every - table.nbytes + 4 * table[0].nbytes
  tied = dataclasses.replace(cfg, tie_word_embeddings=True)
  assert roofline.weight_bytes_read(tied, params, 4) == every
