"""Token mixers: retention, causal attention, each one module behind `base.Mixer` (`retnet_jax.models.architectures`
maps config names to them)."""
