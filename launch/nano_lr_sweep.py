"""Learning rate x batch size on gpt2_nano: 4 work units, each a short CPU run.

    python -m levanter_flax.launch launch/nano_lr_sweep.py --max_parallel=2
    levanter-flax report runs/experiments/nano_lr_sweep/*
"""
from levanter_flax.launch import Experiment, product, sweep


def get_experiment() -> Experiment:
  return Experiment(
      name="nano_lr_sweep",
      config="configs/gpt2_nano.py",
      work_units=product(sweep("optimizer.learning_rate", [1e-3, 3e-3]),
                         sweep("trainer.batch_size", [8, 16])),
      overrides={"trainer.num_train_steps": 200, "trainer.eval_every_steps": 100},
  )
