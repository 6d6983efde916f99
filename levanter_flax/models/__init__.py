"""The model families, registered by name (config.model.architecture); see family.py.

A new family is its module (config dataclass, Flax module, partition rules in
logical axes, Hugging Face layout, FAMILY), one line in FAMILIES, and a config.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from levanter_flax.core import flops
from levanter_flax.models import (common, deepseek_v3, gemma3, gpt2, int8, llama, lora, mistral,
                                  mixtral, olmo2, qwen2, qwen3, qwen3_moe)
from levanter_flax.models.family import ModelFamily

FAMILIES: dict[str, ModelFamily] = {
    f.name: f for f in (gpt2.FAMILY, llama.FAMILY, qwen2.FAMILY, mistral.FAMILY, mixtral.FAMILY,
                        qwen3.FAMILY, qwen3_moe.FAMILY, olmo2.FAMILY, gemma3.FAMILY,
                        deepseek_v3.FAMILY)}


def family(cfg) -> ModelFamily:
  """The family of a model config (any family's config dataclass)."""
  return FAMILIES[cfg.architecture]


def build(cfg, decode: bool = False) -> nn.Module:
  """The Flax module for a model config; decode: on a KV cache."""
  return family(cfg).module(cfg, decode=decode)


def init_params(cfg, rng: jax.Array) -> dict:
  """Fresh parameters, the same values whether cfg.compute.scan_layers is on or off.

  Flax draws a scanned stack's blocks from one key split per layer, and
  unrolled blocks from keys folded with their names, so a speed knob would
  change the run. Both are drawn as the scanned model draws them; unrolled,
  the stack is then cut into its blocks. Initialising runs the model once, with XLA's
  attention: the parameters are the same for every kernel, and it traces on any device.
  """
  scanned = common.with_compute(cfg, scan_layers=True, attention_impl="xla")
  params = build(scanned).init(rng, jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]
  return params if cfg.compute.scan_layers else unstack_layers(cfg, params)


def unstack_layers(cfg, tree: dict) -> dict:
  """A scanned model's params (or gradients) laid out as the unrolled model's."""
  unrolled = family(cfg).layer_stack
  tree = dict(tree)
  for name, layers in family(cfg).stacks(cfg):
    stack = tree.pop(name)
    tree |= {f"{unrolled}_{i}": jax.tree.map(lambda x, j=j: x[j], stack)
             for j, i in enumerate(layers)}
  return tree


def stack_layers(cfg, tree: dict) -> dict:
  """unstack_layers' inverse: an unrolled model's params laid out as the scanned model's.

  Stacked by numpy, on the host: what is stacked is a checkpoint read from disk, and one
  device need not hold a whole model.
  """
  unrolled = family(cfg).layer_stack
  tree = dict(tree)
  for name, layers in family(cfg).stacks(cfg):
    blocks = [tree.pop(f"{unrolled}_{i}") for i in layers]
    tree[name] = jax.tree.map(lambda *xs: np.stack(xs), *blocks)
  return tree


def flops_per_token(cfg, params, causal: bool = True, frozen=None, reference: bool = False
                    ) -> float:
  """flops.flops_per_token for a model config and its params (arrays or shapes): every
  parameter counts as a matmul weight but the family's lookup tables and the experts a
  token is not routed to. `frozen`: the part of params that trains not (LoRA's base), whose
  weight gradients are never computed. `reference`: DPO's reference model runs forward on
  every token too (the model without LoRA: on the frozen base, else on a copy of params)."""
  reference_params = params if frozen is None else frozen
  return flops.flops_per_token(_matmul_params(cfg, params), cfg.num_layers, cfg.num_heads,
                               cfg.head_dim, cfg.seq_len, causal,
                               frozen_params=_matmul_params(cfg, frozen) if frozen else 0,
                               reference_params=(_matmul_params(cfg, reference_params)
                                                 if reference else 0))


def int8_flops_per_token(cfg, params, frozen=None, reference: bool = False) -> float:
  """Of flops_per_token's, those int8 products carry under compute.quantization=int8 (0
  otherwise): 6 per weight of the layers' projections (int8.QUANTIZED_KERNELS) and of the
  experts a token is routed to (int8.QUANTIZED_EXPERTS, k / num_experts of the stacks), 4 where
  frozen (LoRA's base), 2 more for DPO's reference forward."""
  if cfg.compute.quantization != "int8":
    return 0.0
  def share(path: str) -> float:  # Of the weight's products a token makes.
    if int8.QUANTIZED_KERNELS.search("/" + path):
      return 1.0
    if int8.QUANTIZED_EXPERTS.search("/" + path):
      return cfg.moe.num_experts_per_token / cfg.moe.num_experts
    return 0.0
  weights = sum(x.size * share(path) for path, x in lora.paths(frozen or params))
  return (4 if frozen else 6) * weights + (2 * weights if reference else 0)


def _matmul_params(cfg, params) -> float:
  lookups = sum(params[name]["embedding"].size for name in family(cfg).lookup_tables(params))
  return (sum(x.size for x in jax.tree.leaves(params)) - lookups
          - family(cfg).inactive_params(cfg, params))
