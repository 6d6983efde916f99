"""The fit plan: a run's train step compiled for a TPU topology that is not there, and what the
compiler says of it (memory per chip, FLOPs, collective bytes).

slices names TPU slices and gives their compile-only devices; hlo counts a compiled program's
collectives; planner compiles the trainer's own step and reads the figures. The `aot` command
and bench/tpu_plan.py sit on top. May import training, parallel, models, config and core; never
TensorFlow.
"""
