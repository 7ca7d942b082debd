"""Baselines RetNet is compared against (same layers, same call signature)."""
