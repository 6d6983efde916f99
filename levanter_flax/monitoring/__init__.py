"""Watching a run: metric writers and throughput (metrics), W&B (wandb_writer), the profiler
window, memory figures and the hang watchdog (watch), metrics.jsonl read back (history) and
runs compared in plots and a table (report). May import core."""
