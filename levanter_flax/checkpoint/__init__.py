"""What survives a crash: orbax checkpoints, their retention and restore (store), and the
stop signal of a preemption or SIGTERM (preemption). May import core, parallel and models."""
