"""levanter_flax: an LLM trainer for JAX built on Flax Linen with explicit partition rules.

    import levanter_flax as lf
    result = lf.train(lf.load_config("gpt2:nano"), "runs/nano")

The Python API (api.py) loads on first use: `python -m levanter_flax.X` imports this package
first, and most commands need neither jax nor TensorFlow before they parse their flags.
"""
import os
import sys
import types

__version__ = "0.1.0"

# TensorFlow (input pipeline only) prints a screenful of INFO lines on import.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
# Its oneDNN kernels speed up no op of the input pipeline, and on CPUs without AVX-512 they log
# an error-level line for the integer ops that decode a shard.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

# What `import levanter_flax as lf` offers, each from levanter_flax.api.
_API = ("train", "load", "load_config", "Callback", "TrainResult", "Loaded")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
  if name in _API:
    from levanter_flax import api  # pylint: disable=g-import-not-at-top  # jax, flax: heavy.
    return getattr(api, name)
  raise AttributeError(f"module 'levanter_flax' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted([*globals(), *_API])


class _Package(types.ModuleType):
  """This package, whose `train` is always lf.train, the API's function.

  The training loop's module is levanter_flax.train too, and importing it would bind the
  package's `train` to it, before or after a lazy export: which one `lf.train` meant would
  depend on what was imported first. Here the import system's binding is dropped; import the
  module as `from levanter_flax.train import ...`.
  """

  @property
  def train(self):
    from levanter_flax import api  # pylint: disable=g-import-not-at-top
    return api.train

  @train.setter
  def train(self, submodule: types.ModuleType) -> None:
    del submodule  # Still sys.modules["levanter_flax.train"].


sys.modules[__name__].__class__ = _Package
