"""Model FLOPs per token and device peak FLOP/s: the two halves of MFU; and the devices' HBM
bandwidth, the memory roofline of generation's decode steps.

Pure jax, so the benchmarks can use it on machines without clu or TensorFlow.
"""
import jax

# Dense bfloat16 peak FLOP/s per chip (per GPU), by jax's device_kind.
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5": 459e12,  # v5p
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,  # v6e (Trillium)
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
}


# HBM bandwidth, bytes/s per chip (per GPU), by jax's device_kind: the vendors' figures.
HBM_BANDWIDTH = {
    "TPU v4": 1200e9,
    "TPU v5 lite": 819e9,
    "TPU v5": 2765e9,
    "TPU v5p": 2765e9,
    "TPU v6 lite": 1640e9,
    "NVIDIA A100-SXM4-40GB": 1555e9,
    "NVIDIA A100-SXM4-80GB": 2039e9,
    "NVIDIA H100 80GB HBM3": 3350e9,
    "NVIDIA H100": 3350e9,
    "NVIDIA H200": 4800e9,
}


def peak_flops_per_device(device: jax.Device, override: float = 0.0) -> float:
  """The device's peak FLOP/s: `override` if set, else PEAK_FLOPS; 0 if unknown (e.g. CPU)."""
  return override or PEAK_FLOPS.get(device.device_kind, 0.0)


def flops_per_token(num_params: int, num_layers: int, num_heads: int, head_dim: int,
                    seq_len: int, causal: bool = True, frozen_params: float = 0,
                    reference_params: float = 0) -> float:
  """Model FLOPs per trained token: 6N for the weights' matmuls (forward + backward),
  plus attention's score and value matmuls, 12 * L * H * Q * T. A causal mask
  needs only half of those, so causal=True counts half; nanoGPT counts all of it.
  Of the N, `frozen_params` get no weight gradient (LoRA's base): 4 each, not 6.
  `reference_params`: a model run forward on the same tokens too (DPO's reference): 2 each,
  and its attention's forward, a third of the above.
  """
  attention = 12 * num_layers * num_heads * head_dim * seq_len
  if reference_params:
    attention += attention / 3
  return (6 * num_params - 2 * frozen_params + 2 * reference_params
          + (attention / 2 if causal else attention))
