"""The architectures' home: every architecture by its GPTConfig.arch (models: GPT-2 from model.py,
the speedrun records beside it), each with its own kernels and optimizer pieces.
May import: model, dataio, compute, configurator, and its own modules."""
