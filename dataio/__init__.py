"""Bytes in and out: storage (local paths and gs://), checksums, tokenizers, token files and the
loaders over them, weights in other formats and pretrained loading, HellaSwag's data.
May import: compute, configurator, and its own modules."""
