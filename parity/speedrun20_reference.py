"""
modded-nanogpt's record 20 in PyTorch on a CPU (KellerJordan/modded-nanogpt,
records/track_1_short/2025-01-16_Sub3Min/, the code at the head of its log), the torch side of a
parity check: its GPT (bf16 embedding tables, three value embeddings in a 012 ... 012 pattern, a
U-net of skip weights, merged QKV, half-truncated rotary, QK-norm, attention scale 0.12, ReLU², no
attention in layer 7, logits soft-capped by 30·sigmoid(x/7.5), the FP8 head) and the FlexAttention
block masks (document-causal, long and short sliding windows); Muon, the optimizer groups, the
schedules, one training step and the loader are in parity/speedrun20_training.py. Written from the
record's code, whose comments credit @KoszarskyB, @YouJiacheng, @Grad62304977, @leloykun,
@brendanh0gan, @fernbear.bsky.social, @scottjmaddox, @jxbz, @SKYLINEZ007 and Karpathy; each choice
below keeps its credit.

Differences, each for a reason:
- CPU, eager, one process (no cuda, compile or dist): the all-reduce AVG of one rank is the
  identity; train_step(world_size=W) divides the summed gradients by W to stand for W ranks.
- Attention is dense: softmax(q k^T * 0.12 + mask) v in float32, output in the inputs' dtype. The
  mask (block_masks) is the set of (q, kv) pairs the record's GPU kernel visits: the kv blocks its
  BlockMask lists after the clamps, mask_mod on the partial ones. FlexAttention's eager CPU path
  skips no block (it applies mask_mod everywhere: any window would be document-causal over the
  whole sequence), so it is not what the record computes. The lists come out as document-causal
  within the query's block and the max(w, 1) - 1 before it (w 0, the short window at w 1, clamps
  the full count to -1: none). O(T²) memory: a reference for short sequences.
- dtypes are arguments: embed_dtype (the record: bf16 tables, which make every activation bf16) and
  Muon's ns_dtype (the record: bf16); float32 for both runs the model all-fp32.
- fp8_head (default False): the head in training through the record's FP8 matmul (e4m3 x*2 and
  w*32, e5m2 gradient *2**29), an autograd.Function over torch._scaled_mm, which runs on a CPU in
  torch 2.13: it multiplies the dequantised fp8 values in float32 and rounds once to out_dtype. The
  GPU's forward uses fast (lower-precision) fp8 accumulation; CPU rounding differs there.
- Adam is torch's single-tensor Adam (the record: fused on CUDA, which computes bf16 params' update
  in float32; the single-tensor path rounds bf16 intermediates).
- What the record fixes at 12 layers is a function of num_layers (value_embed_pattern,
  long_window_pattern; skip_attn_layer an argument); the window's growth (1728), the momentum
  warmup (300 steps) and the block size (128) are arguments with the record's defaults.
"""

import torch
import torch.nn.functional as F
from torch import nn

EOT = 50256  # GPT-2's <|endoftext|>: each one opens a document
ATTN_SCALE = 0.12  # instead of head_dim**-0.5, by @leloykun
SOFTCAP = 30.0  # 30·sigmoid(x/7.5) = 15·(tanh(x/15) + 1): @Grad62304977, @KoszarskyB, @YouJiacheng


# ----------------------------------------------------------------------------- the FP8 head
class FP8Matmul(torch.autograd.Function):
    """x (N, d) @ w (V, d)^T in fp8, by @YouJiacheng: forward e4m3 of x*x_s and w*w_s, out bf16;
    backward e5m2 of grad*grad_s, grad_x bf16 and grad_w float32, each rescaled by 1/scales."""

    @staticmethod
    def forward(ctx, x, w, x_s, w_s, grad_s):
        assert x.is_contiguous() and w.is_contiguous()
        x_f8 = x.mul(x_s).to(torch.float8_e4m3fn)
        w_f8 = w.mul(w_s).to(torch.float8_e4m3fn)
        ctx.save_for_backward(x_f8, w_f8)
        ctx.scales = x_s, w_s, grad_s
        return torch._scaled_mm(
            x_f8,
            w_f8.t(),
            out_dtype=torch.bfloat16,
            scale_a=torch.tensor(1 / x_s, dtype=torch.float32),
            scale_b=torch.tensor(1 / w_s, dtype=torch.float32),
            use_fast_accum=True,
        )  # (N, V)

    @staticmethod
    def backward(ctx, grad):
        x_f8, w_f8 = ctx.saved_tensors
        x_s, w_s, grad_s = ctx.scales
        grad_f8 = grad.contiguous().mul(grad_s).to(torch.float8_e5m2)  # e5m2: the range of grads
        inverse = lambda s: torch.tensor(1 / s, dtype=torch.float32)  # noqa: E731
        grad_x = torch._scaled_mm(
            grad_f8,
            w_f8.t().contiguous().t(),
            out_dtype=torch.bfloat16,
            scale_a=inverse(grad_s),
            scale_b=inverse(w_s),
            use_fast_accum=False,
        )  # (N, d)
        grad_w = torch._scaled_mm(
            x_f8.t().contiguous(),
            grad_f8.t().contiguous().t(),
            out_dtype=torch.float32,
            scale_a=inverse(x_s),
            scale_b=inverse(grad_s),
            use_fast_accum=False,
        ).t()  # (V, d)
        return grad_x, grad_w, None, None, None


def lm_head_fp8(x, w, x_s=2.0, w_s=32.0, grad_s=2.0**29):
    """x (..., d), w (V, d) -> (..., V) bf16, through FP8Matmul at the record's scales."""
    out = FP8Matmul.apply(x.flatten(0, -2), w, x_s, w_s, grad_s)
    return out.reshape(*x.shape[:-1], -1)


# ----------------------------------------------------------------------------- the block masks
def documents(input_seq):
    """(T,) -> (T,) each token's document number: a new one from each EOT on (cumsum)."""
    return (input_seq == EOT).cumsum(0)


def document_causal_mod(docs):
    """The record's mask_mod: causal and within one document."""

    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (docs[q_idx] == docs[kv_idx])

    return document_causal


def dense_to_ordered(dense_mask):
    """(nq, nkv) bool -> counts (1, 1, nq) and indices (1, 1, nq, nkv) int32: each row's True
    columns first, highest first (a stable ascending argsort, flipped), so clamping a count keeps
    the blocks nearest the diagonal."""
    num_blocks = dense_mask.sum(dim=-1, dtype=torch.int32)
    indices = dense_mask.argsort(dim=-1, descending=False, stable=True).flip(-1).to(torch.int32)
    return num_blocks[None, None].contiguous(), indices[None, None].contiguous()


def record_block_tensors(input_seq, sliding_window_num_blocks, block_size=128):
    """The record's create_doc_swc_block_masks (by @YouJiacheng), before BlockMask: for the long
    window and the short one (half of it), the clamped (kv_num_blocks, kv_indices,
    full_kv_num_blocks, full_kv_indices) that BlockMask.from_kv_blocks takes."""
    assert input_seq.ndim == 1 and len(input_seq) % block_size == 0
    docs = documents(input_seq).view(-1, block_size)  # (nb, bs)
    docs_low, docs_high = docs[:, 0].contiguous(), docs[:, -1].contiguous()
    block_idx = torch.arange(len(docs), dtype=torch.int32)
    q_idx, kv_idx = block_idx[:, None], block_idx
    causal_bm, causal_full_bm = q_idx >= kv_idx, q_idx > kv_idx
    # blocks whose document ranges overlap; full: both wholly one and the same document
    document_bm = (docs_low[:, None] <= docs_high) & (docs_low <= docs_high[:, None])
    document_full_bm = (docs_low[:, None] == docs_high) & (docs_low == docs_high[:, None])
    nonzero_bm = causal_bm & document_bm
    full_bm = causal_full_bm & document_full_bm
    kv_num_blocks, kv_indices = dense_to_ordered(nonzero_bm & ~full_bm)
    full_kv_num_blocks, full_kv_indices = dense_to_ordered(full_bm)

    def clamped(sw):
        # partial blocks: at most the window less the (unclamped) full ones, at least one; full
        # blocks: at most sw - 1 (-1 at sw 0, which the kernel reads as none)
        partial = torch.clamp_max(kv_num_blocks, torch.clamp_min(sw - full_kv_num_blocks, 1))
        full = torch.clamp_max(full_kv_num_blocks, sw - 1)
        return partial, kv_indices, full, full_kv_indices

    sw = torch.as_tensor(sliding_window_num_blocks, dtype=torch.int32)
    # long-short windows by @leloykun & @YouJiacheng, from @Grad62304977, as Gemma 2
    return clamped(sw), clamped(sw // 2)


def ordered_to_dense(num_blocks, indices):
    """(1, 1, nq), (1, 1, nq, nkv) -> (nq, nkv) bool: the first max(num, 0) of each row's list."""
    num_blocks, indices = num_blocks[0, 0], indices[0, 0].long()
    kept = torch.arange(indices.size(-1)) < num_blocks[:, None]  # (nq, nkv)
    return torch.zeros_like(kept).scatter_(-1, indices, kept)


def block_masks(input_seq, sliding_window_num_blocks, block_size=128):
    """(T,) -> (long, short) (T, T) bool: the (q, kv) pairs the record's kernel attends with its
    long and short BlockMask: listed full blocks whole, listed partial blocks through
    document_causal, nothing else."""
    tokens = lambda m: m.repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)  # noqa: E731
    T = len(input_seq)
    docs = documents(input_seq)
    pos = torch.arange(T)
    document_causal = document_causal_mod(docs)(0, 0, pos[:, None], pos)  # (T, T)
    masks = []
    for partial, kv_indices, full, full_indices in record_block_tensors(
        input_seq, sliding_window_num_blocks, block_size
    ):
        partial_tokens = tokens(ordered_to_dense(partial, kv_indices))
        masks.append(
            tokens(ordered_to_dense(full, full_indices)) | partial_tokens & document_causal
        )
    return tuple(masks)


def dense_attention(q, k, v, mask, scale=ATTN_SCALE):
    """q, k, v (B, H, T, hd), mask (T, T) bool -> (B, H, T, hd): masked softmax attention in
    float32, returned in q's dtype (FlexAttention's kernel keeps scores and softmax in fp32)."""
    scores = (q.float() @ k.float().mT) * scale  # (B, H, T, T)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)


# ----------------------------------------------------------------------------- the model
def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def next_multiple_of_n(v, *, n):
    """The least multiple of n that is >= v, and at least n (n at v = 0)."""
    return next(x for x in range(n, int(v) + 1 + n, n) if x >= v)


def value_embed_pattern(num_layers):
    """Which of the three value embeddings each layer adds, U-net style (012 ... 012 by
    @YouJiacheng, from @leloykun's): encoder layer i (i < num_layers // 2) ve[i] if i < 3,
    decoder layer k-th from the end ve[2 - k] if k < 3, else None. 12 layers: the record's
    0 1 2 - - - - - - 0 1 2; 6: 0 1 2 0 1 2; 4: 0 1 1 2; 2: 0 2."""
    n_enc = num_layers // 2
    return [
        (i if i < 3 else None)
        if i < n_enc
        else (i - (num_layers - 3) if i >= num_layers - 3 else None)
        for i in range(num_layers)
    ]


def long_window_pattern(num_layers):
    """Which layers use the long window: the record's encoder list [long, short, short, short,
    long, short] read from the start, the decoder's from that list reversed (as the record's loops
    index them, 6-periodic past 12 layers). 12: L S S S L S S L S S S L; 4: L S S L; 2: L S."""
    encoder = [True, False, False, False, True, False]
    n_enc = num_layers // 2
    decoder = encoder[::-1]
    return [encoder[i % 6] if i < n_enc else decoder[(i - n_enc) % 6] for i in range(num_layers)]


class CastedLinear(nn.Linear):
    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self):
        bound = 3**0.5 * 0.5 * self.in_features**-0.5  # std 0.5/sqrt(fan_in), not 1/sqrt(3)
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)

    def forward(self, x):
        return F.linear(x, self.weight.type_as(x))


class Rotary(nn.Module):
    """Half-truncated RoPE with base-frequency tuning, by @YouJiacheng: dim//4 frequencies
    (1/1024)**linspace(0, 1), then dim//4 zeros (those dims pass unrotated); float32 tables of
    max_seq_len rows, built once as the record builds them."""

    def __init__(self, dim, max_seq_len=65536):
        super().__init__()
        angular_freq = (1 / 1024) ** torch.linspace(0, 1, steps=dim // 4, dtype=torch.float32)
        angular_freq = torch.cat([angular_freq, angular_freq.new_zeros(dim // 4)])  # (dim/2,)
        theta = torch.einsum(
            "i,j -> ij", torch.arange(max_seq_len, dtype=torch.float32), angular_freq
        )
        self.cos = nn.Buffer(theta.cos(), persistent=False)  # (max_seq_len, dim/2)
        self.sin = nn.Buffer(theta.sin(), persistent=False)

    def forward(self, x_BTHD):
        T = x_BTHD.size(-3)
        assert self.cos.size(0) >= T
        cos, sin = self.cos[None, :T, None, :], self.sin[None, :T, None, :]
        x1, x2 = x_BTHD.to(dtype=torch.float32).chunk(2, dim=-1)
        y1 = x1 * cos + x2 * sin
        y2 = x1 * (-sin) + x2 * cos
        return torch.cat((y1, y2), 3).type_as(x_BTHD)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        assert dim % num_heads == 0
        self.num_heads = num_heads
        bound = 3**0.5 * 0.5 * dim**-0.5  # init scale by @YouJiacheng
        # merged QKV: suggested by many, by @fernbear.bsky.social, improved by @YouJiacheng
        self.qkv_w = nn.Parameter(torch.empty(3, dim, dim).uniform_(-bound, bound))
        self.lambdas = nn.Parameter(torch.tensor([0.5, 0.5]))
        self.rotary = Rotary(dim // num_heads)
        self.c_proj = CastedLinear(dim, dim)
        self.c_proj.weight.detach().zero_()  # zero init suggested by @Grad62304977

    def forward(self, x, ve, mask):
        B, T = x.size(0), x.size(1)
        qkv = F.linear(x, self.qkv_w.flatten(end_dim=1).type_as(x))  # (B, T, 3d)
        q, k, v = qkv.view(B, T, 3 * self.num_heads, -1).chunk(3, dim=-2)  # (B, T, nh, hd)
        if ve is not None:  # value embeddings by @KoszarskyB & @Grad62304977
            v = self.lambdas[0] * v + self.lambdas[1] * ve.view_as(v)
        else:  # the middle layers skip them, by @YouJiacheng
            v = self.lambdas[0] * v
        q, k = norm(q), norm(k)  # QK norm by @Grad62304977
        q, k = self.rotary(q), self.rotary(k)
        y = dense_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        y = y.transpose(1, 2).contiguous().view_as(x)  # (B, T, d): the heads side by side
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.c_fc = CastedLinear(dim, 4 * dim)
        self.c_proj = CastedLinear(4 * dim, dim)
        self.c_proj.weight.detach().zero_()  # zero init suggested by @Grad62304977

    def forward(self, x):
        # ReLU² (arXiv:2109.08668), suggested by @SKYLINEZ007 and @Grad62304977
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, model_dim, num_heads, has_attn=True):
        super().__init__()
        self.attn = CausalSelfAttention(model_dim, num_heads) if has_attn else None
        self.mlp = MLP(model_dim)
        self.lambdas = nn.Parameter(torch.tensor([1.0, 0.0]))  # x, x0 mixed in

    def forward(self, x, ve, x0, mask):
        x = self.lambdas[0] * x + self.lambdas[1] * x0
        if self.attn is not None:
            x = x + self.attn(norm(x), ve, mask)
        return x + self.mlp(norm(x))


class ValueEmbedding(nn.Module):
    """Three token embeddings (by @KoszarskyB, after @Grad62304977's value residual,
    arXiv:2410.17897), handed to the layers as value_embed_pattern says."""

    def __init__(self, num_embeddings, embedding_dim, num_layers):
        super().__init__()
        self.embed = nn.ModuleList([nn.Embedding(num_embeddings, embedding_dim) for _ in range(3)])
        self.pattern = value_embed_pattern(num_layers)

    def forward(self, input_seq):
        ve = [emb(input_seq) for emb in self.embed]  # 3 x (T, d)
        return [None if j is None else ve[j] for j in self.pattern]


class GPT(nn.Module):
    """The record's GPT. embed_dtype: the embedding tables' (the record: bf16); fp8_head: the head
    through lm_head_fp8 in training (the record: always); skip_attn_layer: the layer without
    attention (the record: 7, by @YouJiacheng), None or >= num_layers for none."""

    def __init__(
        self,
        vocab_size=50257,
        num_layers=12,
        num_heads=6,
        model_dim=768,
        skip_attn_layer=7,
        embed_dtype=torch.bfloat16,
        fp8_head=False,
        block_size=128,
    ):
        super().__init__()
        assert num_layers % 2 == 0, "the U-net pops one encoder skip per decoder layer"
        self.fp8_head, self.block_size = fp8_head, block_size
        self.embed = nn.Embedding(vocab_size, model_dim)
        self.value_embeds = ValueEmbedding(vocab_size, model_dim, num_layers)
        self.blocks = nn.ModuleList(
            [Block(model_dim, num_heads, i != skip_attn_layer) for i in range(num_layers)]
        )
        self.long_windows = long_window_pattern(num_layers)
        # U-net by @brendanh0gan: half the layers encode, the rest decode with weighted skips
        self.num_encoder_layers = num_layers // 2
        self.skip_weights = nn.Parameter(torch.ones(num_layers - self.num_encoder_layers))
        # the vocab padded to a multiple of 128 (@Grad62304977, from Karpathy's experiments)
        self.lm_head = CastedLinear(model_dim, next_multiple_of_n(vocab_size, n=128))
        self.lm_head.weight.detach().zero_()  # @Grad62304977
        for m in self.modules():
            if isinstance(m, nn.Embedding):
                m.to(embed_dtype)

    def logits(self, input_seq, sliding_window_num_blocks):
        """input_seq (T,) -> (T, padded vocab) float32 soft-capped logits."""
        long_mask, short_mask = block_masks(input_seq, sliding_window_num_blocks, self.block_size)
        x = x0 = norm(self.embed(input_seq)[None])  # (1, T, d); the norm by @Grad62304977
        ve = self.value_embeds(input_seq)
        skips = []
        for i, block in enumerate(self.blocks):
            if i >= self.num_encoder_layers:
                x = x + self.skip_weights[i - self.num_encoder_layers] * skips.pop()
            x = block(x, ve[i], x0, long_mask if self.long_windows[i] else short_mask)
            if i < self.num_encoder_layers:
                skips.append(x)
        x = norm(x)
        if self.training and self.fp8_head:
            logits = lm_head_fp8(x, self.lm_head.weight)
        else:
            logits = self.lm_head(x)
        logits = SOFTCAP * torch.sigmoid(logits.float() / 7.5)  # (1, T, V)
        return logits.view(-1, logits.size(-1))

    def forward(self, input_seq, target_seq, sliding_window_num_blocks):
        """The mean cross-entropy over the sequence (the padded vocab's columns included)."""
        return F.cross_entropy(self.logits(input_seq, sliding_window_num_blocks), target_seq)
