"""The optimizer as optax transformations: AdamW and its peers with their parameter groups
(optimizers), learning-rate schedules, and the loss-spike skip with its rollback record
(spikes). May import core and parallel."""
