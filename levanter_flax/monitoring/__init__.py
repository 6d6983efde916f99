"""Watching a run: metric writers and throughput (metrics), W&B (wandb_writer), the profiler
window, memory figures and the hang watchdog (watch). May import core."""
