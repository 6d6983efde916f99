"""int8 training (config.model.compute.quantization="int8"): the layers' matmuls as int8 x int8
-> int32 products, in the forward pass and in both of the backward pass's.

The recipe is AQT's and Qwix's int8 training. Each operand of each product is quantized
symmetrically, one scale per channel: per row of the left operand and per column of the right,
both over the contracted axis, scale = max |x| / 127. The int32 product is rescaled by both
scales:
- forward: y = x w, with x per token and w per output column;
- backward: dx = g w^T, with g per token and w per input row; dw = x^T g, with x and g per
  feature, over the tokens.

The gradient is the straight-through estimator: rounding counts as the identity. The master
weights, the optimizer state and everything outside the layers' projections keep their dtypes.

`dot_general` has flax's nn.Dense signature, so a Dense takes it as its `dot_general`
(`layer_dot_general`). Imports jax, models.common and models.lora.
"""
import functools
import re
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from absl import logging

from levanter_flax.models.common import platform_in_context
from levanter_flax.models.lora import DEFAULT_TARGETS

INT8_MAX = 127
# The kernels whose products `layer_dot_general` makes int8: attention's and the MLP's
# projections of every family that takes int8 (a mixture's refuses it), which are LoRA's
# default targets too. tests/test_int8.py checks them against the int8 products a step traces.
QUANTIZED_KERNELS = re.compile(DEFAULT_TARGETS)


def quantize(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """x as int8 and its float32 scales, one per slice along `axis` (kept, size 1): x ≈ q * scale.
  An all-zero slice gets scale 1."""
  x = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x), axis=axis, keepdims=True) / INT8_MAX
  scale = jnp.where(scale == 0, 1.0, scale)
  return jnp.clip(jnp.round(x / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8), scale


def int32_product(a: jax.Array, b: jax.Array) -> jax.Array:
  """a [m, k] int8 times b [k, n] int8, accumulated in int32."""
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)


def _matmul(a: jax.Array, b: jax.Array, dtype) -> jax.Array:
  """a [m, k] times b [k, n] through int8: a per row, b per column."""
  qa, scale_a = quantize(a, axis=1)
  qb, scale_b = quantize(b, axis=0)
  return (int32_product(qa, qb).astype(jnp.float32) * scale_a * scale_b).astype(dtype)


@jax.custom_vjp
def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [m, k] times w [k, n], each of the three products int8 (the module's docstring)."""
  return _matmul(x, w, jnp.result_type(x, w))


def _forward(x, w):
  return matmul(x, w), (x, w)


def _backward(residuals, g):
  x, w = residuals
  return _matmul(g, w.T, x.dtype), _matmul(x.T, g, w.dtype)


matmul.defvjp(_forward, _backward)


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, precision=None,
                preferred_element_type=None) -> jax.Array:
  """nn.Dense's product, lhs [..., k] times rhs [k, n], through `matmul`."""
  del precision, preferred_element_type  # int8 products have one precision, int32 results.
  if dimension_numbers != (((lhs.ndim - 1,), (0,)), ((), ())) or rhs.ndim != 2:
    raise ValueError(f"int8 dot_general takes a Dense's product, not {dimension_numbers}")
  _say_once_off_tpu()
  y = matmul(lhs.reshape(-1, lhs.shape[-1]), rhs)
  return y.reshape(*lhs.shape[:-1], rhs.shape[1])


def layer_dot_general(compute) -> Optional[Callable]:
  """The product of a layer's projections under `compute` (a ComputeConfig): int8's, or None
  for lax's. The embeddings, the head and a mixture's router keep theirs."""
  return dot_general if compute.quantization == "int8" else None


def _say_once_off_tpu() -> None:
  _say_once(platform_in_context())


@functools.cache
def _say_once(platform: str) -> None:
  if platform != "tpu":
    logging.warning("config.model.compute.quantization=int8 on %s: correct, but slower than "
                    "its float products (a TPU multiplies int8 at twice its bf16 rate)", platform)
