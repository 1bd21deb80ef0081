"""
A checkpoint of ours out of the project: an HF GPT-2 directory, a nanoGPT ckpt.pt, or
(arch='speedrun' or 'speedrun20') a modded-nanogpt state_step*.pt of record 5 or 20.

    # GPT2LMHeadModel.from_pretrained
    python export.py --out_dir=out-shakespeare-char --format=hf --to=hf-shakespeare
    # nanoGPT's sample.py --out_dir
    python export.py --out_dir=out-shakespeare-char --format=nanogpt --to=nano-out
    # one step, to a file
    python export.py --out_dir=out --step=2000 --format=nanogpt --to=ckpt-2000.pt
    # record 5's (or record 20's) GPT.load_state_dict
    python export.py --out_dir=out-speedrun --format=modded --to=state_step005100.pt

A character-level run's vocabulary goes beside the weights twice: meta.json, which sample.py
--init_from=DIR reads (no pickle), and nanoGPT's meta.pkl, for nanoGPT's own sample.py. --step: a
saved step (default: the latest). --to: a directory for hf; for nanogpt a directory (ckpt.pt goes in
it, nanoGPT's out_dir layout) or a file ending in .pt; for modded a file ending in .pt (its state
dict's keys carry torch.compile's _orig_mod. prefix, as the record's files do). A speedrun model
(arch='speedrun' or 'speedrun20') exports to modded only, a GPT-2 one to hf and nanogpt only. Bad
input (no checkpoint, an unwritable target, a model the format cannot hold, a target holding an
earlier export) fails with one line, exit code 2, and writes nothing. An export is whole or not at
all: --overwrite=True replaces an earlier one at --to, every file of it removed first, never mixed
with the new.
"""

import os
import sys
import tempfile

from configurator import InputNotFound, UsageError, configure, exit_on_bad_input
from dataio import storage
from dataio.tokenizer import VOCAB_FILES, CharCodec, codec_for, save_vocab
from run.runlog import nearest_existing

FORMATS = ("hf", "nanogpt", "modded")
defaults = dict(
    out_dir="out",  # our training run's out_dir
    step=-1,  # the saved step to export; -1: the latest
    # 'hf' | 'nanogpt' | 'modded' (modded-nanogpt's state_step*.pt: arch='speedrun', 'speedrun20')
    format="hf",
    to="",  # where to write: a folder (hf), a ckpt.pt (nanogpt), a state_step*.pt (modded)
    # replace an earlier export at --to, whole (its weights and vocabulary files first removed)
    overwrite=False,
)


def target(cfg):
    """The path that will be written: checked writable before anything is loaded or written."""
    to = cfg["to"]
    if not to:
        raise UsageError("--to is required: where to write the export")
    if cfg["format"] not in FORMATS:
        raise UsageError(f"--format must be 'hf', 'nanogpt' or 'modded', got {cfg['format']!r}")
    if cfg["format"] == "modded" and not to.endswith(".pt"):
        raise UsageError(
            f"--format=modded writes one file: --to must end in .pt (e.g. state_step000100.pt), "
            f"got {to!r}"
        )
    hf = cfg["format"] == "hf"
    path = to if hf or to.endswith(".pt") else storage.join(to, "ckpt.pt")
    if storage.is_url(to):  # an object store: the bucket and its access; no folders to check
        storage.check_reachable(to, "--to")
    else:
        check_local_target(to, path, hf)
    # an export is whole or not at all: never new weights beside an earlier export's vocabulary (or
    # the reverse)
    earlier = [
        f for f in export_files(cfg["format"], path) if storage.exists(f) or os.path.lexists(f)
    ]
    if earlier and not cfg["overwrite"]:
        raise UsageError(
            f"{to} holds an earlier export ({', '.join(f.rsplit('/', 1)[-1] for f in earlier)}): "
            "give a new --to, or --overwrite=True to replace it whole"
        )
    return path, earlier


def check_local_target(to, path, hf):
    directory = to if hf else os.path.dirname(path)
    if not hf and os.path.isdir(path):
        raise UsageError(
            f"cannot write to {path}: it is a directory; give a file's path (ending in .pt) or a "
            "directory that holds no ckpt.pt directory"
        )
    if hf and os.path.exists(to) and not os.path.isdir(to):
        raise UsageError(
            f"cannot write to {to}: it is a file, and --format=hf writes a directory; give another "
            "--to"
        )
    existing = nearest_existing(directory or ".")
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write to {to}: {existing} is not a writable directory")


def export_files(fmt, path):
    """The files an export to `path` writes, which an earlier export there may have left: the
    weights (HF: the config and the safetensors) and the character vocabulary beside them."""
    directory = path if fmt == "hf" else storage.dirname(path)
    weights = (
        [storage.join(path, f) for f in ("config.json", "model.safetensors")]
        if fmt == "hf"
        else [path]
    )
    return weights + [storage.join(directory, f) for f in VOCAB_FILES]


def main(argv=None):
    cfg = configure(defaults, sys.argv[1:] if argv is None else argv)
    path, earlier = target(cfg)
    # here, once the settings are checked: jax, flax and orbax take seconds to import
    from compute import sharding
    from dataio import pretrained, weights
    from run import checkpoint

    sharding.start_backend()
    model, meta = checkpoint.load_checkpoint_model(
        cfg["out_dir"], None if cfg["step"] == -1 else cfg["step"]
    )
    c = model.config
    try:
        codec = codec_for(c.vocab_size, meta.get("vocab"), meta["config"].get("dataset"))
    # the weights are whole without it; sample.py will say the same of the export
    except InputNotFound as e:
        codec = None
        print(f"note: {e}")
    try:
        for f in earlier:  # --overwrite: the earlier export goes first, whole
            storage.remove(f)
        # an object store's export is written here, then uploaded
        with tempfile.TemporaryDirectory() as staging:
            remote = storage.is_url(path)
            local = os.path.join(staging, path.rstrip("/").rsplit("/", 1)[-1]) if remote else path
            if cfg["format"] == "hf":
                weights.save_hf(model, local)
            elif cfg["format"] == "modded":
                pretrained.save_modded(model, local, meta["iter_num"])
            else:
                pretrained.save_nanogpt(
                    model, local, meta["iter_num"], meta["best_val_loss"], meta["config"]
                )
            # beside the weights, where sample.py (and nanoGPT's, by hand) finds it
            if isinstance(codec, CharCodec):
                save_vocab(os.path.dirname(local) if local.endswith(".pt") else local, codec.itos)
            if remote:
                storage.upload(
                    local if cfg["format"] == "hf" else staging,
                    path if cfg["format"] == "hf" else storage.dirname(path),
                )
    # a path that looked writable and is not: under /proc, a read-only mount, a full disk
    except OSError as e:
        raise UsageError(f"cannot write to {cfg['to']}: {e.strerror or e}") from None
    if cfg["format"] == "hf" and not c.bias:
        print(
            "bias=False: written with zero biases (HF's GPT-2 always has them; the same function)"
        )
    if cfg["format"] == "hf" and c.vocab_size > 50257:
        print(
            f"vocab_size {c.vocab_size} kept: GPT-2's 50257 padded, ids 50257+ are no tokens "
            "(sample.py never samples them; transformers' generate can)"
        )
    print(
        f"wrote {path} ({cfg['format']}, step {meta['iter_num']} of {cfg['out_dir']}, "
        f"{model.num_params() / 1e6:.2f}M params)"
    )
    return 0


if __name__ == "__main__":
    exit_on_bad_input(main)
