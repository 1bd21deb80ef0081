"""Parity checks: our JAX code against the PyTorch reference (transformers' GPT2LMHeadModel)."""
