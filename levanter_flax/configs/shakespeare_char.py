"""nanoGPT's Shakespeare-character CPU recipe (its README's train_shakespeare_char command):
4 layers, 4 heads, width 128, context 64, batch 12, 2,000 steps, learning rate 1e-3 to 1e-4,
beta2 0.99, no dropout; byte tokens, one stream of text (no document masking).

    levanter-flax prepare --source=text --input=input.txt --separator='\\n\\n' \\
        --validation_fraction=0.1 --tokenizer=byte --num_shards=1 --output_dir=data/shakespeare
    python -m levanter_flax.main --config=configs/shakespeare_char.py \\
        --config.data.dataset=data/shakespeare

bench/nanogpt_recipe.py runs both and prints the wall time and the eval loss.
"""
from levanter_flax.config import default_config


def get_config():
  config = default_config()
  # The byte tokenizer's 257, unpadded: a multiple of 128 (384) helps GPU and TPU matmuls, but
  # on a CPU it only adds work (this recipe's step: 22.7 -> 21.6 ms).
  config.model.vocab_size = 257
  config.model.seq_len = 64
  config.model.num_layers = 4
  config.model.num_heads = 4
  config.model.hidden_dim = 128

  config.trainer.batch_size = 12
  # On a CPU, two devices data-parallel (6 sequences each) step 1.5x faster than one at this size.
  config.trainer.cpu_devices = 2
  config.trainer.num_train_steps = 2000
  config.trainer.log_every_steps = 10
  config.trainer.eval_every_steps = 250  # nanoGPT's eval_interval.
  config.trainer.eval_tokens = 20 * 12 * 64  # nanoGPT's eval_iters x batch_size x block_size.
  config.checkpoint.every_steps = 2000

  config.optimizer.learning_rate = 1e-3
  config.optimizer.min_learning_rate_ratio = 0.1  # nanoGPT's min_lr 1e-4.
  config.optimizer.warmup_steps = 100
  config.optimizer.beta2 = 0.99
  config.optimizer.weight_decay = 0.1
  config.data.document_masking = False  # nanoGPT trains on one running text.
  return config
