"""
How the stack of blocks runs: a Python loop, or one lax.scan over their params stacked on a leading layer axis
(scan_layers), each block with or without remat; and the conditionals XLA:CPU needs in the backward pass.
"""

import re

import jax
import jax.numpy as jnp
from flax import nnx

import sharding

# remat: what each Block keeps from its forward pass for the backward (the rest is recomputed there), as a
# jax.checkpoint policy
REMAT = {
    "none": None,  # no checkpointing: everything is kept
    "block": jax.checkpoint_policies.nothing_saveable,  # only the block's input: the whole block is recomputed
    # the Linear layers' outputs (matmuls without batch dimensions); attention, GELU, LayerNorm are recomputed
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # the attention branch's matmul outputs only (q, k, v and its projection: 4C a token, dots keeps 9C); the MLP's
    # c_fc is recomputed, an extra 8C^2 FLOPs a token a layer (~11% of the step's 72C^2)
    "qkv_proj": jax.checkpoint_policies.save_only_these_names("qkv", "attn_proj"),
}


@jax.custom_vjp
def fusion_barrier_in_grad(x):
    """Identity whose backward passes the cotangent through a conditional, a fusion boundary XLA:CPU keeps,
    so that it is computed once, into a buffer. At each block's input that is the residual stream's gradient,
    the sum of every later block's contribution: left alone, XLA:CPU fuses that sum into each consumer and
    recomputes it there, a cost quadratic in depth (README, Benchmarks)."""
    return x


def _barrier_bwd(_, g):
    # both branches give g; the predicate depends on the data, so XLA cannot fold the conditional away
    return (jax.lax.cond(g.ravel()[0] > 0, lambda a, b: a, lambda a, b: b, g, g),)


fusion_barrier_in_grad.defvjp(lambda x: (x, None), _barrier_bwd)


def remat(f, policy):
    """jax.checkpoint(f, policy=policy): the backward pass recomputes what the policy does not save. On XLA:CPU that
    alone saves nothing: its pipeline drops jax's optimization barriers
    early, CSE merges the recomputation back into the forward pass, and without CSE the scheduler still runs it
    there. So on CPU the backward runs inside a conditional on the output's cotangent, as fusion_barrier_in_grad:
    a boundary CSE does not cross, which cannot start before the backward pass reaches it."""
    f = jax.checkpoint(f, policy=policy)
    if sharding.target_platform() != "cpu":  # jax's remat as used on GPU/TPU; a conditional costs a host round trip
        return f

    @jax.custom_vjp
    def g(*args):
        return f(*args)

    def bwd(f_vjp, ct):  # f_vjp holds what the policy saved; both branches recompute the rest, then backpropagate
        return jax.lax.cond(ct.ravel()[0] > 0, lambda f, g: f(g), lambda f, g: f(g), f_vjp, ct)

    g.defvjp(lambda *args: jax.vjp(f, *args), bwd)
    return g


def run_block(block, x, key, remat_policy):
    """block(x, key); remat_policy (an entry of REMAT, not 'none') has its forward pass recomputed in the backward."""
    graphdef, state = nnx.split(block)
    return block_fn(graphdef, remat_policy)(state, x, key)


def block_fn(graphdef, remat_policy):
    """(block state, x, key) -> the block's output; remat_policy None: everything kept for the backward."""
    def f(state, x, key):
        return nnx.merge(graphdef, state)(x, key)
    return f if remat_policy is None else remat(f, remat_policy)


def stack_blocks(blocks):
    """One Block whose every param has a leading layer axis (scan_layers), from a list of Blocks."""
    graphdef = nnx.split(blocks[0])[0]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *(nnx.split(b)[1] for b in blocks)))


def relayout_blocks(tree, template):
    """`tree` (params, or an optimizer state holding them) in the layout of the blocks in `template` (the same tree
    with the blocks stacked, or not: scan_layers): h.{i}.x <-> row i of h.x. A checkpoint saved with one
    scan_layers value restores into the other this way; jit it with the template's shardings."""
    def path_of(key_path):
        return jax.tree_util.keystr(key_path, simple=True, separator=".")

    flat = {path_of(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}

    def leaf(key_path, t):
        path = path_of(key_path)
        if path in flat:  # not a block's, or the same layout
            return flat[path]
        if m := re.search(r"(^|\.)h\.(\d+)\.", path):  # layer i of a stacked source
            return flat[f"{path[:m.end(1)]}h.{path[m.end():]}"][int(m.group(2))]
        m = sharding.STACKED.search(path)  # stacked from one source per layer
        return jnp.stack([flat[f"{path[:m.end()]}{i}.{path[m.end():]}"] for i in range(t.shape[0])])

    return jax.tree_util.tree_map_with_path(leaf, template)
