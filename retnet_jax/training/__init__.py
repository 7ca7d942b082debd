"""Training: the loop, the train state and pure step, optimizer, losses, checkpoints and work directories, metrics,
faults, the scripts' shared entry point."""
