"""
The checksums a checkpoint carries (meta["digests"]) and each restore verifies: one per array,
computed where the array lives, the same on any mesh and any number of processes (see digests).
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def digests(tree):
    """{path: 16 hex digits} of every array in `tree`, such as "params/h/0/attn/c_attn/kernel": a
    checksum of its bits as one global array, computed where it lives (one jit, on the shards), the
    same on any mesh and any number of processes. Two sums mod 2^32 over the array's bits as uint32
    x_i (narrower dtypes widened), i the flat index: sum(x_i * (2i + 1)), which any one flipped bit
    changes (2^k times an odd number is never 0 mod 2^32), and the sum of a murmur3 mix of x_i ^ (i
    * golden ratio), so that a random corruption of many bits goes unseen with odds of about
    2^-64."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if not leaves:
        return {}
    # one program over all arrays. A jit per array compiles faster (a dozen shapes among GPT-2's 446
    # arrays), but puts hundreds of programs with collectives in flight at once, and two processes
    # on CPU hung in them
    arrays = [x for _, x in leaves]
    # (arrays, 2) uint32
    sums = np.asarray(_digest_sums(arrays, tuple(_whole_axes(x) for x in arrays)))
    return {
        jax.tree_util.keystr(path, simple=True, separator="/").removesuffix(
            "/value"
        ): f"{a:08x}{b:08x}"
        for (path, _), (a, b) in zip(leaves, sums.tolist())
    }


def mismatch(tree, saved):
    """What differs between the arrays of `tree` and `saved`, their digests saved with them, in a
    few words (the first array that differs, or that has none saved), or None where all agree."""
    return next(
        (
            f"{key} differs from the checksum saved with it: the checkpoint is corrupt"
            if key in saved
            else f"its meta has no checksum of {key}"
            for key, digest in digests(tree).items()
            if saved.get(key) != digest
        ),
        None,
    )


def _whole_axes(x):
    """The axes along which each device holds the whole array (summing along them moves no data)."""
    shape = np.shape(x)
    if not isinstance(getattr(x, "sharding", None), jax.sharding.Sharding):
        return tuple(range(len(shape)))
    return tuple(a for a, n in enumerate(x.sharding.shard_shape(shape)) if n == shape[a])


@partial(jax.jit, static_argnums=1)
def _digest_sums(arrays, whole_axes):
    return jnp.stack([_digest(x, axes) for x, axes in zip(arrays, whole_axes)])


def _digest(x, whole_axes):
    """(2,) uint32: the two sums of `x` (see digests)."""
    bits = _as_uint32(x)
    i = _flat_index(bits.shape)
    return jnp.stack(
        [
            _sum(bits * (2 * i + 1), whole_axes),
            _sum(_fmix32(bits ^ (i * jnp.uint32(0x9E3779B9))), whole_axes),
        ]
    )


def _as_uint32(x):
    """x's bits: bitcast to the unsigned int of its width, widened to uint32 (8-byte dtypes: two
    uint32 each)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if x.dtype.itemsize > 4:
        return lax.bitcast_convert_type(x, jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _flat_index(shape):
    """Each element's index in the flattened array, mod 2^32, without flattening it (a reshape of a
    sharded array can move data between devices)."""
    i, stride = jnp.uint32(0), 1
    for axis in reversed(range(len(shape))):
        i = i + lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return i


def _fmix32(h):
    """murmur3's finalizer: every input bit flips each output bit with probability ~1/2."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _sum(v, whole_axes):
    """v's sum mod 2^32. XLA:CPU fuses no computation into a reduction: the values would be written
    out in full, then read. Halved first, along axes each device holds whole, the computation fuses
    into the halving, which writes an eighth of them for the reduction to read; 3 halvings at most,
    as XLA fuses it into 8 slices of it, not 16."""
    halvings = 0
    for axis in whole_axes:
        while v.shape[axis] % 2 == 0 and halvings < 3 and v.size > 1024:
            half = v.shape[axis] // 2
            v = lax.slice_in_dim(v, 0, half, axis=axis) + lax.slice_in_dim(
                v, half, 2 * half, axis=axis
            )
            halvings += 1
    return jnp.sum(v, dtype=jnp.uint32)
