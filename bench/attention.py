"""Training attention alone, forward and backward, for each kernel and splash block setting.

    python bench/attention.py                       # the 0.47B Llama's shape, on a TPU
    python bench/attention.py --seq_len=1024 --heads=12 --kv_heads=12   # GPT-2 small's

Times causal attention over [batch, seq_len, heads, head_dim] bf16 inputs with several documents
a row (the trainer's document masking), as the model's layers call it: XLA's, then splash at
each (block_q, block_kv) with its two backward kernels and with the fused one
(config.model.compute.splash_block_q, splash_block_kv, splash_fused_backward). Prints
milliseconds and TFLOP/s side by side in one run, counting the causal half of the score and
value products and the backward as twice the forward (the model's own FLOP count).
A setting that cannot run (a block that does not tile the sequence, XLA's scores that do not
fit) prints its one-line reason. Needs jax alone; splash needs a TPU.
"""
import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from levanter_flax.models import attention, common

_BATCH = flags.DEFINE_integer("batch", 16, "Sequences.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 2048, "Tokens a sequence.")
_HEADS = flags.DEFINE_integer("heads", 32, "Query heads.")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 4, "Key/value heads.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Width of a head.")
_DOCUMENT_LEN = flags.DEFINE_integer("document_len", 700, "Tokens a document (0: one a row).")
_BLOCKS = flags.DEFINE_list("blocks", ["512:512", "1024:512", "512:1024", "1024:1024",
                                       "2048:512"], "splash's block_q:block_kv settings.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed calls, after one warm-up.")


def timed(fn, *args) -> float:
  """Median seconds of fn(*args), compiled, after a warm-up call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(_STEPS.value):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def forward_and_backward(implementation: str, blocks: common.SplashBlocks, segment_ids):
  def loss(q, k, v):
    out = attention.causal_attention(None, q, k, v, implementation=implementation,
                                     splash_blocks=blocks, segment_ids=segment_ids)
    return out.astype(jnp.float32).sum()
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def main(argv):
  del argv
  batch, length, heads, head_dim = _BATCH.value, _SEQ_LEN.value, _HEADS.value, _HEAD_DIM.value
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (batch, length, heads, head_dim), jnp.bfloat16)
  k, v = (jax.random.normal(key, (batch, length, _KV_HEADS.value, head_dim), jnp.bfloat16)
          for key in keys[1:])
  segment_ids = None
  if _DOCUMENT_LEN.value:
    segment_ids = jnp.broadcast_to(jnp.arange(length) // _DOCUMENT_LEN.value, (batch, length))
  flop = 3 * 2 * batch * heads * length * length * head_dim  # Causal: half of 2 products, x3.
  print(f"{jax.devices()[0].device_kind}: batch {batch} x {length}, {heads} heads "
        f"({_KV_HEADS.value} key/value), head_dim {head_dim}, documents of "
        f"{_DOCUMENT_LEN.value or length} tokens")
  print(f"{'kernel':<34} {'ms':>8} {'TFLOP/s':>8}")
  cases = [("xla", common.SplashBlocks(512, 512))]
  for pair in _BLOCKS.value:
    # splash clips a block to the sequence: name the blocks it runs.
    block_q, block_kv = (min(int(size), length) for size in pair.split(":"))
    cases += [("splash", common.SplashBlocks(block_q, block_kv, fused))
              for fused in (False, True)]
  for implementation, blocks in dict.fromkeys(cases):  # Once each, in order.
    name = (implementation if implementation == "xla" else
            f"splash {blocks.q}:{blocks.kv}{' fused backward' if blocks.fused_backward else ''}")
    try:
      seconds = timed(forward_and_backward(implementation, blocks, segment_ids), q, k, v)
    except Exception as e:  # pylint: disable=broad-except  # A case's failure is its row.
      print(f"{name:<34} {str(e).splitlines()[0][:100]}")
      continue
    print(f"{name:<34} {seconds * 1e3:8.2f} {flop / seconds / 1e12:8.1f}")


if __name__ == "__main__":
  app.run(main)
