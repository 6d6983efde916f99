"""The model families: each one's config dataclass, Flax module and partition rules."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from levanter_flax.models import gpt2, llama

CONFIGS = {"gpt2": gpt2.GPT2Config, "llama": llama.LlamaConfig}
PARTITION_RULES = {"gpt2": gpt2.PARTITION_RULES, "llama": llama.PARTITION_RULES}
# The name of each family's stack of blocks: <name>_<i> unrolled, <name> scanned.
LAYER_STACKS = {"gpt2": "h", "llama": "layers"}


def build(cfg, decode: bool = False) -> nn.Module:
  """The Flax module for a model config (GPT2Config or LlamaConfig); decode: on a KV cache."""
  module = {"gpt2": gpt2.GPT2LMHeadModel, "llama": llama.LlamaForCausalLM}[cfg.architecture]
  return module(cfg, decode=decode)


def init_params(cfg, rng: jax.Array) -> dict:
  """Fresh parameters, the same values whether cfg.scan_layers is on or off.

  Flax draws a scanned stack's blocks from one key split per layer, and
  unrolled blocks from keys folded with their names, so a speed knob would
  change the run. Both are drawn as the scanned model draws them; unrolled,
  the stack is then cut into its blocks.
  """
  scanned = dataclasses.replace(cfg, scan_layers=True)
  params = build(scanned).init(rng, jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]
  return params if cfg.scan_layers else unstack_layers(cfg, params)


def unstack_layers(cfg, tree: dict) -> dict:
  """A scanned model's params (or gradients) laid out as the unrolled model's."""
  name = LAYER_STACKS[cfg.architecture]
  tree = dict(tree)
  stack = tree.pop(name)
  return tree | {f"{name}_{i}": jax.tree.map(lambda x, i=i: x[i], stack)
                 for i in range(cfg.num_layers)}
