"""int8 training (config.model.compute.quantization="int8"): the layers' matmuls as int8 x int8
-> int32 products, in the forward pass and in both of the backward pass's.

The recipe is AQT's and Qwix's int8 training. Each operand of each product is quantized
symmetrically, one scale per channel: per row of the left operand and per column of the right,
both over the contracted axis, scale = max |x| / 127. The int32 product is rescaled by both
scales:
- forward: y = x w, with x per token and w per output column;
- backward: dx = g w^T, with g per token and w per input row; dw = x^T g, with x and g per
  feature, over the tokens.

The gradient g is rounded stochastically in both backward products, as AQT's recipe does: its
rounding errors then average out over the tokens dw sums, where rounding to nearest biases
each weight's gradient the same way every step (1,000 steps of GPT-2 small on a v5e chip:
eval loss 1.38% above bfloat16's rounded to nearest, 1.04% rounded so). The dither is a hash of each element's
position and value, not a PRNG: a step stays a pure function of its inputs, so runs resume
bit for bit and no key is threaded through the layers.

The gradient is the straight-through estimator: rounding counts as the identity. The master
weights, the optimizer state and everything outside the layers' projections keep their dtypes.
An int32 holds MAX_TERMS int8 products however they fall: dw sums a microbatch of more tokens
in blocks of at most that many, each its own int8 product with its own scales, and adds the
blocks in float32; a product over more features than that is refused. A custom_vjp has no forward-mode derivative, so Sophia-H's
Hessian-vector products cannot run through it (config/loading.py refuses the pair).

`dot_general` has flax's nn.Dense signature, so a Dense takes it as its `dot_general`
(`layer_dot_general`). Imports jax, core.errors, models.common and models.lora.
"""
import functools
import math
import re
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from absl import logging
from jax.ad_checkpoint import checkpoint_name

from levanter_flax.core.errors import UserError
from levanter_flax.models.common import INT8_PRODUCT, platform_in_context
from levanter_flax.models.lora import DEFAULT_TARGETS, EXPERT_TARGETS

INT8_MAX = 127
# int8 products an int32 holds however they fall: 127 ** 2 each.
MAX_TERMS = (2 ** 31 - 1) // INT8_MAX ** 2
# The kernels whose products `layer_dot_general` makes int8: attention's and the MLP's
# projections of every family, which are LoRA's default targets too, and DeepSeek-V3's latent
# attention's and shared experts'. tests/test_int8.py checks them against the int8 products a
# step traces.
QUANTIZED_KERNELS = re.compile(
    DEFAULT_TARGETS + r"|/self_attn/(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)/kernel$"
    r"|/mlp/shared_experts/(gate_proj|up_proj|down_proj)/kernel$")
# And a mixture's expert stacks, through grouped_matmul.
QUANTIZED_EXPERTS = re.compile(EXPERT_TARGETS)


def quantize(x: jax.Array, axis, stochastic: bool = False) -> tuple[jax.Array, jax.Array]:
  """x as int8 and its float32 scales, one per slice along `axis` (an axis or a tuple of them,
  kept with size 1): x ≈ q * scale. An all-zero slice gets scale 1. Rounded to nearest, or
  `stochastic`ally: up with probability the fraction, so that E[q * scale] = x."""
  x = x.astype(jnp.float32)
  scale = _scale(jnp.max(jnp.abs(x), axis=axis, keepdims=True))
  return _rounded(x, scale, stochastic), scale


def _scale(absmax: jax.Array) -> jax.Array:
  """The scale of slices whose largest magnitude is `absmax`: 1 for an all-zero (or empty)
  slice."""
  return jnp.where(absmax > 0, absmax / INT8_MAX, 1.0)


def _rounded(x: jax.Array, scale: jax.Array, stochastic: bool) -> jax.Array:
  """float32 x over its scales, rounded (quantize's) to int8."""
  scaled = x / scale
  rounded = jnp.floor(scaled + dither(x)) if stochastic else jnp.round(scaled)
  return jnp.clip(rounded, -INT8_MAX, INT8_MAX).astype(jnp.int8)


def dither(x: jax.Array) -> jax.Array:
  """Uniform in [0, 1) for each element of float32 x: its flat position and its bfloat16 bits
  hashed (Wellons' lowbias32), the top 24 bits as the fraction. Only the bfloat16 bits, so
  that a gradient recomputed to within float32's rounding (under remat) mostly rounds alike."""
  position = jax.lax.iota(jnp.uint32, x.size).reshape(x.shape)
  value = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000)
  h = value ^ (position * jnp.uint32(0x9E3779B9))
  h = (h ^ (h >> 16)) * jnp.uint32(0x7FEB352D)
  h = (h ^ (h >> 15)) * jnp.uint32(0x846CA68B)
  h = h ^ (h >> 16)
  return (h >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -24)


def int32_product(a: jax.Array, b: jax.Array, contracting: tuple[tuple[int, ...], tuple[int, ...]]
                  = ((1,), (0,))) -> jax.Array:
  """int8 a times int8 b over their `contracting` axes, accumulated in int32."""
  return jax.lax.dot_general(a, b, (contracting, ((), ())), preferred_element_type=jnp.int32)


def _product(a: jax.Array, b: jax.Array, contracting: tuple[tuple[int, ...], tuple[int, ...]],
             dtype, stochastic: tuple[bool, bool] = (False, False)) -> jax.Array:
  """a times b over their `contracting` axes through int8, each quantized over those axes (and
  rounded `stochastic`ally or not): the result's axes are a's others, then b's."""
  terms = math.prod(a.shape[axis] for axis in contracting[0])
  if terms > MAX_TERMS:
    raise UserError(f"config.model.compute.quantization=int8 cannot multiply over {terms:,} "
                    f"features: the sum of their int8 products can overflow an int32 past "
                    f"{MAX_TERMS:,}")
  (qa, scale_a), (qb, scale_b) = (quantize(a, contracting[0], stochastic[0]),
                                  quantize(b, contracting[1], stochastic[1]))
  kept_a = [n for axis, n in enumerate(a.shape) if axis not in contracting[0]]
  kept_b = [n for axis, n in enumerate(b.shape) if axis not in contracting[1]]
  scale = scale_a.reshape(kept_a + [1] * len(kept_b)) * scale_b.reshape(kept_b)
  return (int32_product(qa, qb, contracting).astype(jnp.float32) * scale).astype(dtype)


@jax.custom_vjp
def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [..., k] times w [k, n], each of the three products int8 (the module's docstring)."""
  return _product(x, w, ((x.ndim - 1,), (0,)), jnp.result_type(x, w))


def _forward(x, w):
  return matmul(x, w), (x, w)


def _backward(residuals, g):
  x, w = residuals
  return (_product(g, w, ((g.ndim - 1,), (1,)), x.dtype, stochastic=(True, False)),
          weight_gradient(x, g, w.dtype))


def weight_gradient(x: jax.Array, g: jax.Array, dtype) -> jax.Array:
  """dw = x^T g [k, n], summed over every token of x [..., k] and g [..., n]: one int8 product,
  each feature's scale spanning the tokens; past MAX_TERMS tokens, one per block of at most
  that many, added in float32. The blocks split the leading (batch) axis where it divides
  into at most twice the fewest blocks (a block axis the batch's sharding can keep); else the
  flat tokens, the last block padded with zeros.
  """
  count = math.prod(x.shape[:-1])
  if count <= MAX_TERMS:
    tokens = tuple(range(x.ndim - 1))
    return _product(x, g, (tokens, tokens), dtype, stochastic=(False, True))
  blocks = -(-count // MAX_TERMS)
  rows = _fewest_blocks(x.shape[0], count // x.shape[0])
  if rows and rows <= 2 * blocks:  # More would hold as many [k, n] products before the sum.
    split = lambda a: a.reshape(rows, a.shape[0] // rows, *a.shape[1:])
  else:
    size = -(-count // blocks)
    split = lambda a: jnp.pad(a.reshape(count, a.shape[-1]),
                              ((0, blocks * size - count), (0, 0))).reshape(blocks, size, -1)
  x, g = split(x), split(g)
  tokens = tuple(range(x.ndim - 2))  # A block's.
  block_product = lambda xb, gb: _product(xb, gb, (tokens, tokens), jnp.float32, (False, True))
  return jax.vmap(block_product)(x, g).sum(axis=0).astype(dtype)


def _fewest_blocks(batch: int, tokens_per_row: int) -> int:
  """The fewest blocks of whole rows, of `batch` rows of `tokens_per_row`, that each hold at
  most MAX_TERMS tokens and split the rows evenly; 0 if none do."""
  return next((n for n in range(1, batch + 1)
               if batch % n == 0 and batch // n * tokens_per_row <= MAX_TERMS), 0)


matmul.defvjp(_forward, _backward)


@jax.custom_vjp
def grouped_matmul(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """A mixture's grouped product through int8 (jax.lax.ragged_dot's): rows [m, k], sorted into
  groups of group_sizes [E] rows, each times its group's w [E, k, n]; the rows after the groups
  unspecified (zeros on a CPU, left unwritten on a TPU). Scales: rows per row and w per group
  and column in the forward pass; g per row and w per group and input row for dx; rows and g
  per group and feature, over the group's rows, for dw, whose int32 sums the caller bounds
  (check_group_rows). Named INT8_PRODUCT, as a Dense's."""
  qx, scale_x = quantize(rows, 1)
  qw, scale_w = quantize(w, 1)
  product = jax.lax.ragged_dot(qx, qw, group_sizes, preferred_element_type=jnp.int32)
  scale = scale_x * _per_row(scale_w[:, 0], _row_groups(group_sizes, rows.shape[0]))
  y = (product.astype(jnp.float32) * scale).astype(jnp.result_type(rows, w))
  return checkpoint_name(y, INT8_PRODUCT)


def check_group_rows(rows: int) -> None:
  """Refuses grouped_matmul on groups of up to `rows` rows, whose dw's int32 could overflow."""
  if rows > MAX_TERMS:
    raise UserError(f"config.model.compute.quantization=int8 sums up to {rows:,} of an expert's "
                    f"rows on a device into one int32, which can overflow past {MAX_TERMS:,}: "
                    f"use fewer tokens per microbatch (config.trainer.gradient_accumulation_steps)")


def _row_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
  """Each row's group, len(group_sizes) for rows after the groups."""
  return jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right")


def _per_row(per_group: jax.Array, row_groups: jax.Array) -> jax.Array:
  """per_group [E, d] as each row's [rows, d] (the last group's for rows after the groups)."""
  return jnp.take(per_group, row_groups, axis=0, mode="clip")


def _grouped_forward(rows, w, group_sizes):
  return grouped_matmul(rows, w, group_sizes), (rows, w, group_sizes)


def _grouped_backward(residuals, g):
  rows, w, group_sizes = residuals
  row_groups = _row_groups(group_sizes, rows.shape[0])
  qg, scale_g = quantize(g, 1, stochastic=True)
  qw, scale_w = quantize(w, 2)  # Per group and input row: [E, k, 1].
  dx = jax.lax.ragged_dot(qg, qw.transpose(0, 2, 1), group_sizes,
                          preferred_element_type=jnp.int32)
  dx = dx.astype(jnp.float32) * scale_g * _per_row(scale_w[..., 0], row_groups)
  # dw: each group's rows and gradients, per feature over the group's rows.
  groups = w.shape[0]
  (qx, scale_x), (qg, scale_g) = (_quantize_per_group(rows, row_groups, groups, False),
                                  _quantize_per_group(g, row_groups, groups, True))
  numbers = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[])
  dw = jax.lax.ragged_dot_general(qx, qg, group_sizes, numbers,
                                  preferred_element_type=jnp.int32)
  dw = dw.astype(jnp.float32) * scale_x[:, :, None] * scale_g[:, None, :]
  return dx.astype(rows.dtype), dw.astype(w.dtype), None


def _quantize_per_group(x: jax.Array, row_groups: jax.Array, groups: int, stochastic: bool
                        ) -> tuple[jax.Array, jax.Array]:
  """x [rows, d] as int8, each feature scaled over its group's rows: the scales [groups, d];
  the rows after the groups zeros."""
  x = x.astype(jnp.float32)
  scale = _scale(jax.ops.segment_max(jnp.abs(x), row_groups, num_segments=groups))
  q = _rounded(x, _per_row(scale, row_groups), stochastic)
  return jnp.where((row_groups < groups)[:, None], q, 0).astype(jnp.int8), scale


grouped_matmul.defvjp(_grouped_forward, _grouped_backward)


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, precision=None,
                preferred_element_type=None) -> jax.Array:
  """nn.Dense's product, lhs [..., k] times rhs [k, n], through `matmul`; its output named
  INT8_PRODUCT, so that the remat policies that keep dots' outputs keep it."""
  del precision, preferred_element_type  # int8 products have one precision, int32 results.
  if dimension_numbers != (((lhs.ndim - 1,), (0,)), ((), ())) or rhs.ndim != 2:
    raise ValueError(f"int8 dot_general takes a Dense's product, not {dimension_numbers}")
  _say_once_off_tpu()
  return checkpoint_name(matmul(lhs, rhs), INT8_PRODUCT)


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
