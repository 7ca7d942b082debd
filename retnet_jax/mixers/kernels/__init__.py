"""Pallas kernels for chunkwise retention (GPU, Triton lowering; interpret mode elsewhere, for tests).

    out, state = kernels.chunkwise_retention(q, k, v, log_decay, chunk_size, state=None, segment_ids=None)
    out, state, qz, key_sum = kernels.chunkwise_retention_with_key_sum(q, k, v, log_decay, chunk_size, state, key_sum)
    kernels.check_supported(d_k, d_v, dtype, chunk_size, layout="split")  # ValueError naming limit and fix, or None

Same contract as `retention.chunkwise_retention`; the second form also returns what the `shared` stability
normaliser needs from the same pass. With `segment_ids` (packed documents, `segments`) retention restarts at each
document. Two layouts (`KernelConfig.layout`): `split` (default), a serial state pass writing each chunk's entering
state and chunk-parallel output and gradient kernels, with per-token decays (`log_decay` `[batch, seq, heads]`) and
the decays' exact gradient; `fused`, one program per (value tile, batch, head) walking every chunk, per-head decays
only, no gradient for them. Modules: `support` (limits, tilings, layouts, launch grids, interpret default), `common`
(grids, block specs, in-kernel decays, document masks), `state_pass`, `output_pass`, `split_backward` (the split
kernels), `split` (their custom VJP), `forward`, `backward` (the fused kernels), `chunkwise` (checks, padding, the
fused custom VJP, the public functions).
"""

from retnet_jax.mixers.kernels.chunkwise import chunkwise_retention, chunkwise_retention_with_key_sum
from retnet_jax.mixers.kernels.support import (LAYOUTS, KernelConfig, Tiling, check_supported, default_chunk,
                                               default_config, is_supported, launch_grids)

__all__ = ["KernelConfig", "LAYOUTS", "Tiling", "check_supported", "chunkwise_retention",
           "chunkwise_retention_with_key_sum", "default_chunk", "default_config", "is_supported", "launch_grids"]
