"""Runs: a run's folder (where each file lives, its lock, its config.json, results files) and the scripts' command
line (the prelude, shared flags and messages, the entry point)."""
