"""
Record 20's attention (archs/record20.py, GPTConfig.arch='speedrun20'): document-causal
attention over block-wise sliding windows, as modded-nanogpt's record 20 builds its FlexAttention
BlockMask, and its kernels: masked XLA attention for short sequences, a banded XLA kernel for the
record's 64K tokens, and splash attention with block tables built from the window's shape (TPU;
Pallas interpret mode elsewhere). The window is data to each: one compiled step serves the whole
schedule.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash_kernel,
)
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_mask_info as mask_info_lib,
)

from compute import sharding
from compute.attention import (
    cannot_run,
    per_device,
    splash_dtype_reason,
    splash_reason,
    splash_tile,
)
from configurator import UsageError

EOT = 50256  # GPT-2's <|endoftext|>: each one starts a document (it is that document's first token)
WINDOW_BLOCK = 128  # the record's FlexAttention block: windows are whole blocks of this many tokens
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # a masked score: exp() of it is 0, not NaN


def final_blocks(window_size):
    """The long window at the end of training in blocks: window_size tokens rounded up to whole
    blocks (the record's 1728: 14, 1792 tokens)."""
    return -(-window_size // WINDOW_BLOCK)


def documents(idx):
    """Token ids (B, T) -> (B, T) int32 document numbers, as record 20 counts them: the number of
    <|endoftext|> tokens up to and including each position."""
    return jnp.cumsum(idx == EOT, axis=-1, dtype=jnp.int32)


def window_mask(q_pos, k_pos, q_docs, k_docs, window_blocks):
    """Which keys each query attends in record 20: (..., Tq, Tk) bool from positions (Tq,), (Tk,)
    and document numbers (..., Tq), (..., Tk). Causal, within the query's document, and in the
    query's block or the window_blocks - 1 blocks before it (at least its own block). This is what
    the record's hand-built BlockMask selects: for each query block it keeps the nearest
    window_blocks kv blocks that overlap the query's documents (the clamps on its full and partial
    block counts add up to that), full blocks whole and the partial ones through document_causal,
    which is all-true on a full block; window_blocks of 0 (the short window at step 0) keeps the
    query's own block. window_blocks may be traced."""
    q_blocks, k_blocks = q_pos // WINDOW_BLOCK, k_pos // WINDOW_BLOCK
    near = q_blocks[:, None] - k_blocks[None, :] < jnp.maximum(window_blocks, 1)
    causal = q_pos[:, None] >= k_pos[None, :]
    return causal & near & (q_docs[..., :, None] == k_docs[..., None, :])


def masked_attention(q, k, v, mask, scale):
    """q (B, Tq, nh, hs), k and v (B, Tk, nh, hs), mask (B, Tq, Tk) -> (B, Tq, nh, hs) in v's dtype:
    softmax(q k^T * scale) v over the keys the mask allows, scores and softmax in float32. Every
    query allows at least its own position."""
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    att = jax.nn.softmax(jnp.where(mask[:, None], att, -jnp.inf), axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", att, v)


def record20_kernel(setting, *, platform, dtype, seq_len, head_size, band, device_kind=None):
    """Record 20's kernel for one call's shapes on a device of `platform` and `device_kind` (the
    mesh's): 'splash' (window_splash_attention) for an explicit 'splash' wherever the shapes allow
    (interpret mode off a TPU) and for 'auto' on a TPU whose kernel compiler takes the dtype;
    'flash' (window_flash_attention) for an explicit 'flash' off a TPU (interpret mode off a GPU)
    where the sequence is whole blocks; else in XLA 'masked' (masked_attention) for a sequence no
    longer than `band` blocks, the most its window ever spans, and 'banded'
    (banded_window_attention) beyond. One line for a setting that cannot run."""
    if setting == "flash":
        if platform == "tpu":
            raise cannot_run(setting, "it is a GPU kernel (Triton)", "use attention='auto'")
        if platform == "gpu" and (head_size < 16 or head_size & (head_size - 1)):
            reason = f"its head size (n_embd / n_head) must be a power of 2 >= 16, got {head_size}"
            raise cannot_run(setting, reason, "use attention='auto' or 'xla'")
        if seq_len % WINDOW_BLOCK == 0:  # else (a prompt, a HellaSwag row) XLA's, below
            return "flash"
    splash_dtype = splash_dtype_reason(dtype, device_kind) if platform == "tpu" else None
    if setting == "splash" and splash_dtype:
        raise cannot_run(setting, splash_dtype, "use attention='auto' or 'xla', or dtype='float32'")
    wanted = setting == "splash" or (setting == "auto" and platform == "tpu" and not splash_dtype)
    if wanted and not splash_reason(seq_len, head_size):
        return "splash"
    return "banded" if seq_len > band * WINDOW_BLOCK and seq_len % WINDOW_BLOCK == 0 else "masked"


def run_kernel(config, device):
    """The kernel record20_kernel picks for a training run of `config` (arch='speedrun20', its
    block_size and window_size) on `device`'s kind."""
    return record20_kernel(
        config.attention,
        platform=device.platform,
        dtype=config.dtype,
        seq_len=config.block_size,
        head_size=config.n_embd // config.n_head,
        band=final_blocks(config.window_size),
        device_kind=device.device_kind,
    )


def check_run(config, device):
    """run_kernel's one-line refusals as a UsageError: before anything is written
    (attention.check_run for the other architectures)."""
    try:
        run_kernel(config, device)
    except ValueError as e:
        raise UsageError(str(e)) from None


def record20_attention(q, k, v, docs, window_blocks, band, scale, setting="xla"):
    """Record 20's attention, q, k, v (B, T, nh, hs), docs (B, T), over window_mask's keys (the
    window of window_blocks, at most `band`, may be traced), with the kernel record20_kernel picks
    for `setting` on the devices compiled for."""
    kernel = record20_kernel(
        setting,
        platform=sharding.target_platform(),
        dtype=q.dtype,
        seq_len=q.shape[1],
        head_size=q.shape[3],
        band=band,
        device_kind=sharding.target_device().device_kind,
    )
    if kernel == "splash":
        return window_splash_attention(q, k, v, docs, window_blocks, band, scale)
    if kernel == "flash":
        return window_flash_attention(q, k, v, docs, window_blocks, scale)
    if kernel == "banded":
        return banded_window_attention(q, k, v, docs, window_blocks, band, scale)
    pos = jnp.arange(q.shape[1])
    mask = window_mask(pos, pos, docs, docs, window_blocks)
    return masked_attention(q, k, v, mask, scale)


def banded_window_attention(q, k, v, docs, window_blocks, band, scale):
    """Record 20's attention without (T, T) scores: each 128-token query block against the `band`
    kv blocks that end at its own, window_mask's keys among them (window_blocks <= band, may be
    traced), so memory and work grow as T x band blocks, not T^2: the record's 64K-token sequences.
    q, k, v (B, T, nh, hs) with T whole blocks, docs (B, T) -> (B, T, nh, hs) in v's dtype; scores
    and softmax in float32. Equal to masked_attention over window_mask
    (tests/test_speedrun20_model.py)."""
    B, T, nh, hs = q.shape
    bs, nb = WINDOW_BLOCK, T // WINDOW_BLOCK
    band = min(band, nb)
    # (nb, band): query block i's kv blocks i-band+1 .. i, as indices into band-1 blocks of padding
    # and then the sequence's blocks
    take = jnp.arange(nb)[:, None] + jnp.arange(band)[None, :]

    def banded(a, fill=0):  # (b, T, ...) -> (b, nb, band * bs, ...)
        a = a.reshape(a.shape[0], nb, bs, *a.shape[2:])
        pad = [(0, 0), (band - 1, 0)] + [(0, 0)] * (a.ndim - 2)
        kept = jnp.pad(a, pad, constant_values=fill)[:, take]  # (b, nb, band, bs, ...)
        return kept.reshape(a.shape[0], nb, band * bs, *a.shape[3:])

    pos = jnp.arange(T)
    q_pos = pos.reshape(nb, bs)
    k_pos = banded(pos[None], fill=-1)[0]  # (nb, band * bs); -1: the padding before position 0
    near = q_pos[:, :, None] // bs - k_pos[:, None, :] // bs < jnp.maximum(window_blocks, 1)
    allowed = (k_pos[:, None, :] >= 0) & (q_pos[:, :, None] >= k_pos[:, None, :]) & near
    same_doc = docs.reshape(B, nb, bs)[..., None] == banded(docs, fill=-1)[:, :, None, :]
    mask = allowed[None] & same_doc  # (B, nb, bs, band * bs)
    qb = q.reshape(B, nb, bs, nh, hs)
    att = jnp.einsum("bnqhd,bnkhd->bnhqk", qb, banded(k), preferred_element_type=jnp.float32)
    att = jnp.where(mask[:, :, None], att * scale, -jnp.inf)
    att = jax.nn.softmax(att, axis=-1).astype(v.dtype)
    return jnp.einsum("bnhqk,bnkhd->bnqhd", att, banded(v)).reshape(B, T, nh, hs)


def _window_tables(T, tile, band, window, q_sequence):
    """Splash's block tables (forward, dq, dkv) for record 20's window of `window` blocks (1 ..
    band, may be traced) over T tokens in tiles of `tile`, in splash_attention_mask_info's shrunk
    layout: each query tile's kv tiles for the forward and dq, each kv tile's query tiles for dkv,
    as many as the band can meet. Built from the window's regular shape rather than by evaluating a
    mask tile by tile: tile i meets tiles i - reach .. i. Skipped entries name a tile fetched next
    to them, so that they copy nothing."""
    n_tiles, blocks_per_tile = T // tile, tile // WINDOW_BLOCK
    width = min(1 + -(-(band - 1) // blocks_per_tile), n_tiles)
    reach = (window - 1 + blocks_per_tile - 1) // blocks_per_tile
    rows, steps = jnp.arange(n_tiles)[:, None], jnp.arange(width)[None, :]
    # query tile i: skipped, then kv tiles ... i - 1, i (the last entry its own)
    first = jnp.maximum(rows - reach, 0)
    kv_tiles = rows - (width - 1) + steps
    forward = (kv_tiles >= first, jnp.maximum(kv_tiles, first))
    # kv tile j: query tiles j, j + 1, ... while in reach, then skipped; (width, n_tiles)
    last = jnp.minimum(rows + reach, n_tiles - 1)
    q_tiles = rows + steps
    dkv = ((q_tiles <= last).T, jnp.minimum(q_tiles, last).T)
    return tuple(
        mask_info_lib.MaskInfo(
            data_next=next_tile[None].astype(jnp.int32),
            mask_next=None,
            block_mask=on[None].astype(jnp.int32),  # 1: computed through the mask function
            partial_mask_blocks=None,
            q_sequence=q_sequence,
        )
        for on, next_tile in (forward, forward, dkv)
    )


@functools.cache
def _window_mask_function(window_bits):
    """The kernel's mask for a tile: causal, and within the query's window, read from the packed
    q_sequence (position << window_bits | window blocks): the window is data, not a constant
    compiled into the kernel."""
    block_bits = WINDOW_BLOCK.bit_length() - 1

    def mask(q_sequence, k_pos):
        q_pos = jax.lax.shift_right_logical(q_sequence, window_bits)
        window = q_sequence & ((1 << window_bits) - 1)
        near = (q_pos >> block_bits) - (k_pos >> block_bits) < window
        return (k_pos <= q_pos) & near

    return mask


def window_splash_attention(q, k, v, docs, window_blocks, band, scale, tile=None):
    """Record 20's attention as TPU splash attention (Pallas interpret mode off a TPU): documents as
    segment ids, the causal window computed in the kernel, and only the tiles the window meets
    visited (its grid spans the band: `band` blocks, window_blocks <= band, may be traced).
    q, k, v (B, T, nh, hs), docs (B, T) -> (B, T, nh, hs) in v's dtype; splash's q.k dots
    accumulate in float32, q scaled before them. Equal to masked_attention over window_mask
    (tests/test_window_attention.py)."""
    T = q.shape[1]
    tile = tile or splash_tile(T)
    band = max(band, 1)
    window_bits = band.bit_length()  # the window, 1 .. band, packed below each position
    if T << window_bits > jnp.iinfo(jnp.int32).max:
        raise ValueError(f"window_splash_attention takes T * 2^{window_bits} < 2^31, got T={T}")
    interpret = sharding.target_platform() != "tpu"

    def local(q, k, v, docs, window_blocks):  # (b, T, h, hs), (b, T), (): this device's share
        window = jnp.clip(window_blocks, 1, band).astype(jnp.int32)
        q_sequence = (jnp.arange(T, dtype=jnp.int32) << window_bits) | window
        tables = _window_tables(T, tile, band, window, q_sequence)
        sizes = splash_kernel.BlockSizes(
            block_q=tile, block_kv=tile, block_kv_compute=tile, block_q_dkv=tile,
            block_kv_dkv=tile, block_kv_dkv_compute=tile, block_q_dq=tile, block_kv_dq=tile,
        )  # fmt: skip
        kernel = splash_kernel.SplashAttentionKernel(
            *tables,
            block_sizes=sizes,
            is_mqa=False,
            save_residuals=False,
            mask_value=splash_kernel.DEFAULT_MASK_VALUE,
            attn_logits_soft_cap=None,
            residual_checkpoint_name=None,
            mask_function=_window_mask_function(window_bits),
            interpret=interpret,
        )
        q = q * jnp.asarray(scale, q.dtype)  # the kernel does not scale the scores
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))  # (b, h, T, hs)

        def row(q, k, v, docs):
            return kernel(q, k, v, splash_kernel.SegmentIds(q=docs, kv=docs))

        return jax.vmap(row)(q, k, v, docs).transpose(0, 2, 1, 3)

    y = per_device(local, q, k, v, docs, jnp.asarray(window_blocks, jnp.int32))
    return y.astype(v.dtype)


# ------------------------------------------------------------------------------------------------
# flash attention over the window's blocks only, as Pallas (Triton) kernels for NVIDIA GPUs (Pallas
# interpret mode elsewhere): the kernel FlexAttention compiles the record's BlockMask to


def _scores(q, k, q_start, k_start, q_docs, k_docs, scale):
    """(bq, bk) float32 scores q.k * scale: causal and within the query's document, the rest at
    MASK_VALUE (the loops' bounds keep them in its window)."""
    s = plgpu.dot(q, k, trans_b=True) * scale
    q_pos = q_start + jnp.arange(q.shape[0])
    k_pos = k_start + jnp.arange(k.shape[0])
    allowed = (q_pos[:, None] >= k_pos[None, :]) & (q_docs[:, None] == k_docs[None, :])
    return jnp.where(allowed, s, MASK_VALUE)


def _key_tiles(q_start, bq, bk, window):
    """The kv tiles of size bk the query tile at q_start meets: from its block's window (window
    blocks, its own the last) through its own last position."""
    first_key = jnp.maximum(q_start // WINDOW_BLOCK - window + 1, 0) * WINDOW_BLOCK
    return first_key // bk, (q_start + bq - 1) // bk + 1


def _flash_forward_kernel(window_ref, q_ref, k_ref, v_ref, docs_ref, o_ref, lse_ref, *, scale, bk):
    bq = q_ref.shape[0]
    q_start = pl.program_id(0) * bq
    q, q_docs = q_ref[...], docs_ref[pl.ds(q_start, bq)]

    def visit(j, carry):  # the online softmax over kv tile j: output, running max, running sum
        o, m, total = carry
        keys = pl.ds(j * bk, bk)
        s = _scores(q, k_ref[keys, :], q_start, j * bk, q_docs, docs_ref[keys], scale)
        m_next = jnp.maximum(m, s.max(axis=1))
        p, correction = jnp.exp(s - m_next[:, None]), jnp.exp(m - m_next)
        o = o * correction[:, None] + plgpu.dot(p.astype(v_ref.dtype), v_ref[keys, :])
        return o, m_next, total * correction + p.sum(axis=1)

    start = (jnp.zeros(q.shape, jnp.float32), jnp.full((bq,), MASK_VALUE), jnp.zeros((bq,)))
    o, m, total = jax.lax.fori_loop(*_key_tiles(q_start, bq, bk, window_ref[0]), visit, start)
    o_ref[...] = (o / total[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(total)


def _flash_dq_kernel(
    window_ref, q_ref, k_ref, v_ref, docs_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale, bk
):
    bq = q_ref.shape[0]
    q_start = pl.program_id(0) * bq
    q, q_docs, do = q_ref[...], docs_ref[pl.ds(q_start, bq)], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def visit(j, dq):
        keys = pl.ds(j * bk, bk)
        k = k_ref[keys, :]
        p = jnp.exp(_scores(q, k, q_start, j * bk, q_docs, docs_ref[keys], scale) - lse[:, None])
        ds = p * (plgpu.dot(do, v_ref[keys, :], trans_b=True) - delta[:, None])
        return dq + plgpu.dot(ds.astype(k.dtype), k)

    tiles = _key_tiles(q_start, bq, bk, window_ref[0])
    dq = jax.lax.fori_loop(*tiles, visit, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _flash_dkv_kernel(
    window_ref, q_ref, k_ref, v_ref, docs_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
    scale, bq,
):  # fmt: skip
    bk, T = k_ref.shape[0], q_ref.shape[0]
    k_start = pl.program_id(0) * bk
    k, v, k_docs = k_ref[...], v_ref[...], docs_ref[pl.ds(k_start, bk)]

    def visit(i, carry):  # query tile i, which sees this kv tile
        dk, dv = carry
        rows = pl.ds(i * bq, bq)
        q, do = q_ref[rows, :], do_ref[rows, :]
        s = _scores(q, k, i * bq, k_start, docs_ref[rows], k_docs, scale)
        p = jnp.exp(s - lse_ref[rows][:, None])
        ds = p * (plgpu.dot(do, v, trans_b=True) - delta_ref[rows][:, None])
        dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True)
        return dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True), dv

    # causal from this tile on; the window: query blocks up to window - 1 after this tile's
    end = jnp.minimum((k_start // WINDOW_BLOCK + window_ref[0]) * WINDOW_BLOCK, T)
    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(k_start // bq, (end - 1) // bq + 1, visit, (zeros, zeros))
    dk_ref[...], dv_ref[...] = (dk * scale).astype(dk_ref.dtype), dv.astype(dv_ref.dtype)


def _pallas(kernel, window, args, grid_tile, ins, outs, interpret):
    """kernel over (T / grid_tile, B, nh) programs, each given the window, then for each of `args`
    per `ins` its tile ("tile": of grid_tile positions; "row_tile": of a (B, nh, T) array) or its
    whole sequence ("whole", "row"; "docs": the (B, T) document numbers); outs: (spec, shape)."""
    B, T, nh, hs = args[0].shape
    specs = {
        "tile": pl.BlockSpec((None, grid_tile, None, hs), lambda i, b, h: (b, i, h, 0)),
        "whole": pl.BlockSpec((None, T, None, hs), lambda i, b, h: (b, 0, h, 0)),
        "row_tile": pl.BlockSpec((None, None, grid_tile), lambda i, b, h: (b, h, i)),
        "row": pl.BlockSpec((None, None, T), lambda i, b, h: (b, h, 0)),
        "docs": pl.BlockSpec((None, T), lambda i, b, h: (b, 0)),
    }
    return pl.pallas_call(
        kernel,
        grid=(T // grid_tile, B, nh),
        in_specs=[pl.BlockSpec((1,), lambda i, b, h: (0,))] + [specs[s] for s in ins],
        out_specs=[specs[s] for s, _ in outs],
        out_shape=[shape for _, shape in outs],
        compiler_params=plgpu.CompilerParams(num_warps=4 if hs <= 64 else 8, num_stages=2),
        interpret=interpret,
    )(window, *args)


def _flash_forward(q, k, v, docs, window, scale, tiles, interpret):
    (bq, bk), _ = tiles
    B, T, nh, _ = q.shape
    o, lse = _pallas(
        functools.partial(_flash_forward_kernel, scale=scale, bk=bk),
        window,
        (q, k, v, docs),
        bq,
        ("tile", "whole", "whole", "docs"),
        [("tile", q), ("row_tile", jax.ShapeDtypeStruct((B, nh, T), jnp.float32))],
        interpret,
    )
    return o, (q, k, v, docs, window, o, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _flash(q, k, v, docs, window, scale, tiles, interpret):
    return _flash_forward(q, k, v, docs, window, scale, tiles, interpret)[0]


def _flash_backward(scale, tiles, interpret, saved, do):
    q, k, v, docs, window, o, lse = saved
    _, (bq, bk) = tiles
    # delta_i = do_i . o_i: the softmax's gradient term, (B, nh, T) float32
    delta = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), o.astype(jnp.float32))
    args = (q, k, v, docs, do, lse, delta)
    (dq,) = _pallas(
        functools.partial(_flash_dq_kernel, scale=scale, bk=bk),
        window,
        args,
        bq,
        ("tile", "whole", "whole", "docs", "tile", "row_tile", "row_tile"),
        [("tile", q)],
        interpret,
    )
    dk, dv = _pallas(
        functools.partial(_flash_dkv_kernel, scale=scale, bq=bq),
        window,
        args,
        bk,
        ("whole", "tile", "tile", "docs", "whole", "row", "row"),
        [("tile", k), ("tile", v)],
        interpret,
    )
    return dq, dk, dv, None, None


_flash.defvjp(_flash_forward, _flash_backward)

# (forward (bq, bk), backward (bq, bk)): each divides the 128-token block, so a tile lies in one
FLASH_TILES = ((128, 64), (64, 64))


def window_flash_attention(q, k, v, docs, window_blocks, scale, tiles=FLASH_TILES):
    """Record 20's attention as flash attention that visits only the kv tiles the window meets,
    documents and causality masked inside them: Pallas kernels for an NVIDIA GPU (Triton), Pallas
    interpret mode elsewhere. q, k, v (B, T, nh, hs), T whole tiles, docs (B, T) -> (B, T, nh, hs)
    in v's dtype; scores, softmax and gradients accumulate in float32. Equal to masked_attention
    over window_mask (tests/test_window_attention.py)."""
    interpret = sharding.target_platform() != "gpu"

    def local(q, k, v, docs, window_blocks):  # this device's rows and heads
        window = jnp.maximum(window_blocks, 1).reshape(1)
        return _flash(q, k, v, docs, window, scale, tiles, interpret)

    return per_device(local, q, k, v, docs, jnp.asarray(window_blocks, jnp.int32))
