"""Training throughput and MFU for any config and overrides, on synthetic batches.

    python bench/train_throughput.py --config=configs/nanogpt_cpu.py [--config.model.compute.remat=full ...]
    python bench/train_throughput.py --config=configs/gpt2_small_fast.py   # on a GPU

Prints tokens/s, compile time, model TFLOP/s per device and MFU, with model
FLOPs counted nanoGPT's way (6N + 12*L*H*Q*T per token) and with the causal
half of attention only. The peak is the device's from levanter_flax.core.flops, or
`--config.trainer.peak_flops_per_device`; on a CPU it is the float32
square-matmul rate measured by this same run. It also times the LM head and
its cross-entropy alone (forward and backward) as a share of the step.

Needs jax, flax, optax, absl and ml_collections (pure Python; carry its wheel
to machines without it); no TensorFlow, no data files.
"""
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from etils import epath
from absl import app, flags
from ml_collections import config_flags

from common import compile_train_step, square_matmul_flops
from levanter_flax.core import flops
from levanter_flax import models
from levanter_flax.parallel import partitioning
from levanter_flax.config import to_run_config
from levanter_flax.monitoring import report
from levanter_flax.training import batch_search

_CONFIG = config_flags.DEFINE_config_file("config", None, "A config file in configs/.")
_NUM_STEPS = flags.DEFINE_integer("num_steps", 5, "Timed steps, after one warm-up step.")
_MATMUL_SIZE = flags.DEFINE_integer("matmul_size", 2048, "Side of the square matmul (CPU peak).")
_PROFILE_DIR = flags.DEFINE_string(
    "profile_dir", None, "Also trace 3 steps into DIR/plugins/profile (as the trainer's "
    "monitoring.profiler does) and print where the device's time went, by op kind.")
flags.mark_flag_as_required("config")


def lm_head_seconds(run, params) -> float:
  """Forward + backward of the LM head (tied or not) and its float32 cross-entropy at the run's
  shape."""
  model = run.model
  batch = run.trainer.batch_size // run.trainer.gradient_accumulation_steps
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.standard_normal((batch, model.seq_len, model.hidden_dim)), model.compute.dtype)
  labels = jnp.asarray(rng.integers(0, model.vocab_size, (batch, model.seq_len)))
  embedding = models.build(model).output_embedding(params)  # [vocab, hidden_dim]

  def loss(hidden, embedding):
    logits = jnp.einsum("btd,vd->btv", hidden, embedding.astype(model.compute.dtype)).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  jax.block_until_ready(grad(hidden, embedding))
  times = []
  for _ in range(3):
    start = time.perf_counter()
    jax.block_until_ready(grad(hidden, embedding))
    times.append(time.perf_counter() - start)
  return float(np.median(times)) * run.trainer.gradient_accumulation_steps


def main(argv):
  del argv
  run = to_run_config(_CONFIG.value)
  model, trainer = run.model, run.trainer
  partitioning.split_cpu(trainer.cpu_devices)
  compiled = compile_train_step(run)
  step_seconds = compiled.median_seconds(_NUM_STEPS.value)
  device = jax.devices()[0]
  tokens_per_second = trainer.batch_size * model.seq_len / step_seconds
  per_device = tokens_per_second / jax.device_count()
  params = compiled.steps.abstract_state.params
  nanogpt_flops = models.flops_per_token(model, params, causal=False) * per_device
  causal_flops = models.flops_per_token(model, params, causal=True) * per_device
  peak = flops.peak_flops_per_device(device, trainer.peak_flops_per_device)
  peak_source = "device table" if peak else f"measured f32 {_MATMUL_SIZE.value}^2 matmul"
  if not peak:  # The matmul uses every core, which the CPU's devices share.
    peak = square_matmul_flops(_MATMUL_SIZE.value) / jax.local_device_count()
    peak_source += f", shared by {jax.local_device_count()} devices"
  memory = compiled.compiled.memory_analysis()
  # After the steps, before the head's own timing: None on a CPU.
  peak_in_use = (device.memory_stats() or {}).get("peak_bytes_in_use")
  head_seconds = lm_head_seconds(run, compiled.state.params)

  print(f"{jax.device_count()} x {device.device_kind}; {model}")
  print(f"batch {trainer.batch_size} x {model.seq_len}, accumulation "
        f"{trainer.gradient_accumulation_steps}, mesh {dict(trainer.device_mesh)}, "
        f"document masking {run.data.document_masking}")
  print(f"compile {compiled.compile_seconds:.1f} s; step {step_seconds * 1e3:.1f} ms; "
        f"temp {memory.temp_size_in_bytes / 2**20:.1f} MiB; the program needs "
        f"{batch_search.needed_bytes(memory) / 2**30:.2f} GiB a device (what `aot` plans)"
        + (f", the device's peak in use {peak_in_use / 2**30:.2f} GiB" if peak_in_use else ""))
  print(f"tokens/s {tokens_per_second:,.0f} ({per_device:,.0f} per device)")
  print(f"peak {peak / 1e12:.3f} TFLOP/s per device ({peak_source})")
  print(f"model TFLOP/s per device {nanogpt_flops / 1e12:.3f} (nanoGPT count), "
        f"{causal_flops / 1e12:.3f} (causal)")
  print(f"MFU {nanogpt_flops / peak:.1%} (nanoGPT count), {causal_flops / peak:.1%} (causal)")
  print(f"LM head + cross-entropy alone: {head_seconds * 1e3:.1f} ms, "
        f"{head_seconds / step_seconds:.0%} of the step")
  if _PROFILE_DIR.value:
    print(profiled(compiled, epath.Path(_PROFILE_DIR.value)))


def profiled(compiled, directory: epath.Path, num_steps: int = 3) -> str:
  """Traces `num_steps` steps, each annotated as the trainer's are; their breakdown."""
  with jax.profiler.trace(str(directory)):
    for _ in range(num_steps):
      with jax.profiler.TraceAnnotation("train"):
        compiled.step_once()
  return report.profile_summary(directory, top_ops=12)


if __name__ == "__main__":
  app.run(main)
