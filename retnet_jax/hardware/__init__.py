"""Accelerators: GPU and TPU targets, ahead-of-time plans, FLOP counts and MFU, matmul dtypes of a traced step."""
