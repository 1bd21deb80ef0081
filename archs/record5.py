"""
modded-nanogpt's record 5 (arch='speedrun',
records/track_1_short/2024-10-14_ModernArch/train_gpt2.py in KellerJordan/modded-nanogpt; its torch
side in parity/speedrun_reference.py) as GPT-2's modules with what the record changed, so that
GPT-2's classes in model.py carry no branch of its: rotary positions and QK-norm, weightless
RMSNorm, ReLU², zero-initialised projections, torch's default inits elsewhere, no position
embedding, no biases. Its model serves the rest of the project through GPT's interface, its Arch
answers what the rest asks (docs/model.md); archs/models.py registers it.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from archs.arch import Arch
from compute.layers import (
    RMSNorm,
    embedding,
    rms_norm,
    rotary,
    rotary_tables,
)
from dataio import pretrained, weights
from model import GPT, MLP, Block, CausalSelfAttention, GPTConfig, cropped, stack


def torch_linear_init(fan_in):
    """torch nn.Linear's default init, U(-1/sqrt(fan_in), 1/sqrt(fan_in)): record 5's, which keeps
    torch's inits."""
    bound = 1 / math.sqrt(fan_in)
    return lambda key, shape, dtype=jnp.float32: jax.random.uniform(
        key, shape, dtype, -bound, bound
    )


# the residual projections' init (zero init suggested by @Grad62304977)
ZERO = nnx.initializers.zeros_init()


class Record5Attention(CausalSelfAttention):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        super().__init__(config, rngs, torch_linear_init(config.n_embd), ZERO)

    def qkv(self, x, pos=0, length=None):
        """q and k rotated (rotary_tables of `length` positions, default T, from which pos may be
        traced), then RMS-normed over the head (QK norm suggested by @Grad62304977); before the
        kernel, so that every kernel of compute/attention.py serves both architectures."""
        q, k, v = super().qkv(x)  # (B, T, nh, hs)
        T, hs = q.shape[1], q.shape[3]
        cos, sin = (  # (T, hs/2)
            jax.lax.dynamic_slice_in_dim(jnp.asarray(t), pos, T)
            for t in rotary_tables(length or T, hs)
        )
        return rms_norm(rotary(q, cos, sin)), rms_norm(rotary(k, cos, sin)), v


class Record5MLP(MLP):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        super().__init__(config, rngs, torch_linear_init(config.n_embd), ZERO)

    def activation(self, h):
        return jnp.square(jax.nn.relu(h))  # ReLU² (suggested by @SKYLINEZ007 and @Grad62304977)


class Record5Block(Block):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        self.ln_1 = RMSNorm()  # F.rms_norm without a weight: no params
        self.attn = Record5Attention(config, rngs)
        self.ln_2 = RMSNorm()
        self.mlp = Record5MLP(config, rngs)


class Record5GPT(GPT):
    arch = "speedrun"
    title = "modded-nanogpt's record 5"
    exports = ("modded",)

    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        self.check_config(config)
        self.config = config
        # the tied embedding is the record's lm_head, an nn.Linear(n_embd, vocab): its init
        init = torch_linear_init(config.n_embd)
        self.wte = embedding(config.vocab_size, config.n_embd, rngs, init)
        self.h = stack(config, [Record5Block(config, rngs) for _ in range(config.n_layer)])
        self.ln_f = RMSNorm()

    @classmethod
    def check_config(cls, config: GPTConfig):
        if config.bias:
            raise ValueError(
                "arch='speedrun' has no biases (modded-nanogpt's record 5): set bias=False"
            )
        if (config.n_embd // config.n_head) % 2:
            raise ValueError(
                "arch='speedrun' rotates the halves of each head: the head size n_embd / n_head "
                f"must be even, got {config.n_embd // config.n_head}"
            )

    def embed(self, idx, positions):
        return self.wte(idx)  # no position embedding: rotary acts in attention

    def num_params(self, non_embedding=True):
        return super().num_params(non_embedding=False)  # no position embedding to leave out

    def crop_block_size(self, block_size):
        self.config = cropped(self.config, block_size)  # rotary serves any length

    def weight_rows(self):
        return weights.weight_map(self.config.n_layer, False, kept=weights.SPEEDRUN_PARAMS)

    def modded_state(self):
        """(the record's state dict, the line of its script that builds this GPT)."""
        return pretrained.to_modded_state(self), pretrained.record5_code(self.config)


class Record5(Arch):
    model = Record5GPT
