"""
Sample from a trained model: nanoGPT's sample.py, decoding all samples together from a KV cache.

    # our checkpoint (it carries its vocabulary)
    python sample.py --init_from=resume --out_dir=out-shakespeare-char
    python sample.py --init_from=gpt2-xl \\
        --start="What is the answer to life, the universe, and everything?" \\
        --num_samples=5 --max_new_tokens=100
    # an HF GPT-2 directory, greedy
    python sample.py --init_from=DIR --start=FILE:prompt.txt --temperature=0
    # a nanoGPT run's ckpt.pt
    python sample.py --init_from=../nanoGPT/out-shakespeare-char
    # a modded-nanogpt record 5 file
    python sample.py --init_from=logs/RUN_ID/state_step005100.pt
    # tokens printed as they come
    python sample.py --init_from=gpt2 --num_samples=1 --stream

Settings as nanoGPT: an optional config file, then --key=value (configurator.py); --stream is
--stream=True. Samples go to stdout, each followed by a line of dashes; the start-up summary and
timing go to stderr.
"""

import os
import sys
import time

import jax
import numpy as np

from compute import sharding
from compute.generate import check_sampling
from configurator import InputNotFound, UsageError, configure, exit_on_bad_input
from run.checkpoint import load_with_codec
from run.settings import resolve_dtype

defaults = dict(
    # 'resume' (from out_dir), gpt2 | gpt2-medium | gpt2-large | gpt2-xl, an HF directory, a nanoGPT
    # ckpt.pt (or its out_dir; a character-level run decodes with its dataset's meta.pkl), or a
    # modded-nanogpt state_step*.pt (record 5's GPT: arch='speedrun')
    init_from="resume",
    out_dir="out",  # ignored unless init_from is 'resume'
    start="\n",  # or "<|endoftext|>" or etc. Can also specify a file, use as: "FILE:prompt.txt"
    num_samples=10,  # number of samples to draw, decoded together as one batch
    max_new_tokens=500,  # number of tokens generated in each sample
    # 1.0 = no change, < 1.0 = less random, > 1.0 = more random; 0 = greedy (argmax)
    temperature=0.8,
    # retain only the top_k most likely tokens, clamp others to have 0 probability (None: all)
    top_k=200,
    # then the smallest set of most likely tokens holding top_p of the probability (1.0: all)
    top_p=1.0,
    seed=1337,
    dtype="auto",  # 'float32' | 'bfloat16' | 'auto' (bfloat16 on GPU/TPU, float32 on CPU)
    stream=False,  # print tokens as they come (num_samples=1)
)
SEPARATOR = "---------------"


def check_settings(cfg):
    """Every bad setting fails here, with one line, before a model is loaded."""
    for key in ("num_samples", "max_new_tokens"):
        if not cfg[key] >= 1:
            raise UsageError(f"{key} must be >= 1, got {cfg[key]}")
    check_sampling(cfg["temperature"], cfg["top_k"], cfg["top_p"])
    resolve_dtype(cfg["dtype"], "cpu")
    if cfg["stream"] and cfg["num_samples"] != 1:
        raise UsageError(
            "--stream prints one sample as it comes: set --num_samples=1 (got "
            f"{cfg['num_samples']})"
        )


def read_start(start):
    """The prompt text: a string, or a file's contents with FILE:path. Empty means nanoGPT's
    default, "\\n"."""
    if start.startswith("FILE:"):
        path = start[len("FILE:") :]
        if not os.path.isfile(path):
            raise InputNotFound(f"start file not found: {path}")
        try:
            with open(path, encoding="utf-8") as f:
                start = f.read()
        except UnicodeDecodeError as e:
            raise UsageError(
                f"start file {path} is not UTF-8 text (byte {e.start}): give a text file"
            ) from None
    return start or "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    cfg = configure(
        defaults, ["--stream=True" if a == "--stream" else a for a in argv], nullable=("top_k",)
    )
    check_settings(cfg)
    sharding.use_compilation_cache()
    sharding.start_backend()
    cfg["dtype"] = resolve_dtype(cfg["dtype"], jax.default_backend())
    start = read_start(cfg["start"])

    t0 = time.time()
    model, codec, _ = load_with_codec(cfg["init_from"], cfg["out_dir"], cfg["dtype"])
    start_ids = codec.encode(start)
    c = model.config
    if max(start_ids) >= c.vocab_size:
        raise UsageError(
            f"start encodes to token id {max(start_ids)}, outside the model's vocabulary "
            f"(vocab_size {c.vocab_size})"
        )
    print(
        f"model {cfg['init_from']}: {model.num_params() / 1e6:.2f}M params, block_size "
        f"{c.block_size}, {cfg['dtype']} on {jax.devices()[0].platform} (loaded in "
        f"{time.time() - t0:.1f}s); {cfg['num_samples']} sample(s) x {cfg['max_new_tokens']} "
        f"tokens from a {len(start_ids)}-token start",
        file=sys.stderr,
    )

    on_token = None
    if cfg["stream"]:
        print(codec.decode(start_ids), end="", flush=True)
        decode_one = codec.stream_decoder()
        on_token = lambda ids: print(decode_one(int(ids[0])), end="", flush=True)  # noqa: E731

    t0 = time.time()
    x = np.tile(np.array(start_ids, np.int32), (cfg["num_samples"], 1))  # (num_samples, T)
    y = model.generate(
        x,
        cfg["max_new_tokens"],
        cfg["temperature"],
        cfg["top_k"],
        cfg["top_p"],
        key=jax.random.key(cfg["seed"]),
        on_token=on_token,
        # a vocabulary padded past the codec's (50257 -> 50304) has ids that decode
        # to nothing
        vocab_limit=codec.n_vocab if codec.n_vocab < c.vocab_size else None,
    )
    dt = time.time() - t0
    if cfg["stream"]:
        jax.effects_barrier()  # every token's callback has run
        print(decode_one(None))
        print(SEPARATOR)
    else:
        for row in y:
            print(codec.decode(row.tolist()))
            print(SEPARATOR)
    print(
        f"{y.shape[0] * cfg['max_new_tokens']} tokens in {dt:.1f}s, compilation included",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    exit_on_bad_input(main)
