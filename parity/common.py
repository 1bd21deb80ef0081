"""What every parity check shares: pinned numerics, random HF GPT-2 checkpoints, the diff report,
and llm.c's token-shard writer (the speedrun checks' data)."""

import numpy as np

# HF GPT-2 sizes (all: vocab 50257, n_positions 1024)
HF_SIZES = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
}


def pin_numerics():
    """fp32 everywhere: no TF32 in torch, highest matmul precision in JAX (matters on GPU/TPU)."""
    import jax
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    jax.config.update("jax_default_matmul_precision", "highest")


def random_hf_model(seed=0, **config_kwargs):
    """A transformers GPT2LMHeadModel with *every* tensor random. HF's own init leaves biases at 0
    and LayerNorms at 1, which would hide a swapped or missing mapping."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config_kwargs = {"vocab_size": 50257, "n_positions": 1024, **config_kwargs}
    if config_kwargs["vocab_size"] <= 50256:  # tiny test vocabularies have no <|endoftext|>
        config_kwargs.setdefault("bos_token_id", None)
        config_kwargs.setdefault("eos_token_id", None)
    config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **config_kwargs)
    return randomized(GPT2LMHeadModel(config).eval(), seed)


def randomized(model, seed):
    """`model` (HF's or nanoGPT's GPT-2: the same parameter names) with every parameter drawn anew:
    LayerNorms 1 + N(0, 0.1) and N(0, 0.1) (weight, bias), the rest N(0, 0.02)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name or name.startswith("transformer.ln_f"):
                base = 1.0 if name.endswith(".weight") else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    return model


def save_random_hf_model(path, seed=0, **config_kwargs):
    random_hf_model(seed, **config_kwargs).save_pretrained(path)
    return path


def save_random_nanogpt_ckpt(path, seed=0, **config_kwargs):
    """nanoGPT's ckpt.pt (parity/nanogpt_reference.py's GPT, nanoGPT's GPTConfig fields) with every
    tensor random, its keys under torch.compile's prefix and with the causal-mask buffers (no flash
    attention), as nanoGPT's train.py can leave them."""
    from parity import nanogpt_reference as nanogpt

    gpt = randomized(nanogpt.GPT(nanogpt.GPTConfig(**config_kwargs), flash=False).eval(), seed)
    nanogpt.save_ckpt(gpt, path, compiled=True)
    return path


def print_table(rows, headers):
    """rows: lists of cells, printed as an aligned text table."""
    cells = [[str(h) for h in headers]] + [
        [c if isinstance(c, str) else f"{c:.3g}" for c in r] for r in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for j, r in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def verdict(ok, what):
    print(f"{what}: {'OK' if ok else 'NOT OK'}")
    return ok


def max_abs(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def add_step_args(parser):
    """The options check_train and check_speedrun share for our side: how a step's rows split
    (micro-batches, the mesh's devices and axes) and train.py's compute settings, under train.py's
    names."""
    parser.add_argument(
        "--accum", type=int, default=1, help="micro-batches per step: the step's rows split K ways"
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=None,
        help="our mesh's devices (default fsdp x tensor_parallel)",
    )
    parser.add_argument(
        "--fsdp", type=int, default=1, help="our mesh's fsdp axis: params and optimizer state split"
    )
    parser.add_argument(
        "--tensor_parallel", type=int, default=1, help="our mesh's tensor axis (Megatron)"
    )
    parser.add_argument(
        "--attention",
        default="auto",
        choices=["auto", "xla", "cudnn", "splash", "flash"],
        help="train.py's",
    )
    parser.add_argument(
        "--remat", default="none", choices=["none", "block", "dots", "qkv_proj"], help="train.py's"
    )
    parser.add_argument(
        "--loss-chunk", type=int, default=0, help="positions per loss chunk, 0 = none (train.py's)"
    )
    parser.add_argument(
        "--scan_layers", action="store_true", help="the blocks under one lax.scan (train.py's)"
    )


def write_datafile(path, tokens, magic=None, version=None, count=None):
    """As llm.c's write_datafile: a header of 256 int32 (magic 20240520, version 1, the token count,
    zeros), then the tokens as uint16. magic, version, count: other values, for tests of bad
    shards."""
    from dataio.dataloader import LLMC_HEADER, LLMC_MAGIC, LLMC_VERSION

    header = np.zeros(LLMC_HEADER // 4, "<i4")
    header[:3] = (
        LLMC_MAGIC if magic is None else magic,
        LLMC_VERSION if version is None else version,
        len(tokens) if count is None else count,
    )
    with open(path, "wb") as f:
        f.write(header.tobytes() + np.asarray(tokens, np.uint16).tobytes())
