"""Attention kernels' inputs and gradients, for test_attention.py and test_window_attention.py: the
forward and the three gradients of a kernel, and record 20's window inputs (documents that start
inside blocks)."""

import jax
import jax.numpy as jnp
import numpy as np

from compute.attention import causal_attention


def causal_forward_and_grads(implementation, q, k, v, g):
    """y and the gradients of sum(y * g) wrt q, k, v."""

    def f(q, k, v):
        y, vjp = jax.vjp(lambda *a: causal_attention(*a, implementation), q, k, v)
        return (y, *vjp(g))

    return jax.jit(f)(q, k, v)


def window_inputs(B=2, T=1024, seed=0):
    """q, k, v, a cotangent (B, T, 2, 32) and document numbers: row 0 one document, the others
    three, their starts inside blocks."""
    rng = np.random.default_rng(seed)
    q, k, v, g = (jnp.asarray(rng.standard_normal((B, T, 2, 32)), jnp.float32) for _ in range(4))
    starts = np.zeros((B, T), np.int32)
    starts[1:, [T // 3 + 5, T // 2 + 70]] = 1
    return q, k, v, g, jnp.asarray(np.cumsum(starts, axis=1))


def forward_and_grads(attend, q, k, v, g):
    y, vjp = jax.vjp(attend, q, k, v)
    return (y, *vjp(g))
