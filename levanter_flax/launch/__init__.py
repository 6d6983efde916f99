"""Experiments the XManager way: a config file plus work units of config overrides.

    python -m levanter_flax.launch launch/nano_lr_sweep.py [--executor=local|xm] [--max_parallel=N]
"""
from levanter_flax.launch.experiment import Experiment, product, sweep, zipit

__all__ = ["Experiment", "product", "sweep", "zipit"]
