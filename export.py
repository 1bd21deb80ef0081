"""
A checkpoint of ours out of the project: an HF GPT-2 directory, a nanoGPT ckpt.pt,
(arch='speedrun' or 'speedrun20') a modded-nanogpt state_step*.pt of record 5 or 20, or
(arch='nanochat') a nanochat checkpoint directory.

    # GPT2LMHeadModel.from_pretrained
    python export.py --out_dir=out-shakespeare-char --format=hf --to=hf-shakespeare
    # nanoGPT's sample.py --out_dir
    python export.py --out_dir=out-shakespeare-char --format=nanogpt --to=nano-out
    # one step, to a file
    python export.py --out_dir=out --step=2000 --format=nanogpt --to=ckpt-2000.pt
    # record 5's (or record 20's) GPT.load_state_dict
    python export.py --out_dir=out-speedrun --format=modded --to=state_step005100.pt
    # nanochat's checkpoint_manager.build_model(DIR, step, ...)
    python export.py --out_dir=out-nanochat --format=nanochat --to=DIR

A character-level run's vocabulary goes beside the weights twice: meta.json, which sample.py
--init_from=DIR reads (no pickle), and nanoGPT's meta.pkl, for nanoGPT's own sample.py. --step: a
saved step (default: the latest). --to: a directory for hf; for nanogpt a directory (ckpt.pt goes in
it, nanoGPT's out_dir layout) or a file ending in .pt; for modded a file ending in .pt (its state
dict's keys carry torch.compile's _orig_mod. prefix, as the record's files do); for nanochat a
directory: model_NNNNNN.pt and meta_NNNNNN.json of the step, as its base_train saves them, the
optimizer state as optim_NNNNNN_rank0.pt where the run's optimizer is nanochat's (muonadamw: its
chat_sft warm-starts from it), and the run's tokenizer as DIR/tokenizer/ (set
NANOCHAT_BASE_DIR=DIR for nanochat's scripts to find it). A
speedrun model (arch='speedrun' or 'speedrun20') exports to modded only, a nanochat one to nanochat
only, a GPT-2 one to hf and nanogpt only. Bad
input (no checkpoint, an unwritable target, a model the format cannot hold, a target holding an
earlier export) fails with one line, exit code 2, and writes nothing. An export is whole or not at
all: --overwrite=True replaces an earlier one at --to, every file of it removed first, never mixed
with the new.
"""

import json
import os
import sys
import tempfile

from configurator import InputNotFound, UsageError, configure, exit_on_bad_input
from dataio import storage
from dataio.tokenizer import VOCAB_FILES, CharCodec, ChatCodec, codec_for, save_vocab
from run.runlog import LOG_FILE, nearest_existing

NANOCHAT_FILES = (("model", "pt"), ("meta", "json"), ("optim", "pt"))  # of each step
CHAT_TOKENIZER_FILES = ("tokenizer.pkl", "token_bytes.pt")
FORMATS = ("hf", "nanogpt", "modded", "nanochat")
DIRECTORY_FORMATS = ("hf", "nanochat")  # --to is a folder
defaults = dict(
    out_dir="out",  # our training run's out_dir
    step=-1,  # the saved step to export; -1: the latest
    # 'hf' | 'nanogpt' | 'modded' (modded-nanogpt's state_step*.pt: arch='speedrun', 'speedrun20') |
    # 'nanochat' (its checkpoint directory: arch='nanochat')
    format="hf",
    # where to write: a folder (hf, nanochat), a ckpt.pt (nanogpt), a state_step*.pt (modded)
    to="",
    # replace an earlier export at --to, whole (its weights and vocabulary files first removed)
    overwrite=False,
)


def target(cfg):
    """The path that will be written: checked writable before anything is loaded or written."""
    to = cfg["to"]
    if not to:
        raise UsageError("--to is required: where to write the export")
    if cfg["format"] not in FORMATS:
        raise UsageError(
            f"--format must be 'hf', 'nanogpt', 'modded' or 'nanochat', got {cfg['format']!r}"
        )
    if cfg["format"] == "modded" and not to.endswith(".pt"):
        raise UsageError(
            f"--format=modded writes one file: --to must end in .pt (e.g. state_step000100.pt), "
            f"got {to!r}"
        )
    hf = cfg["format"] in DIRECTORY_FORMATS
    if cfg["format"] == "nanochat" and to.endswith(".pt"):
        raise UsageError(
            "--format=nanochat writes a directory (model_NNNNNN.pt, meta_NNNNNN.json, "
            f"tokenizer/): give --to a folder, got {to!r}"
        )
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
            f"cannot write to {to}: it is a file, and this format writes a directory; give "
            "another --to"
        )
    existing = nearest_existing(directory or ".")
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write to {to}: {existing} is not a writable directory")


def export_files(fmt, path):
    """The files an export to `path` writes, which an earlier export there may have left: the
    weights (HF: the config and the safetensors; nanochat: every step's model and meta, so that
    its largest step is the export's) and the vocabulary beside them."""
    if fmt == "nanochat":
        steps = [storage.glob(storage.join(path, f"{k}_*.{e}")) for k, e in NANOCHAT_FILES]
        tokenizer = [storage.join(path, "tokenizer", f) for f in CHAT_TOKENIZER_FILES]
        return [f for found in steps for f in found] + tokenizer
    directory = path if fmt == "hf" else storage.dirname(path)
    weights = (
        [storage.join(path, f) for f in ("config.json", "model.safetensors")]
        if fmt == "hf"
        else [path]
    )
    return weights + [storage.join(directory, f) for f in VOCAB_FILES]


def codec_of(meta):
    """What decodes the run's ids: its --tokenizer directory (nanochat's), else codec_for."""
    if meta["config"].get("tokenizer"):
        return ChatCodec.from_directory(meta["config"]["tokenizer"])
    return codec_for(
        meta["model_args"]["vocab_size"], meta.get("vocab"), meta["config"].get("dataset")
    )


def base_train_meta(out_dir, meta):
    """The run's side of nanochat's meta_NNNNNN.json (nanochat_checkpoint.save_nanochat): val bits
    per byte at the step and the least up to it from the run's log (None where not logged), its
    settings as user_config, its batch: rows of a device and tokens a step."""
    c, step = meta["config"], meta["iter_num"]
    try:
        lines = storage.read_bytes(storage.join(out_dir, LOG_FILE)).decode().splitlines()
    except OSError:  # no log beside the checkpoints: nothing known
        lines = []
    records = [json.loads(line) for line in lines if '"val_bpb"' in line]
    bpbs = {r["iter"]: r["val_bpb"] for r in records if r.get("iter", step + 1) <= step}
    tokens = c["batch_size"] * c["block_size"] * c["gradient_accumulation_steps"]
    return {
        "val_bpb": bpbs.get(step),
        "user_config": c,
        "device_batch_size": c["batch_size"],
        "total_batch_size": c.get("total_batch_size") or tokens,
        "loop_state": {
            "min_val_bpb": min(bpbs.values(), default=None),
            "smooth_train_loss": None,  # base_train's running mean: not kept here
            "total_training_time": None,
        },
    }


def nanochat_optimizer_state(out_dir, meta, model):
    """The run's MuonAdamW state at the step as nanochat's state_dict holds it
    (dataio/nanochat_optimizer_state.py), else None (another optimizer: nanochat's has no state
    of it). Its groups' settings: each group's rate as lr and initial_lr, Muon's momentum
    setup_optimizer's (every nanochat loop sets both before each step) and its weight decay as
    the run's last step left it (base_train's cosine at the step before, or a finetuning run's
    constant), which chat_sft's load keeps."""
    from archs import nanochat_optim, nanochat_optim_state
    from dataio import nanochat_optimizer_state as files
    from run import checkpoint

    c, step = meta["config"], meta["iter_num"]
    if c.get("optimizer") != "muonadamw":
        return None
    tx = nanochat_optim.for_run(c, lambda it: 1.0)  # its state's layout: the rates do not enter
    _, opt_state = checkpoint.restore_state(out_dir, step, meta, model.config, tx=tx)
    rows = model.weight_rows()
    weight_decay = c["weight_decay"]
    if c["lr_schedule"] != "sft":
        last = max(step - 1, 0)
        weight_decay = float(nanochat_optim.muon_weight_decay(last, weight_decay, c["max_iters"]))
    rates = nanochat_optim.group_rates(
        c["n_embd"],
        *(c[k] for k in ("learning_rate", "embed_learning_rate", "muon_learning_rate")),
        c["scalar_learning_rate"],
    )
    shapes = {n: a.shape for n, a in model.nanochat_state().items()}
    groups = [
        (label, names, nanochat_optim_state.group_settings(label, rates, weight_decay))
        for label, names in files.torch_order(shapes)
    ]
    named = nanochat_optim_state.nanochat_named(opt_state, rows)
    return files.NanochatOptimizerState(groups, named)


def main(argv=None):
    cfg = configure(defaults, sys.argv[1:] if argv is None else argv)
    path, earlier = target(cfg)
    # here, once the settings are checked: jax, flax and orbax take seconds to import
    from compute import sharding
    from dataio import nanochat_checkpoint, pretrained, weights
    from dataio.nanochat_optimizer_state import save_optimizer_state
    from run import checkpoint

    sharding.start_backend()
    model, meta = checkpoint.load_checkpoint_model(
        cfg["out_dir"], None if cfg["step"] == -1 else cfg["step"]
    )
    c = model.config
    weights.check_export(model, cfg["format"])  # before an earlier export is removed
    try:
        codec = codec_of(meta)
    # the weights are whole without it; sample.py will say the same of the export
    except InputNotFound as e:
        if cfg["format"] == "nanochat":  # nanochat's build_model loads its tokenizer too
            raise
        codec = None
        print(f"note: {e}")
    if cfg["format"] == "nanochat" and not isinstance(codec, ChatCodec):
        raise UsageError(
            "--format=nanochat writes the run's nanochat tokenizer beside the weights, and "
            f"{cfg['out_dir']} was not trained in one: train on a folder holding a tokenizer/"
        )
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
            elif cfg["format"] == "nanochat":
                run = base_train_meta(cfg["out_dir"], meta)
                nanochat_checkpoint.save_nanochat(model, local, meta["iter_num"], run)
                state = nanochat_optimizer_state(cfg["out_dir"], meta, model)
                if state is not None:
                    save_optimizer_state(local, meta["iter_num"], state)
                codec.save(os.path.join(local, "tokenizer"))  # where its get_tokenizer looks
            else:
                pretrained.save_nanogpt(
                    model, local, meta["iter_num"], meta["best_val_loss"], meta["config"]
                )
            # beside the weights, where sample.py (and nanoGPT's, by hand) finds it
            if isinstance(codec, CharCodec):
                save_vocab(os.path.dirname(local) if local.endswith(".pt") else local, codec.itos)
            if remote:
                storage.upload(
                    local if cfg["format"] in DIRECTORY_FORMATS else staging,
                    path if cfg["format"] in DIRECTORY_FORMATS else storage.dirname(path),
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
