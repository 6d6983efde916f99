"""Llama (RoPE, RMSNorm, SwiGLU, grouped-query attention) at four sizes:
--config=configs/llama.py:VARIANT, 1b when none is given.

nano: a tiny byte-level Llama, gpt2.py:nano's run on the CPU:
    python -m levanter_flax.main --config=configs/llama.py:nano
1b: 1.1B, TinyLlama's shape (22 layers, width 2048, 32 query and 4 key/value heads), data
    parallel with ZeRO-3, on one GPU node or a v5e-16 (4.4 GiB a chip, bench/tpu_plan.py).
7b: 32 layers, width 4096, 32 heads, SwiGLU 11008, context 4096, on a 2D mesh: ZeRO-3 over
    `data` shards parameters and optimizer state across the data axis, and `model` splits each
    layer Megatron-style within a host (8 GPUs or a TPU host). Multi-host: see launch/README.md.

70b: Llama-2-70B's shape (80 layers, width 8192, 64 query and 8 key/value heads, SwiGLU 28672)
    over several TPU slices, pipelined: each slice is one stage of consecutive layers
    (trainer.dcn_mesh stage=-1), with ZeRO-3 over `data` and Megatron over `model` inside it, so
    only activations cross the data-center network (docs/scaling.md#pipeline-parallelism):
    levanter-flax aot --config=configs/llama.py:70b --topology=v5e-256 --num_slices=4

1b_lora: LoRA fine-tuning of a 1b-shaped Hugging Face checkpoint (TinyLlama's chat model) on
    chat data; README.md's "Fine-tune a Hugging Face model" runs it:
    python -m levanter_flax.main --config=configs/llama.py:1b_lora \\
        --config.trainer.init_from_hf=/models/TinyLlama-1.1B-Chat \\
        --config.data.dataset=/data/my_chats \\
        --config.data.tokenizer=/models/TinyLlama-1.1B-Chat/tokenizer.json

1b and 7b compute in bfloat16, layers scanned, full remat, and train on tokenized data:
config.data.dataset and config.data.tokenizer, prepared with levanter-flax prepare
(a Llama tokenizer.json, vocab 32000). configs/llama_<variant>.py name the same configs.
"""
from levanter_flax.config import (choose_variant, default_config, llama_model_config, mesh,
                                  model_like, sibling_config)


def nano():
  config = sibling_config(__file__, "gpt2.py", "nano")
  # About 8/3 x hidden_dim, as Llama's SwiGLU.
  config.model = model_like(config.model, "llama", num_kv_heads=2, intermediate_dim=352)
  config.optimizer.weight_decay = 0.0
  return config


def _large(model):
  """`model` in bfloat16, scanned and rematerialized, at a batch of 256 sequences."""
  config = default_config()
  config.model = model
  config.model.compute.dtype = "bfloat16"
  config.model.compute.scan_layers = True
  config.model.compute.remat = "full"
  config.model.compute.cross_entropy_block_size = 8192
  # Their sequences are multiples of 1024 tokens: splash's larger blocks took a v5e chip's
  # 0.47B-Llama step from 44.3% to 45.1% MFU (docs/Performance-Guide.md).
  config.model.compute.splash_block_q = 1024
  config.model.compute.splash_block_kv = 1024
  config.trainer.batch_size = 256
  config.optimizer.warmup_steps = 2000
  return config


def _sized(num_layers, num_heads, num_kv_heads, hidden_dim, intermediate_dim, seq_len):
  """llama_model_config() at another size."""
  model = llama_model_config()
  model.num_layers, model.num_heads, model.num_kv_heads = num_layers, num_heads, num_kv_heads
  model.hidden_dim, model.intermediate_dim, model.seq_len = hidden_dim, intermediate_dim, seq_len
  return model


def _zero3(config):
  """Parameters and optimizer state split over the data axis."""
  config.sharding.parameter_axis = "data"
  config.sharding.optimizer_axis = "data"


def llama_1b():
  config = _large(llama_model_config())  # 0.5M tokens a batch at seq_len 2048.
  config.trainer.gradient_accumulation_steps = 4
  # ZeRO-3: whole, its parameters and Adam state (12 bytes a parameter) fill a 16 GiB v5e chip.
  _zero3(config)
  config.trainer.num_train_steps = 100_000
  config.optimizer.learning_rate = 4e-4
  return config


def llama_7b():
  config = _large(_sized(32, 32, 32, 4096, 11008, 4096))  # 1M tokens a batch at seq_len 4096.
  config.trainer.device_mesh = mesh(data=-1, model=8)
  _zero3(config)
  config.trainer.gradient_accumulation_steps = 8
  config.trainer.num_train_steps = 250_000
  config.optimizer.learning_rate = 3e-4
  return config


def llama_70b():
  config = _large(_sized(80, 64, 8, 8192, 28672, 4096))
  config.trainer.batch_size = 1024  # 4M tokens a batch, as Llama 2's.
  config.trainer.device_mesh = mesh(stage=1, data=-1, model=8)  # Per slice.
  config.trainer.dcn_mesh = mesh(stage=-1, data=1)  # A stage per slice.
  # 2 x 16 microbatches of 32 sequences, one a data-parallel device of a v5e-256 slice, the
  # bubble 3 / 19 of the stage-iterations on 4 slices; each iteration's stage recomputed in the
  # backward pass from its input: 7.26 GiB a chip, where keeping every layer's input of every
  # iteration needed 28.25 (docs/Performance-Guide.md#pipelining-across-slices).
  config.trainer.gradient_accumulation_steps = 2
  config.trainer.pipeline.microbatches = 16
  config.trainer.pipeline.remat_stages = True
  _zero3(config)  # Within each slice.
  config.trainer.num_train_steps = 500_000
  config.optimizer.learning_rate = 1.5e-4
  return config


def llama_1b_lora():
  """LoRA on 1b's checkpoint (trainer.init_from_hf) with chat data (prepare --source=chat): the
  loss on the assistant's turns, rank-16 adapters on every projection, the base frozen."""
  config = llama_1b()
  config.model.lora.rank = 16
  config.model.lora.alpha = 32.0
  config.model.lora.dropout = 0.05
  config.trainer.batch_size = 32  # 64k tokens a step at seq_len 2048.
  config.trainer.gradient_accumulation_steps = 1
  config.trainer.num_train_steps = 1000
  config.optimizer.learning_rate = 2e-4  # Adapters take a larger step than whole weights.
  config.optimizer.warmup_steps = 30
  config.optimizer.weight_decay = 0.0
  config.checkpoint.every_steps = 200
  return config


VARIANTS = {"nano": nano, "1b": llama_1b, "7b": llama_7b, "70b": llama_70b,
            "1b_lora": llama_1b_lora}


def get_config(variant=None):
  return choose_variant(__file__, variant, VARIANTS, default="1b")
