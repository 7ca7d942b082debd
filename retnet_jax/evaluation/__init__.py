"""Evaluation and generation: loss by form and position, passkey, lm-eval, the Sampler and its checks."""
