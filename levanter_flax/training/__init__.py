"""Training: the jitted steps (step), the loop that runs them with eval, checkpoints and
fault tolerance (loop), the start-up before the loop (start: what a start chooses in choices,
what a resume checks in resume_checks, the state restored or built in restore), the batch-size
search (batch_search) and user callbacks. May import every package but the commands.

Named `training`, not `train`: `import levanter_flax as lf; lf.train(...)` is the API's
function, and a subpackage of that name would take its place once imported."""
