"""The neural-network pieces every model shares: matmuls with a float32 result, projections, norms, embedding,
feed-forward, the stack of blocks (scan, remat), rotary positions."""
