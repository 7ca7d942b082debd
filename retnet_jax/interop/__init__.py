"""PyTorch checkpoints: torchscale's RetNet and fla's (and its hybrids), safetensors folders."""
