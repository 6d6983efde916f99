"""README's "Fine-tune a Hugging Face model", command for command, on a tiny seeded Qwen2: chat
data prepared with the checkpoint's tokenizer, SFT from the checkpoint with the shipped config,
a chat reply sampled, and an export that transformers serves alone."""
import json
import os
import shutil
import sys

import pytest

import forkserver
from conftest import REPO, read_metrics, xla_flags
from test_chat import conversation, make_tokenizer, write_jsonl

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

SEQ_LEN = 64  # The run's context; the rest of the shape is the checkpoint's config.json's.


def tiny_qwen2(directory, tokenizer_dir) -> None:
  """A seeded Qwen2 checkpoint in the layout of a hub snapshot: weights, config, tokenizer."""
  torch.manual_seed(0)
  model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
      vocab_size=320, hidden_size=32, intermediate_size=64,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      max_position_embeddings=SEQ_LEN, rope_theta=1e6, tie_word_embeddings=True))
  model.save_pretrained(directory)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(tokenizer_dir / name, directory / name)


def run(*argv):
  result = forkserver.run([sys.executable, "-m", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "XLA_FLAGS": xla_flags(1)})
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


@pytest.mark.slow
def test_the_readmes_fine_tuning_path_runs_end_to_end(tmp_path):
  model_dir = tmp_path / "Qwen2-tiny"
  make_tokenizer(tmp_path / "tokenizer")
  tiny_qwen2(model_dir, tmp_path / "tokenizer")
  chats = write_jsonl(tmp_path / "chats.jsonl", [
      conversation(f"question {i}", f"answer {i} hello there, how are you") for i in range(60)])
  tokenizer = str(model_dir / "tokenizer.json")

  run("levanter_flax.commands.prepare", "--source=chat", f"--input={chats}",
      f"--tokenizer={tokenizer}",
      f"--output_dir={tmp_path / 'data'}", "--num_shards=1", "--validation_fraction=0.2",
      "--num_workers=1")
  workdir = tmp_path / "runs" / "sft"
  run("levanter_flax.main", "--config=configs/qwen2.py:0_5b_sft", f"--workdir={workdir}",
      f"--config.trainer.init_from_hf={model_dir}", f"--config.data.dataset={tmp_path / 'data'}",
      f"--config.data.tokenizer={tokenizer}",
      f"--config.model.seq_len={SEQ_LEN}",
      "--config.model.compute.cross_entropy_block_size=0", "--config.trainer.batch_size=4",
      "--config.trainer.num_train_steps=3", "--config.trainer.log_every_steps=1",
      "--config.trainer.eval_every_steps=3", "--config.trainer.eval_tokens=all")
  metrics = read_metrics(workdir)
  logged = [m for m in metrics if "train/loss_tokens" in m]
  # Only the assistant's replies count: well under the 4 x 63 targets of a batch.
  assert logged and all(0 < m["train/loss_tokens"] < 4 * 63 for m in logged)
  assert any("eval/loss" in m for m in metrics)

  reply = run("levanter_flax.commands.sample", f"--workdir={workdir}", "--chat",
              "--prompt=question 3",
              "--max_new_tokens=4", "--temperature=0")
  assert reply.startswith("--- 'question 3'\n") and "<|im_start|>" not in reply

  export = tmp_path / "exports" / "sft"
  run("levanter_flax.commands.export_hf", f"--workdir={workdir}", f"--output_dir={export}")
  assert json.loads((export / "config.json").read_text())["dtype"] == "float32"
  generator = transformers.pipeline("text-generation", model=str(export))
  out = generator("question 3", max_new_tokens=3, do_sample=False)
  assert out[0]["generated_text"].startswith("question 3")
