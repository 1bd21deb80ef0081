"""
train.py's set-up, one named builder per thing a run needs before its first step: the model's config
(from the settings, a checkpoint or pretrained weights), the data's loaders, HellaSwag's file, the
check that an out_dir holds one run, and several processes joined into one JAX runtime. Each checks
its input before anything is written, and says what is wrong in one line (a UsageError).
"""

import logging
import os
import signal
from dataclasses import dataclass, replace
from functools import partial

import jax
from flax import nnx
from jax.experimental import multihost_utils

from archs import models, nanochat_optim_state, nanochat_sft
from compute import sharding
from configurator import InputNotFound, RunStopped, UsageError, exit_on_interrupt
from dataio import hellaswag_data, nanochat_checkpoint, nanochat_optimizer_state, storage
from dataio.dataloader import TOKENIZER_FILE, make_loader
from dataio.pretrained import read_pretrained
from dataio.tokenizer import nanochat_base_dirs, vocab_file
from model import GPTConfig
from run import checkpoint, watchdog
from run.settings import check_model, fixed_by_checkpoint


@dataclass
class Start:
    """Where a run starts: its model's config, and what init_from read to get it."""

    model_config: GPTConfig
    meta: dict = None  # a resumed checkpoint's meta (init_from=resume)
    weights: dict = None  # pretrained weights, read lazily (init_from=<a model>)
    mngr: object = None  # the checkpoint manager a resume read with
    iter_num: int = 0
    best_val_loss: float = float("inf")


def dial(c, data_vocab_size, mesh, master):
    """The settings the run's architecture derives from others (Arch.dial: nanochat's depth), set
    in `c` and checked as typed ones are; what they became printed once."""
    summary = models.arch_of(c["arch"]).dial(c, data_vocab_size, sharding.batch_shards(mesh))
    if summary:
        check_model(c)
        if master:
            print(summary)


def take_from_start(c, data_dir, typed=()):
    """What the run's start says of settings the dial and the data read, into `c` before them.
    A nanochat checkpoint: its window_pattern, which its weights do not fix, unless one is typed
    (a config file's, written for a new run, passes without a word, as on resume), so that what
    runs is what the dial prints; its tokenizer (beside it or up to two folders up, as nanochat
    keeps it) where neither --tokenizer nor the dataset's folder gives one; and for finetuning
    what chat_sft inherits from it (inherit_pretraining). A finetuning run resumed: what it
    inherited then (and the Muon weight decay of its warm start), from its own checkpoint's
    settings."""
    if c["init_from"] == "resume":
        if c["lr_schedule"] == "sft":  # no checkpoint there: the line start_for would give
            saved = checkpoint.restore(c["out_dir"])["meta"]["config"]
            for key in [ours for ours, _, _ in INHERITED] + ["tokenizer", "weight_decay"]:
                if key not in typed:
                    c[key] = saved[key]
        return
    checkpoints = nanochat_checkpoint
    found = c["init_from"] != "scratch" and checkpoints.nanochat_checkpoint(c["init_from"])
    if not found:
        return
    meta = checkpoints.read_meta(os.path.join(found[0], checkpoints.meta_file(found[1])))
    if "window_pattern" not in typed:
        c["window_pattern"] = checkpoints.config_args(meta["model_config"])["window_pattern"]
    if c["lr_schedule"] == "sft":
        inherit_pretraining(c, meta, typed)
    if not c["tokenizer"] and not storage.exists(storage.join(data_dir, *TOKENIZER_FILE)):
        for folder in [found[0], *nanochat_base_dirs(found[0])]:
            if storage.exists(storage.join(folder, *TOKENIZER_FILE)):
                c["tokenizer"] = storage.join(folder, TOKENIZER_FILE[0])
                break


# chat_sft's inheritance from the base checkpoint's meta: (ours, where in the meta, its name)
INHERITED = (
    ("block_size", (), "max_seq_len"),
    ("batch_size", (), "device_batch_size"),
    ("total_batch_size", (), "total_batch_size"),
    ("embed_learning_rate", ("user_config",), "embedding_lr"),
    ("learning_rate", ("user_config",), "unembedding_lr"),
    ("muon_learning_rate", ("user_config",), "matrix_lr"),
)


def inherit_pretraining(c, meta, typed):
    """Finetuning takes the base run's row length, batch and three rates from its checkpoint's
    meta, as chat_sft does, unless typed (the config's are chat_sft's fallbacks, for a meta
    without them)."""
    for ours, where, theirs in INHERITED:
        found = meta
        for key in where:
            found = found.get(key) or {}
        if ours not in typed and found.get(theirs) is not None:
            c[ours] = found[theirs]


def start_for(c, runtime, data_vocab_size, data_dir, master, typed=()):
    """The run's Start from init_from: 'scratch' (the settings' shape; vocab_size 0: the data's),
    'resume' (the checkpoint's shape and block_size, into `c`; a value `typed` on the command line
    that differs is named once: settings.fixed_by_checkpoint) or a
    pretrained model (its shape, cropped to block_size once placed). `runtime`: GPTConfig's run
    choices (model.RUNTIME_FIELDS)."""
    if c["init_from"] == "scratch":
        vocab_size = c["vocab_size"] or data_vocab_size
        if not c["vocab_size"] and data_vocab_size:
            source = (
                c["tokenizer"] or vocab_file(data_dir) or storage.join(data_dir, *TOKENIZER_FILE)
            )
            print(f"found vocab_size = {vocab_size} (inside {source})")
        keys = ("block_size", "n_layer", "n_head", "n_embd", "bias", "gelu", "arch")
        keys += ("n_kv_head", "window_pattern")
        start = Start(
            GPTConfig(**{k: c[k] for k in keys}, vocab_size=vocab_size or 50304, **runtime)
        )
    elif c["init_from"] == "resume":
        # the run's one checkpoint manager, opened where there are checkpoints
        mngr = None
        if storage.isdir(checkpoint.ckpt_dir(c["out_dir"])):
            mngr = checkpoint.manager(c["out_dir"], c["keep_checkpoints"])
        meta = checkpoint.restore(c["out_dir"], mngr=mngr)["meta"]
        ignored = fixed_by_checkpoint(c, meta["model_args"], typed)
        if ignored and master:
            print(
                f"resume: the checkpoint fixes {', '.join(f'{k}={c[k]}' for k in ignored)}; "
                f"ignored {', '.join(f'--{k}={v}' for k, v in ignored.items())}"
            )
        config = checkpoint.model_config_from_meta(meta, **runtime)
        start = Start(config, meta, None, mngr, meta["iter_num"], meta["best_val_loss"])
    else:  # a pretrained model; a record's .pt needs n_head
        config_args, weights, _ = read_pretrained(c["init_from"], n_head=c["n_head"])
        shape = ("n_layer", "n_head", "n_embd")
        if c["depth"] and any(config_args[k] != c[k] for k in shape):
            raise UsageError(  # the dial's rates and horizon are for the model it sizes
                f"depth={c['depth']} dials {', '.join(f'{k}={c[k]}' for k in shape)}, and "
                f"{c['init_from']} holds {', '.join(f'{k}={config_args[k]}' for k in shape)}: "
                "give the depth, aspect_ratio and head_dim it was trained with"
            )
        if "window_pattern" in config_args:  # take_from_start's choice
            config_args["window_pattern"] = c["window_pattern"]
        # the run's settings say the model it trains (its optimizer reads n_embd: nanochat's
        # AdamW rates scale by 1/sqrt(n_embd / 768))
        c.update({k: config_args[k] for k in shape})
        start = Start(replace(GPTConfig(**config_args), **runtime), weights=weights)
        if c["lr_schedule"] == "sft" and c["load_optimizer"]:
            start.weights = warm_start(c, start.model_config, weights, master, typed)
    if c["block_size"] > start.model_config.block_size:
        raise UsageError(
            f"block_size={c['block_size']} exceeds the model's {start.model_config.block_size}"
        )
    return start


def warm_start(c, config, weights, master, typed=()):
    """Finetuning from a nanochat checkpoint (load_optimizer, chat_sft's --load-optimizer=1): its
    weights with the optimizer state saved beside them (init_state puts it in our optimizer), and
    into `c` the weight decay its Muon groups hold, which chat_sft's load keeps (unless typed).
    Without that file, nanochat's warning and a fresh optimizer, as chat_sft starts."""
    found = nanochat_checkpoint.nanochat_checkpoint(c["init_from"])
    if not found:
        return weights
    model = nnx.eval_shape(lambda: models.build(config, nnx.Rngs(0)))
    ours = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    shapes = {  # torch's: an nn.Linear's weight (out, in), our kernel (in, out)
        name: ours[path].shape[::-1] if linear else ours[path].shape
        for name, path, linear in model.weight_rows()
    }
    state = nanochat_optimizer_state.read_optimizer_state(*found, shapes)
    path = os.path.join(found[0], nanochat_optimizer_state.optim_file(found[1]))
    if state is None:
        if master:
            print(
                f"WARNING: optimizer checkpoint not found ({path}), starting with fresh "
                "optimizer (slightly worse)"
            )
        return weights
    try:
        nanochat_optim_state.check_group_settings(state.groups)
        if "weight_decay" not in typed:
            c["weight_decay"] = state.muon_weight_decay()
    except (UsageError, ValueError) as e:
        raise UsageError(f"{path}: {e}; {nanochat_optimizer_state.FIX}") from None
    if master:
        steps = sorted({s["step"] for s in state.state.values() if "step" in s})
        print(
            f"loaded optimizer state from {path} (AdamW at step {', '.join(map(str, steps))}, "
            f"Muon's weight decay {c['weight_decay']:.6g}; learning rates the run's own)"
        )
    return nanochat_optimizer_state.WithOptimizerState(weights, state)


def make_loaders(c, data_dir, batch_sharding, accum, rows, vocab_size, data_vocab_size):
    """{'train', 'val'} loaders for estimate_loss, and the steps' own train loader, each yielding
    this process's rows of (accum, rows, block_size) batches. A missing or bad dataset fails here,
    before anything is written."""
    row_slice = sharding.process_rows(batch_sharding, (accum, rows, c["block_size"]), row_axis=1)
    loader = partial(
        make_loader,
        data_dir,
        block_size=c["block_size"],
        rows=rows,
        seed=c["seed"],
        row_slice=row_slice,
        shuffle_shards=c["shuffle_shards"],
        vocab_size=vocab_size,
        tokenizer=c["tokenizer"],
        sft=sft_data(c, accum),
        **models.arch_of(c["arch"]).loader,
    )
    # else the first batch's ids say it, after out_dir exists
    if data_vocab_size > vocab_size:
        raise UsageError(
            f"{vocab_file(data_dir)} has {data_vocab_size} characters, more than the "
            f"model's vocab_size {vocab_size}: set "
            f"--vocab_size={data_vocab_size} or more (or 0: the data's)"
        )
    return {"train": loader("train"), "val": loader("val")}, loader("train")


def sft_data(c, accum):
    """lr_schedule='sft' (nanochat's finetuning): what its conversation loader takes; else None.
    max_iters steps of accum micro-batches are chat_sft's --num-iterations=max_iters x accum + 1
    (it counts the micro-batches its loader fetches, one ahead of the step)."""
    if c["lr_schedule"] != "sft":
        return None
    iterations = c["max_iters"] * accum + 1 if c["max_iters"] else 0
    mix = ("mmlu_epochs", "gsm8k_epochs", "identity_epochs", "simple_spelling", "spelling_bee")
    return {"num_iterations": iterations, "mix": {k: c[k] for k in mix}}


def sft_horizon(c, train_loader, accum, master):
    """lr_schedule='sft': each step's progress through the conversations (the loader run once
    over them: archs/nanochat_sft.progress_table), and into c its max_iters: one epoch's steps
    where it is 0, as chat_sft's, else the steps given (fewer where the epoch ends first)."""
    steps, progress = nanochat_sft.progress_table(train_loader.fresh(), accum)
    if master:
        horizon = "one epoch" if not c["max_iters"] else f"max_iters={c['max_iters']}"
        print(
            f"finetuning on {len(train_loader.conversations):,} conversations: {steps:,} steps "
            f"({horizon})"
        )
    c["max_iters"] = steps
    return progress


def hellaswag_path(c, vocab, data_dir, master):
    """The HellaSwag file the run scores every hellaswag_interval, found (or downloaded) now, so
    that a missing file fails before anything is written rather than at step 5000."""
    if isinstance(vocab, list):
        raise UsageError(
            f"hellaswag_interval={c['hellaswag_interval']}: HellaSwag is scored in GPT-2's BPE, "
            f"and this run's data is character-level ({vocab_file(data_dir) or data_dir}): set "
            "--hellaswag_interval=0"
        )
    path = c["hellaswag_path"]
    if not path:
        try:
            # process 0 downloads; the others then find it (a shared disk) or fetch their own
            if not master:
                multihost_utils.sync_global_devices("hellaswag download")
            path = hellaswag_data.download("val")
            if master and jax.process_count() > 1:
                multihost_utils.sync_global_devices("hellaswag download")
        except OSError:
            raise InputNotFound(
                "could not download HellaSwag (offline?): set --hellaswag_path=FILE.jsonl "
                "or --hellaswag_interval=0"
            ) from None
    elif not os.path.isfile(path):
        raise InputNotFound(f"hellaswag_path {path} does not exist")
    return path


def check_one_run(c):
    """One run per out_dir: a run that starts anew (not resume, not eval_only) into an out_dir
    holding checkpoints would rotate some of them out and leave a resume point of the other run. One
    line naming the ways out."""
    if c["init_from"] == "resume" or c["eval_only"] or c["start_over"]:
        return
    try:
        steps = checkpoint.all_steps(c["out_dir"])
    except InputNotFound:
        return
    raise UsageError(
        f"{c['out_dir']} holds the checkpoints of another run (steps "
        f"{', '.join(map(str, steps))}): continue it with --init_from=resume, give this run a new "
        "--out_dir, or --start_over=True to move them aside first"
    )


class Stops:
    """From the first step on, SIGINT and SIGTERM ask the loop to save and stop at a step's end.
    With several processes, JAX's preemption service owns SIGTERM (Ctrl-C becomes one): each
    process's notice reaches all, which agree on a step (the largest they have reached, plus one)
    and all stop there; the step never waits."""

    def __init__(self):
        self.requested = None
        several = jax.process_count() > 1
        signal.signal(signal.SIGINT, sigint_as_sigterm if several else self.request)
        if not several:
            signal.signal(signal.SIGTERM, self.request)

    def request(self, signum, frame):
        self.requested = signal.Signals(signum).name

    def agreed(self, iter_num):
        """The signal's name at the step every process stops at, else None."""
        if jax.process_count() == 1:
            return self.requested
        return "SIGTERM" if multihost_utils.reached_preemption_sync_point(iter_num) else None


def sigint_as_sigterm(signum, frame):
    """Ctrl-C on one process of several: a preemption notice like SIGTERM, so that all stop at one
    step."""
    os.kill(os.getpid(), signal.SIGTERM)


def launched_on_several_processes():
    """Whether this process is one of several: JAX_COORDINATOR_ADDRESS set, or a TPU pod slice,
    SLURM, Open MPI."""
    env = os.environ
    return (
        bool(env.get("JAX_COORDINATOR_ADDRESS"))
        or env.get("SLURM_NTASKS", "1") != "1"
        or env.get("OMPI_COMM_WORLD_SIZE", "1") != "1"
        or "," in env.get("TPU_WORKER_HOSTNAMES", "")
    )


def setup_distributed():
    """Several processes (hosts) -> one JAX runtime: explicit with JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES and JAX_PROCESS_ID; auto-detected on TPU pod slices, SLURM and Open MPI."""
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize(
            env["JAX_COORDINATOR_ADDRESS"],
            int(env["JAX_NUM_PROCESSES"]),
            int(env["JAX_PROCESS_ID"]),
        )
    elif launched_on_several_processes():
        jax.distributed.initialize()
    # a process killed or cut off ends the others within seconds, in one line each (JAX's own abort
    # takes 100 s)
    watchdog.watch_processes()


def prepare_process():
    """This process made ready for a run, as train.py's main does before the settings are used:
    Ctrl-C or SIGTERM (a preemption, a scheduler) before the first step is one line, exit 130 or
    143, not XLA's dump (with several processes JAX's preemption service owns SIGTERM: Ctrl-C
    only); orbax's thread tracebacks quieted; the compilation cache; several processes joined; the
    backend started. Returns the callable that ends the first of those (Trainer.run calls it as the
    first step begins)."""
    several = launched_on_several_processes()
    signals = (signal.SIGINT,) if several else (signal.SIGINT, signal.SIGTERM)
    started = exit_on_interrupt("interrupted before the first step: nothing saved", signals)
    # orbax logs a failed background save as a traceback from each of its threads (24 for a full
    # disk); the run reports that failure itself, in one line (checkpoint.check_saved)
    logging.getLogger("absl").addFilter(lambda record: record.levelno < logging.ERROR)
    sharding.use_compilation_cache()
    setup_distributed()
    # before anything starts it: libtpu's banner on a machine without a TPU is dropped
    sharding.start_backend()
    sharding.keep_freed_memory()
    return started


def diverged(bad, out_dir, last_saved):
    """The RunStopped of a run whose step `bad` was not finite, naming its last checkpoint."""
    last = (
        f"the last checkpoint, {checkpoint.ckpt_dir(out_dir)}/{last_saved}, is from before"
        if last_saved is not None
        else "no checkpoint was written"
    )
    return RunStopped(
        f"iter {bad}: the loss or gradient norm is not finite (the run diverged: lower "
        f"learning_rate, keep grad_clip); stopped without saving, {last}"
    )
