"""Text and synthetic data: sources, tokenizers, prepared corpora and their cache, Grain batches, validation batches."""
