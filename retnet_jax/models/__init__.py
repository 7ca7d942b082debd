"""The models: the registry of each layer's token mixer (`architectures`), the one `Model` class, the presets and every
config field's default."""
