"""Training: the loop, the train state and pure step, optimizer, losses, checkpoints and the choice of a run's step,
metrics, faults."""
