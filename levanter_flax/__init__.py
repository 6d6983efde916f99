"""levanter_flax: an LLM trainer for JAX built on Flax Linen with explicit partition rules.

    import levanter_flax as lf
    result = lf.train(lf.load_config("gpt2:nano"), "runs/nano")

The Python API (commands/api.py) loads on first use: every command imports this package
first, and most commands need neither jax nor TensorFlow before they parse their flags.
"""
import os

__version__ = "0.1.0"

# TensorFlow (input pipeline only) prints a screenful of INFO lines on import.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
# Its oneDNN kernels speed up no op of the input pipeline, and on CPUs without AVX-512 they log
# an error-level line for the integer ops that decode a shard.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

# What `import levanter_flax as lf` offers, each from levanter_flax.commands.api.
_API = ("train", "load", "load_config", "Callback", "TrainResult", "Loaded")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
  if name in _API:
    # pylint: disable-next=g-import-not-at-top  # jax, flax: heavy.
    from levanter_flax.commands import api
    return getattr(api, name)
  raise AttributeError(f"module 'levanter_flax' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted([*globals(), *_API])

