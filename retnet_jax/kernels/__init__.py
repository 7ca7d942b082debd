"""Fused Pallas kernels for chunkwise retention (GPU, Triton lowering; interpret mode elsewhere, for tests).

    out, state = kernels.chunkwise_retention(q, k, v, log_decay, chunk_size, state=None, segment_ids=None)
    out, state, qz, key_sum = kernels.chunkwise_retention_with_key_sum(q, k, v, log_decay, chunk_size, state, key_sum)
    kernels.check_supported(d_k, d_v, dtype, chunk_size)  # ValueError naming the limit and the fix, else None

Same contract as `retention.chunkwise_retention`; the second form also returns what the `shared` stability
normaliser needs from the same pass. With `segment_ids` (packed documents, `segments`) retention restarts at each
document. Modules: `support` (limits, block sizes, interpret default), `common` (grid, block specs, in-kernel decays,
document masks), `forward`, `backward` (the kernels), `chunkwise` (padding, custom VJP).
"""

from retnet_jax.kernels.chunkwise import chunkwise_retention, chunkwise_retention_with_key_sum
from retnet_jax.kernels.support import KernelConfig, Tiling, check_supported, default_config, is_supported

__all__ = ["KernelConfig", "Tiling", "check_supported", "chunkwise_retention", "chunkwise_retention_with_key_sum",
           "default_config", "is_supported"]
