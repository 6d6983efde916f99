"""Sampling on a KV cache: greedy equals the full forward's argmax, filters, prompts, the CLI."""
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import forkserver
from conftest import REPO, make_tiny_config, taken_up, xla_flags
from levanter_flax import models
from levanter_flax.generate.trained import run_params
from levanter_flax.config import to_run_config
from levanter_flax.core.errors import UserError
from levanter_flax.models.common import ComputeConfig
from levanter_flax.models.gpt2 import GPT2Config
from levanter_flax.models.llama import LlamaConfig
from levanter_flax.models.mistral import MistralConfig
from levanter_flax.models.olmo2 import Olmo2Config
from levanter_flax.models.gemma3 import Gemma3Config
from levanter_flax.models.qwen3 import Qwen3Config
from levanter_flax.models.deepseek_v3 import DeepseekV3Config
from levanter_flax.models.lora import LoraConfig
from levanter_flax.models.moe import MoeConfig
from levanter_flax.data.tokenizers import ByteTokenizer
from levanter_flax.generate.engine import SamplingParams, sample_tokens
from levanter_flax.generate.prompts import encode, generate
from levanter_flax.training.loop import train_and_evaluate

MODELS = {
    "gpt2": GPT2Config(vocab_size=50, seq_len=24, num_layers=2, num_heads=2, hidden_dim=16),
    "llama": LlamaConfig(vocab_size=50, seq_len=24, num_layers=2, num_heads=4, num_kv_heads=2,
                         hidden_dim=16, intermediate_dim=24),
    "llama_scanned": LlamaConfig(vocab_size=50, seq_len=24, num_layers=2, num_heads=4,
                                 num_kv_heads=2, hidden_dim=16, intermediate_dim=24,
                                 compute=ComputeConfig(scan_layers=True)),
    # A window shorter than the prompts: the cache must forget as training does.
    "mistral": MistralConfig(vocab_size=50, seq_len=24, num_layers=2, num_heads=4,
                             num_kv_heads=2, hidden_dim=16, intermediate_dim=24, sliding_window=3),
    # QK-norm, and heads of 6 on a width of 16: the cache holds head_dim, not hidden / heads.
    "qwen3": Qwen3Config(vocab_size=50, seq_len=24, num_layers=2, num_heads=4, num_kv_heads=2,
                         hidden_dim=16, intermediate_dim=24, head_dim=6),
    # Norms after the sublayers, QK-norm over the whole projection.
    "olmo2": Olmo2Config(vocab_size=50, seq_len=24, num_layers=2, num_heads=4, num_kv_heads=2,
                         hidden_dim=16, intermediate_dim=24),
    # Local (a window of 3, shorter than the prompts) and global layers, the final soft-cap;
    # scanned, each layer's kind is traced and picks its mask on the cache.
    **{name: Gemma3Config(vocab_size=50, seq_len=24, num_layers=3, num_heads=4, num_kv_heads=2,
                          hidden_dim=16, intermediate_dim=24, head_dim=6, sliding_window=3,
                          sliding_window_pattern=2, final_logit_softcapping=5.0,
                          compute=ComputeConfig(scan_layers=scan))
       for name, scan in (("gemma3", False), ("gemma3_scanned", True))},
    # Latent attention: the cache holds the latents and RoPE keys, attended in the latent space.
    **{name: DeepseekV3Config(
        vocab_size=50, seq_len=24, num_layers=2, num_heads=4, num_kv_heads=4, hidden_dim=16,
        intermediate_dim=24, q_lora_rank=q_lora_rank, kv_lora_rank=8, qk_nope_head_dim=6,
        qk_rope_head_dim=4, v_head_dim=5, first_dense_layers=1,
        moe=MoeConfig(num_experts=4, num_experts_per_token=2, scoring="sigmoid", num_groups=2,
                      top_groups=1, expert_dim=8, num_shared_experts=1),
        compute=ComputeConfig(scan_layers=scan))
       for name, q_lora_rank, scan in (("deepseek_v3", 12, False),
                                       ("deepseek_v3_scanned", 0, True))},
}
PROMPTS = [[3, 14, 15, 9, 26, 5, 35], [8, 9]]  # Different lengths, each slot at its own.


def full_forward_greedy(model, params, prompt, steps):
  """The reference: the whole sequence through the model again for every new token.

  Padded at the end to seq_len, so one compilation serves every length: a causal
  model's logits at a position never see the tokens after it.
  """
  forward = jax.jit(lambda tokens: model.apply({"params": params}, tokens))
  sequence = np.zeros((1, model.config.seq_len), np.int32)
  sequence[0, :len(prompt)] = prompt
  for position in range(len(prompt), len(prompt) + steps):
    sequence[0, position] = int(jnp.argmax(forward(jnp.asarray(sequence))[0, position - 1]))
  return sequence[0, len(prompt):len(prompt) + steps].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_greedy_decoding_on_the_cache_equals_the_full_forward_argmax(name):
  cfg = MODELS[name]
  model = models.build(cfg)
  params = model.init(jax.random.key(1), jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]
  # Larger weights make the argmax depend on the context, not only the last token.
  params = jax.tree.map(lambda x: x * 8 if x.ndim > 1 else x, params)
  got = generate(cfg, params, PROMPTS, SamplingParams(max_tokens=10, temperature=0))
  for prompt, continuation in zip(PROMPTS, got):
    assert continuation == full_forward_greedy(model, params, prompt, 10)


@pytest.mark.slow
def test_deepseeks_absorbed_decoding_takes_lora_adapters_on_kv_b_proj():
  """The latent cache's attention multiplies by kv_b_proj's kernel itself: its LoRA adapters
  (nonzero here) must be in it, as the full forward's Dense applies them."""
  cfg = dataclasses.replace(MODELS["deepseek_v3"], lora=LoraConfig(rank=2, targets="kv_b_proj"))
  model = models.build(cfg)
  params = model.init(jax.random.key(1), jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]
  params = jax.tree.map(lambda x: x * 8 if x.ndim > 1 else x, params)
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.5 if path[-1].key == "lora_b" else x, params)
  got = generate(cfg, params, PROMPTS[:1], SamplingParams(max_tokens=6, temperature=0))
  assert got[0] == full_forward_greedy(model, params, PROMPTS[0], 6)


def test_deepseeks_cache_holds_the_latents_not_the_heads_keys_and_values():
  cfg = MODELS["deepseek_v3"]
  cache = jax.eval_shape(models.build(cfg, decode=True).init, jax.random.key(0),
                         jnp.zeros((2, cfg.seq_len), jnp.int32))["cache"]
  for layer in ("layers_0", "layers_1"):
    shapes = {name: x.shape for name, x in cache[layer]["self_attn"].items()}
    assert shapes == {"latents": (2, 24, cfg.kv_lora_rank), "rope_keys": (2, 24, 4),
                      "index": (2,)}


def test_top_k_and_top_p_keep_only_the_likeliest_tokens():
  """Each row with its own settings: 300 rows of the same logits, one key each."""
  logits = jnp.log(jnp.tile(jnp.array([[0.5, 0.3, 0.15, 0.05]]), (300, 1)))
  keys = jax.random.split(jax.random.key(0), 300)

  def draw(temperature=1.0, top_k=0, top_p=1.0):
    full = lambda value, dtype: jnp.full(300, value, dtype)
    tokens, logprobs = sample_tokens(logits, full(temperature, jnp.float32),
                                     full(top_k, jnp.int32), full(top_p, jnp.float32), keys)
    # The log-probability is the model's own, whatever the filters.
    np.testing.assert_allclose(logprobs, np.log([0.5, 0.3, 0.15, 0.05])[tokens], rtol=1e-6)
    return set(np.asarray(tokens).tolist())
  assert draw() == {0, 1, 2, 3}
  assert draw(top_k=2) == {0, 1}
  assert draw(top_p=0.7) == {0, 1}  # 0.5 < 0.7 <= 0.8.
  assert draw(top_p=0.5) == {0}
  assert draw(top_k=3, top_p=0.9) == {0, 1, 2}
  assert draw(temperature=0, top_k=3) == {0}


def test_a_top_k_beyond_the_vocabulary_is_refused():
  cfg = MODELS["gpt2"]
  params = models.build(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
  with pytest.raises(UserError, match=r"--top_k 51 exceeds the model's vocabulary of 50 tokens; "
                                      r"use at most 50, or 0 for no limit"):
    generate(cfg, params, PROMPTS, SamplingParams(max_tokens=2, top_k=51))
  assert len(generate(cfg, params, PROMPTS, SamplingParams(max_tokens=2, top_k=50))[0]) == 2


def test_a_prompt_too_long_is_refused_or_truncated():
  cfg = MODELS["gpt2"]
  params = models.build(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
  long_prompt = [list(range(1, 21))]
  with pytest.raises(UserError, match=r"a prompt of 20 tokens plus max_new_tokens 8 exceeds the "
                                      r"model's seq_len 24; .* --long_prompt=truncate to keep its "
                                      r"last 16 tokens"):
    generate(cfg, params, long_prompt, SamplingParams(max_tokens=8, temperature=0))
  truncated = generate(cfg, params, long_prompt,
                       SamplingParams(max_tokens=8, temperature=0), "truncate")
  assert truncated == generate(cfg, params, [list(range(5, 21))],
                               SamplingParams(max_tokens=8, temperature=0))


@pytest.mark.slow
def test_the_command_line_samples_from_a_run(two_steps, tmp_path):
  """Trained on 8 devices, sampled on a machine with one."""
  taken_up(two_steps, tmp_path)
  one_device = {**os.environ, "XLA_FLAGS": xla_flags(1)}
  result = forkserver.run([sys.executable, "-m", "levanter_flax.commands.sample",
                           f"--workdir={tmp_path}",
                           "--prompt=def ", "--prompt=import os", "--prompt=", "--max_new_tokens=6",
                           "--temperature=0"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=one_device)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "--- 'def '\ndef " in result.stdout and "--- 'import os'\nimport os" in result.stdout
  assert "--- ''\n" in result.stdout  # After the EOS alone: a new document.
  missing = forkserver.run([sys.executable, "-m", "levanter_flax.commands.sample",
                            f"--workdir={tmp_path / 'nothing'}", "--prompt=x"], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
  assert missing.returncode == 1
  assert missing.stderr.strip().splitlines()[-1] == (
      f"levanter_flax: error: {tmp_path / 'nothing'} has no config.json: not a levanter_flax workdir")
  too_many = forkserver.run([sys.executable, "-m", "levanter_flax.commands.sample",
                             f"--workdir={tmp_path}",
                             "--prompt=x", "--top_k=100000"], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
  assert too_many.returncode == 1 and "Traceback" not in too_many.stderr, too_many.stderr[-3000:]
  assert too_many.stderr.strip().splitlines()[-1].startswith(
      "levanter_flax: error: --top_k 100000 exceeds the model's vocabulary of ")


def test_prompts_follow_an_eos_as_every_training_document_did():
  tokenizer = ByteTokenizer()
  assert encode(tokenizer, ["ab", ""], bos=True) == [[tokenizer.eos_id, 97, 98], [tokenizer.eos_id]]
  assert encode(tokenizer, ["ab"], bos=False) == [[97, 98]]


def test_a_prompt_that_is_not_utf8_is_one_line(tmp_path):
  """As a shell passes --prompt=$'\\xff': bytes, which Python holds as a lone surrogate."""
  result = forkserver.run([sys.executable, "-m", "levanter_flax.commands.sample",
                           f"--workdir={tmp_path}",
                           b"--prompt=ab\xff"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert result.stderr.strip().splitlines()[-1] == (
      "levanter_flax: error: --prompt b'ab\\xff' is not UTF-8 text (byte 2, 0xff: invalid start "
      "byte)")


@pytest.fixture(scope="module")
def four_steps(data_cache, tmp_path_factory):
  """tiny_config's run of 4 steps, checkpointed at 2 and 4."""
  config = make_tiny_config(data_cache)
  config.trainer.num_train_steps = 4
  config.checkpoint.every_steps = 2
  workdir = tmp_path_factory.mktemp("four_steps") / "run"
  train_and_evaluate(to_run_config(config), workdir)
  return workdir


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # Abandoned reads.
@pytest.mark.parametrize("damage", ["cut_array_data", "no_tree_metadata"])
def test_sample_and_export_read_the_newest_readable_checkpoint(four_steps, tmp_path, caplog,
                                                               damage):
  taken_up(four_steps, tmp_path)
  _, params_2, _ = run_params_of_step(tmp_path, 2)
  newest = tmp_path / "checkpoints" / "4"
  if damage == "cut_array_data":  # Every data file: the params' among them, wherever they are.
    for data in (p for p in newest.rglob("*") if p.is_file() and p.parent.name == "d"):
      data.write_bytes(data.read_bytes()[:20])
  else:
    (newest / "state" / "_METADATA").unlink()
  _, params, _ = run_params(tmp_path)
  assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(params))  # On the host.
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params),
                                                  jax.tree.leaves(params_2)))
  assert f"Checkpoint {newest} is damaged" in caplog.text
  assert newest.is_dir()  # Read-only tools leave it where it is.


def run_params_of_step(workdir, step):
  """run_params as if `step` were the newest: the later checkpoints moved away for a moment."""
  later = sorted(p for p in (workdir / "checkpoints").iterdir() if int(p.name) > step)
  for path in later:
    path.rename(path.with_name(f"hidden-{path.name}"))
  try:
    return run_params(workdir)
  finally:
    for path in later:
      path.with_name(f"hidden-{path.name}").rename(path)
