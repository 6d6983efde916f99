"""Training: the jitted steps (step), the loop that runs them with eval, checkpoints and
fault tolerance (loop), what a start chooses and a resume checks (resume), the batch-size
search (batch_search) and user callbacks. May import every package but the commands."""
