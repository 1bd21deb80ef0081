"""The benchmarks: speed and memory beside the PyTorch references, TPU and GPU sizing, the
one-command GPU check. Each runs from the repository's root as a module, `python -m bench.<name>`
(docs/benchmarks.md)."""
