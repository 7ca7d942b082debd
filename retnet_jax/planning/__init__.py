"""Plans for accelerators: the train, eval, prefill and decode steps compiled ahead of time for a target (memory,
fit, FLOPs, collectives, bound; the batch search)."""
