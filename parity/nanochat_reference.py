"""
nanochat's GPT in PyTorch on a CPU (karpathy/nanochat, nanochat/gpt.py; attention as
nanochat/flash_attention.py's SDPA fallback computes it, its KV cache as nanochat/engine.py's
KVCache keeps it), the torch side of parity/check_nanochat.py and tests/test_nanochat_model.py;
archs/nanochat.py is ours. Written by reading nanochat's code: its state-dict names, so one of its
model_*.pt loads here and ours saves as one. In float32 (nanochat's COMPUTE_DTYPE on a CPU).

- The blocks: x <- resid_lambda * x + x0_lambda * x0, then x + attn(norm(x)), x + mlp(norm(x)),
  norm the weightless F.rms_norm (eps: float32's machine epsilon, torch's default).
- Attention: q from n_head heads, k and v from n_kv_head (GQA); v plus 3·sigmoid(ve_gate(x[:12]))
  times the layer's value embedding (alternate layers, the last always); rotary at base 100000
  with nanochat's sign (x1 cos + x2 sin, -x1 sin + x2 cos), then norm, then both times 1.2; scaled
  dot-product attention (1/sqrt(head size)) over the keys 0..window positions behind each query.
- Windows: window_pattern tiled over the layers, L = sequence_len, S = a quarter of it rounded up to
  128, the last layer L.
- The embedding: norm(wte(idx)), then smeared: x_t + smear_lambda·sigmoid(smear_gate(x_t[:24]))
  x_{t-1} for t >= 1. The output of layer n_layer // 2, times backout_lambda, is subtracted before
  the final norm. Logits: the head (padded to a multiple of 64) sliced to vocab_size, 15·tanh(x/15).
- KVCache: per layer (B, S, n_kv_head, hs) keys and values, the position, and the last fed
  token's normed embedding for the next token's smear (nanochat's prev_embedding).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SOFTCAP = 15.0
ROTARY_BASE = 100000
GATE_CHANNELS = 12  # the value embedding's gate reads x's first 12 channels
SMEAR_CHANNELS = 24


@dataclass
class Config:  # nanochat's GPTConfig fields
    sequence_len: int = 256
    vocab_size: int = 200
    n_layer: int = 3
    n_head: int = 4
    n_kv_head: int = 2
    n_embd: int = 64
    window_pattern: str = "SSL"


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def with_value_embedding(layer, n_layer):
    return layer % 2 == (n_layer - 1) % 2


def layer_windows(config):
    """Each layer's window: how many positions behind a query its keys may be."""
    long = config.sequence_len
    short = math.ceil(long / 4 / 128) * 128
    letters = config.window_pattern.upper()
    windows = [long if letters[i % len(letters)] == "L" else short for i in range(config.n_layer)]
    windows[-1] = long
    return windows


def rotate(x, cos, sin):
    """x (B, T, h, hs), cos and sin (T, hs/2): each head's halves turned against each other."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([a * cos + b * sin, b * cos - a * sin], dim=-1)


def attend(q, k, v, q_start, window):
    """q (B, Tq, H, hs) at positions q_start.., k and v (B, Tk, Hkv, hs) at 0..Tk-1 -> (B, Tq, H,
    hs): each query over the keys 0..window positions behind it."""
    q_pos = q_start + torch.arange(q.shape[1])[:, None]
    behind = q_pos - torch.arange(k.shape[1])[None, :]
    allowed = (behind >= 0) & (behind <= window)
    q, k, v = (a.transpose(1, 2) for a in (q, k, v))
    grouped = q.shape[1] != k.shape[1]
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=grouped)
    return y.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        C, H, Hkv = config.n_embd, config.n_head, config.n_kv_head
        self.heads, self.kv_heads, self.head_size = H, Hkv, C // H
        self.layer = layer
        self.c_q = nn.Linear(C, C, bias=False)
        self.c_k = nn.Linear(C, Hkv * self.head_size, bias=False)
        self.c_v = nn.Linear(C, Hkv * self.head_size, bias=False)
        self.c_proj = nn.Linear(C, C, bias=False)
        gated = with_value_embedding(layer, config.n_layer)
        self.ve_gate = nn.Linear(GATE_CHANNELS, Hkv, bias=False) if gated else None

    def forward(self, x, ve, cos, sin, window, cache=None):
        B, T, _ = x.shape
        q = self.c_q(x).view(B, T, self.heads, self.head_size)
        k = self.c_k(x).view(B, T, self.kv_heads, self.head_size)
        v = self.c_v(x).view(B, T, self.kv_heads, self.head_size)
        if ve is not None:
            gate = 3 * torch.sigmoid(self.ve_gate(x[..., :GATE_CHANNELS]))  # (B, T, Hkv)
            v = v + gate[..., None] * ve.view_as(v)
        q, k = (norm(rotate(a, cos, sin)) * 1.2 for a in (q, k))
        start = 0
        if cache is not None:  # write this call's keys and values, attend to everything so far
            start = cache.position
            cache.k[self.layer][:, start : start + T] = k
            cache.v[self.layer][:, start : start + T] = v
            k, v = cache.k[self.layer][:, : start + T], cache.v[self.layer][:, : start + T]
        y = attend(q, k, v, start, window)
        return self.c_proj(y.reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.attn = Attention(config, layer)
        self.mlp = MLP(config)

    def forward(self, x, ve, cos, sin, window, cache=None):
        x = x + self.attn(norm(x), ve, cos, sin, window, cache)
        return x + self.mlp(norm(x))


class KVCache:
    """Keys and values of every layer (B, S, n_kv_head, hs), the next position, and the last fed
    token's normed embedding (the next token's smear reads it)."""

    def __init__(self, config, batch, length):
        shape = (batch, length, config.n_kv_head, config.n_embd // config.n_head)
        self.k = [torch.zeros(shape) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape) for _ in range(config.n_layer)]
        self.position = 0
        self.last_embedding = None


class GPT(nn.Module):
    def __init__(self, config, vocab_multiple=64):
        super().__init__()
        self.config = config
        C, L = config.n_embd, config.n_layer
        rows = -(-config.vocab_size // vocab_multiple) * vocab_multiple
        kv_width = config.n_kv_head * (C // config.n_head)
        self.windows = layer_windows(config)
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(rows, C),
                "h": nn.ModuleList(Block(config, i) for i in range(L)),
            }
        )
        self.lm_head = nn.Linear(C, rows, bias=False)
        self.resid_lambdas = nn.Parameter(torch.ones(L))
        self.x0_lambdas = nn.Parameter(torch.zeros(L))
        self.smear_gate = nn.Linear(SMEAR_CHANNELS, 1, bias=False)
        self.smear_lambda = nn.Parameter(torch.zeros(1))
        self.backout_lambda = nn.Parameter(torch.zeros(1))
        self.value_embeds = nn.ModuleDict(
            {str(i): nn.Embedding(rows, kv_width) for i in range(L) if with_value_embedding(i, L)}
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, generator=None):
        """nanochat's init_weights: wte N(0, 0.8), lm_head N(0, 0.001), the blocks' q, k, v and the
        value embeddings U(±sqrt(3/C)), c_fc U(±0.4·sqrt(3/C)), both projections 0, the gates
        U(0, 0.02); resid_lambdas 1.15 -> 1.05 and x0_lambdas 0.20 -> 0.05 over the layers,
        smear_lambda 0, backout_lambda 0.2."""
        g, C, L = generator, self.config.n_embd, self.config.n_layer
        bound = math.sqrt(3) / math.sqrt(C)
        self.transformer.wte.weight.normal_(0.0, 0.8, generator=g)
        self.lm_head.weight.normal_(0.0, 0.001, generator=g)
        for block in self.transformer.h:
            for w in (block.attn.c_q, block.attn.c_k, block.attn.c_v):
                w.weight.uniform_(-bound, bound, generator=g)
            block.mlp.c_fc.weight.uniform_(-0.4 * bound, 0.4 * bound, generator=g)
            block.attn.c_proj.weight.zero_()
            block.mlp.c_proj.weight.zero_()
            if block.attn.ve_gate is not None:
                block.attn.ve_gate.weight.uniform_(0.0, 0.02, generator=g)
        steps = max(L - 1, 1)
        for i in range(L):
            self.resid_lambdas[i] = 1.15 - 0.10 * i / steps
            self.x0_lambdas[i] = 0.20 - 0.15 * i / steps
        self.smear_lambda.zero_()
        self.backout_lambda.fill_(0.2)
        self.smear_gate.weight.uniform_(0.0, 0.02, generator=g)
        for table in self.value_embeds.values():
            table.weight.uniform_(-bound, bound, generator=g)

    def rotary(self, start, T):
        """(cos, sin), each (T, hs/2), for positions start..start+T-1, float32."""
        hs = self.config.n_embd // self.config.n_head
        inv_freq = 1.0 / (ROTARY_BASE ** (torch.arange(0, hs, 2, dtype=torch.float32) / hs))
        angles = torch.outer(torch.arange(start + T, dtype=torch.float32), inv_freq)[start:]
        return angles.cos(), angles.sin()

    def smear(self, x, before):
        """x (B, T, C) normed embeddings; before: the one ahead of x[:, 0], or None."""
        lam = self.smear_lambda
        if x.shape[1] > 1:
            gate = lam * torch.sigmoid(self.smear_gate(x[:, 1:, :SMEAR_CHANNELS]))
            return torch.cat([x[:, :1], x[:, 1:] + gate * x[:, :-1]], dim=1)
        if before is not None:  # one token, decoding
            return x + lam * torch.sigmoid(self.smear_gate(x[..., :SMEAR_CHANNELS])) * before
        return x

    def forward(self, idx, targets=None, cache=None):
        """idx (B, T) -> logits (B, T, vocab_size) float32, or the mean cross-entropy against
        targets (-1 ignored). With a cache, idx sits at cache.position (nanochat's Engine: one
        prefill of the prompt, then one token a call)."""
        B, T = idx.shape
        start = 0 if cache is None else cache.position
        cos, sin = self.rotary(start, T)
        x = norm(self.transformer.wte(idx))
        before = None
        if cache is not None:
            before, cache.last_embedding = cache.last_embedding, x[:, -1:]
        x = x0 = self.smear(x, before)
        halfway = None
        for i, block in enumerate(self.transformer.h):
            x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            table = self.value_embeds[str(i)] if str(i) in self.value_embeds else None
            ve = None if table is None else table(idx)
            x = block(x, ve, cos, sin, self.windows[i], cache)
            if i == self.config.n_layer // 2:
                halfway = x
        if cache is not None:
            cache.position += T
        x = norm(x - self.backout_lambda * halfway)
        logits = self.lm_head(x)[..., : self.config.vocab_size].float()
        logits = SOFTCAP * torch.tanh(logits / SOFTCAP)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)

    @torch.no_grad()
    def greedy(self, prompt, steps):
        """prompt (B, T) -> (B, T + steps): argmax tokens through a KV cache (one prefill, then a
        token a call)."""
        cache = KVCache(self.config, prompt.shape[0], prompt.shape[1] + steps)
        ids, logits = prompt, self(prompt, cache=cache)
        for _ in range(steps):
            token = logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, token], dim=1)
            logits = self(token, cache=cache)
        return ids
