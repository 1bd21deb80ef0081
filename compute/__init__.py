"""The device and numerics layer: the mesh and every parameter's layout (sharding), the accelerator
tables, the attention kernels, the blocks' layers (loop or scan, remat, the head, the loss) and
KV-cache generation. May import: configurator, and its own modules."""
