"""
nanoGPT's training script in JAX. It runs on one CPU, one GPU, or every device of every host, on the mesh
('data', 'fsdp', 'tensor') of sharding.py: the batch is split over data x fsdp; params, gradients and
optimizer state over fsdp (ZeRO-3) and tensor (Megatron), replicated over data. XLA inserts the collectives.

To run on a single machine (all its devices):
$ python train.py config/train_shakespeare_char.py
$ python train.py --batch_size=32 --dataset=shakespeare_char
$ python train.py config/finetune_shakespeare.py --fsdp=8   # gpt2-xl, params/grads/Adam split 8 ways

To run on several hosts, start the same command on each host; jax.distributed.initialize() finds the
others on a TPU pod slice (gcloud ... tpu-vm ssh --worker=all --command="python train.py ..."), under SLURM
or Open MPI; elsewhere set JAX_COORDINATOR_ADDRESS=host0:1234 JAX_NUM_PROCESSES=N JAX_PROCESS_ID=i.
"""

import ctypes
import importlib.util
import json
import logging
import os
import pickle
import platform
import signal
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import multihost_utils

import attention
import checkpoint
import runlog
import sharding
import watchdog
from configurator import InputNotFound, RunStopped, UsageError, configure, exit_on_bad_input, exit_on_interrupt
from dataloader import Prefetcher, make_loader
from model import GPT, REMAT, RUNTIME_FIELDS, GPTConfig, peak_flops
from train_step import (all_finite, compile_step, first_nonfinite, get_lr, make_eval_step, make_optimizer,
                        make_train_step, sharded_model)

# -----------------------------------------------------------------------------
# default config values designed to train a gpt2 (124M) on OpenWebText (nanoGPT's)
DEFAULTS = dict(
    # I/O
    out_dir="out",
    eval_interval=2000,
    log_interval=1,
    eval_iters=200,
    eval_only=False,  # if True, script exits right after the first eval
    always_save_checkpoint=True,  # if True, always save a checkpoint after each eval
    checkpoint_interval=0,  # also save every N iterations (0: only at evals)
    hellaswag_interval=0,  # HellaSwag (val, all devices) every N iterations and at the end; 0 = off
    hellaswag_path="",  # a local hellaswag_val.jsonl; "" = download it once (online)
    keep_checkpoints=3,  # the last K checkpoints are kept
    init_from="scratch",  # 'scratch' | 'resume' | 'gpt2*' | an HF GPT-2 directory | a nanoGPT ckpt.pt (or its out_dir)
    start_over=False,  # a new run into an out_dir holding checkpoints: move them to out_dir/previous-<time>/ first
    # wandb logging
    wandb_log=False,
    wandb_project="owt",
    wandb_run_name="gpt2",
    # data
    dataset="openwebtext",  # a folder under data/, or a path
    shuffle_shards=False,  # .npy shard datasets: visit the shards in a seeded order each epoch
    gradient_accumulation_steps=5 * 8,  # total micro-batches per step, over all devices
    total_batch_size=0,  # tokens per step; when > 0, gradient_accumulation_steps is derived from it
    batch_size=12,  # micro-batch size per batch shard (a device, or a group of tensor_parallel devices)
    block_size=1024,
    # model
    n_layer=12,
    n_head=12,
    n_embd=768,
    vocab_size=0,  # 0: from data/<dataset>/meta.pkl, else GPT-2's 50257 padded to 50304
    dropout=0.0,  # for pretraining 0 is good, for finetuning try 0.1+
    bias=False,  # do we use bias inside LayerNorm and Linear layers?
    gelu="tanh",  # 'tanh': GPT-2's GELU | 'exact': nanoGPT's (erf; what export.py --format=nanogpt needs)
    # adamw optimizer
    learning_rate=6e-4,  # max learning rate
    max_iters=600000,  # total number of training iterations
    weight_decay=1e-1,
    beta1=0.9,
    beta2=0.95,
    grad_clip=1.0,  # clip gradients at this value, or disable if == 0.0
    # learning rate decay settings
    decay_lr=True,  # whether to decay the learning rate
    warmup_iters=2000,  # how many steps to warm up for
    lr_decay_iters=600000,  # should be ~= max_iters per Chinchilla
    min_lr=6e-5,  # minimum learning rate, should be ~= learning_rate/10 per Chinchilla
    # parallelism: the mesh is (data, fsdp, tensor), data = devices / (fsdp * tensor_parallel)
    fsdp=1,  # split params, grads and optimizer state over this many devices (the batch too)
    tensor_parallel=1,  # split each layer's heads and MLP units over this many devices (same rows)
    # system
    dtype="auto",  # 'float32' | 'bfloat16' | 'auto' (bfloat16 on GPU/TPU, float32 on CPU)
    attention="auto",  # 'xla' | 'cudnn' (NVIDIA Ampere+, bf16) | 'splash' (TPU) | 'auto': the fused one where it runs
    remat="none",  # recompute in the backward to save memory: 'none' | 'block' | 'dots' | 'qkv_proj' (model.REMAT)
    loss_chunk=0,  # the loss's logits this many positions at a time (memory B x loss_chunk x vocab); 0: all at once
    scan_layers="auto",  # True: the blocks under one lax.scan (one compiled block) | False | 'auto' (on GPU/TPU)
    profile="",  # 'START:STOP': a jax.profiler trace of iterations START..STOP-1 to out_dir/profile
    seed=1337,
)


POSITIVE = ("batch_size", "block_size", "n_layer", "n_head", "n_embd", "gradient_accumulation_steps", "eval_iters",
            "eval_interval", "log_interval", "keep_checkpoints")
NOT_NEGATIVE = ("max_iters", "total_batch_size", "vocab_size", "checkpoint_interval", "hellaswag_interval",
                "warmup_iters", "lr_decay_iters", "learning_rate", "min_lr", "weight_decay", "grad_clip")


def validate(c):
    """Every setting's range, before anything is read or written: one UsageError naming the fix."""
    for key in POSITIVE:
        if c[key] < 1:
            raise UsageError(f"{key} must be >= 1, got {c[key]}")
    for key in NOT_NEGATIVE:
        if c[key] < 0:
            raise UsageError(f"{key} must be >= 0{' (0: off)' if key.endswith('_interval') else ''}, got {c[key]}")
    if c["n_embd"] % c["n_head"]:
        raise UsageError(f"n_embd={c['n_embd']} must be divisible by n_head={c['n_head']}")
    if not 0.0 <= c["dropout"] < 1.0:
        raise UsageError(f"dropout must be in [0, 1), got {c['dropout']}")
    for key in ("beta1", "beta2"):
        if not 0.0 <= c[key] < 1.0:
            raise UsageError(f"{key} must be in [0, 1), got {c[key]}")
    resolve_dtype(c["dtype"], "cpu")
    resolve_scan_layers(c["scan_layers"], "cpu")
    for key, allowed in (("attention", attention.SETTINGS), ("remat", tuple(REMAT)), ("gelu", ("tanh", "exact"))):
        if c[key] not in allowed:
            raise UsageError(f"{key} must be one of {', '.join(map(repr, allowed))}, got {c[key]!r}")
    if c["loss_chunk"] < 0:
        raise UsageError(f"loss_chunk must be >= 0 (0: the whole sequence at once), got {c['loss_chunk']}")
    profile_range(c["profile"])
    if not 0 <= c["seed"] < 2**32:
        raise UsageError(f"seed must be in [0, 2**32), got {c['seed']}")
    if c["wandb_log"] and importlib.util.find_spec("wandb") is None:
        raise UsageError("wandb_log=True needs wandb: pip install wandb, or set --wandb_log=False")
    if c["start_over"] and c["init_from"] == "resume":
        raise UsageError("start_over=True moves the checkpoints that init_from='resume' would continue: choose one")
    runlog.check_out_dir(c["out_dir"])
    if os.path.isfile(c["dataset"]):
        raise UsageError(f"--dataset={c['dataset']} is a file: give the folder holding train.bin and val.bin "
                         "(or the .npy shards), or a name under data/")


def profile_range(profile):
    """--profile=START:STOP -> (START, STOP), or None for ''."""
    if not profile:
        return None
    try:
        start, stop = (int(part) for part in str(profile).split(":"))
    except ValueError:
        start = stop = -1
    if not 0 <= start < stop:
        raise UsageError(f"profile must be START:STOP, the iterations to trace (0 <= START < STOP), got {profile!r}")
    return start, stop


def resolve_dtype(dtype, platform):
    """The compute dtype on `platform` (sharding.platform_of the run's mesh)."""
    if dtype == "auto":
        return "float32" if platform == "cpu" else "bfloat16"
    if dtype not in ("float32", "bfloat16"):
        raise UsageError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {dtype!r}")
    return dtype


def resolve_scan_layers(scan_layers, platform):
    """'auto': the blocks under one scan on GPU/TPU, where it compiles one block instead of n_layer (gpt2-xl's step
    for a TPU: README, Benchmarks); a Python loop on CPU, whose results it keeps bit for bit."""
    if scan_layers == "auto":
        return platform != "cpu"
    if not isinstance(scan_layers, bool):
        raise UsageError(f"scan_layers must be True, False or 'auto', got {scan_layers!r}")
    return scan_layers


def check_attention(config: GPTConfig, mesh):
    """The attention setting where it can never run on the mesh's devices (cudnn off NVIDIA, splash with dropout
    or a block_size it cannot take): one line, before anything is written."""
    device = mesh.devices.flat[0]
    try:
        attention.check_setting(config.attention, platform=device.platform, dtype=config.dtype,
                                head_size=config.n_embd // config.n_head, block_size=config.block_size,
                                dropout=config.dropout, capability=attention.cuda_capability(device))
    except ValueError as e:
        raise UsageError(str(e)) from None


def fixed_by_checkpoint(c, model_args):
    """On resume the checkpoint fixes the model's shape: the settings that asked otherwise, which now follow it."""
    ignored = {}
    for key in ("n_layer", "n_head", "n_embd", "vocab_size", "bias", "gelu"):
        if c[key] != model_args[key] and not (key == "vocab_size" and c[key] == 0):
            ignored[key] = c[key]
        c[key] = model_args[key]
    return ignored


def check_one_run(c):
    """One run per out_dir: a run that starts anew (not resume, not eval_only) into an out_dir holding checkpoints
    would rotate some of them out and leave a resume point of the other run. One line naming the ways out."""
    if c["init_from"] == "resume" or c["eval_only"] or c["start_over"]:
        return
    try:
        steps = checkpoint.all_steps(c["out_dir"])
    except InputNotFound:
        return
    raise UsageError(f"{c['out_dir']} holds the checkpoints of another run (steps {', '.join(map(str, steps))}): "
                     "continue it with --init_from=resume, give this run a new --out_dir, or --start_over=True "
                     "to move them aside first")


def data_meta(data_dir):
    """(vocab_size, vocab) of the data's meta.pkl (nanoGPT's char-level datasets write one): its vocab_size (0: no
    meta.pkl) and what decodes its tokens, saved in each checkpoint: the characters (its itos), 'gpt2' (BPE) where
    there is no meta.pkl, None where it holds no itos."""
    path = os.path.join(data_dir, "meta.pkl")
    if not os.path.exists(path):
        return 0, "gpt2"
    with open(path, "rb") as f:
        meta = pickle.load(f)
    itos = meta.get("itos")
    return meta["vocab_size"], [itos[i] for i in range(len(itos))] if itos else None


def data_dir_for(dataset):
    return dataset if os.path.isdir(dataset) and not os.path.isdir(os.path.join("data", dataset)) \
        else os.path.join("data", dataset)


class Trainer:
    """Everything a run holds, set up in __init__ (which validates all input before writing anything)
    and advanced by run()."""

    def __init__(self, config: dict):
        validate(config)
        c = self.c = dict(config)
        self.master = jax.process_index() == 0
        self.mesh = sharding.make_mesh(c["fsdp"], c["tensor_parallel"])
        platform = sharding.platform_of(self.mesh)  # the program's, not the host's
        c["dtype"] = resolve_dtype(c["dtype"], platform)
        c["scan_layers"] = resolve_scan_layers(c["scan_layers"], platform)
        self.batch_sharding = sharding.batch_sharding(self.mesh)
        shards = sharding.batch_shards(self.mesh)  # data x fsdp: the devices of a tensor group share rows
        if c["total_batch_size"] > 0:  # build-nanogpt: fixed tokens per step, whatever the mesh
            per_step = c["batch_size"] * c["block_size"] * shards
            if c["total_batch_size"] % per_step:
                raise UsageError(f"total_batch_size={c['total_batch_size']} is not a multiple of batch_size x "
                                 f"block_size x batch shards (data x fsdp) = {per_step}: change batch_size")
            c["gradient_accumulation_steps"] = c["total_batch_size"] // per_step * shards
        if c["gradient_accumulation_steps"] % shards:
            raise UsageError(f"gradient_accumulation_steps={c['gradient_accumulation_steps']} must be divisible by "
                             f"the number of batch shards, data x fsdp = {shards}")
        self.accum = c["gradient_accumulation_steps"] // shards
        self.rows = c["batch_size"] * shards  # global micro-batch
        self.tokens_per_iter = self.accum * self.rows * c["block_size"]

        # data first: a missing dataset fails before anything is written
        self.data_dir = data_dir_for(c["dataset"])
        row_slice = sharding.process_rows(self.batch_sharding, (self.accum, self.rows, c["block_size"]), row_axis=1)
        loader = partial(make_loader, self.data_dir, block_size=c["block_size"], rows=self.rows, seed=c["seed"],
                         row_slice=row_slice, shuffle_shards=c["shuffle_shards"])
        self.loaders = {"train": loader("train"), "val": loader("val")}  # estimate_loss's
        self.train_loader = loader("train")  # the steps' own: read ahead on a thread (run: Prefetcher)
        self.iter_num, self.best_val_loss, self.last_saved = 0, float("inf"), None

        # model + optimizer state, from scratch, a checkpoint or GPT-2 weights, each array created or read
        # straight into its shards (sharding.PARAM_SPECS): no device holds a full replica on the way
        tx = make_optimizer(c)
        meta, (self.data_vocab_size, self.vocab) = None, data_meta(self.data_dir)
        if c["init_from"] == "scratch":
            model_config = self._model_config()
        elif c["init_from"] == "resume":
            meta = checkpoint.restore(c["out_dir"])["meta"]
            model_config = checkpoint.model_config_from_meta(meta, **{k: c[k] for k in RUNTIME_FIELDS})
            ignored = fixed_by_checkpoint(c, meta["model_args"])
            if ignored and self.master:
                print(f"resume: the checkpoint fixes {', '.join(f'{k}={c[k]}' for k in ignored)}; "
                      f"ignored {', '.join(f'--{k}={v}' for k, v in ignored.items())}")
            self.vocab = meta.get("vocab", self.vocab)
        else:  # pretrained: the shape is known once loaded; every GPT-2 has head size 64
            model_config = GPTConfig(n_head=1, n_embd=64, block_size=c["block_size"],
                                     **{k: c[k] for k in RUNTIME_FIELDS})
        if c["init_from"] in ("scratch", "resume"):
            sharding.check_model_fits_mesh(model_config, self.mesh)
        check_attention(model_config, self.mesh)
        check_one_run(c)
        hellaswag_path = self._hellaswag_path() if c["hellaswag_interval"] > 0 else None
        # out_dir is made and locked before the model is built, so that a second run on it is refused at once
        start_over = (checkpoint.CKPT_SUBDIR, runlog.LOG_FILE) if c["start_over"] else ()
        self.lock = runlog.claim_out_dir(c["out_dir"], start_over) if self.master else None
        if c["init_from"] == "scratch":
            graphdef, params = sharded_model(lambda: GPT(model_config, nnx.Rngs(c["seed"])), self.mesh)
            model = nnx.merge(graphdef, params)
        elif c["init_from"] == "resume":
            model = nnx.eval_shape(lambda: GPT(model_config, nnx.Rngs(0)))
        else:
            model = GPT.from_pretrained(c["init_from"], mesh=self.mesh, **{k: c[k] for k in RUNTIME_FIELDS})
            if c["block_size"] < model.config.block_size:
                model.crop_block_size(c["block_size"])
        self.model_config = model.config
        sharding.check_model_fits_mesh(self.model_config, self.mesh)
        check_attention(self.model_config, self.mesh)
        for loader in (*self.loaders.values(), self.train_loader):
            loader.vocab_size = self.model_config.vocab_size
        if c["block_size"] > self.model_config.block_size:
            raise UsageError(f"block_size={c['block_size']} exceeds the model's {self.model_config.block_size}")
        graphdef, params = nnx.split(model)
        if meta is None:
            params = jax.device_put(params, sharding.shardings_for(params, self.mesh))  # a no-op where in place
            opt_shardings = sharding.shardings_for(jax.eval_shape(tx.init, params), self.mesh)
            opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
        else:
            params, opt_state = checkpoint.restore_state(c["out_dir"], None, meta, self.model_config, tx, self.mesh)
            self.iter_num, self.best_val_loss = meta["iter_num"], meta["best_val_loss"]
            self.last_saved = self.iter_num
            self.train_loader.load_state_dict(meta["loader"])
        self.graphdef = graphdef
        self._param_def, self._opt_def = jax.tree.structure(params), jax.tree.structure(opt_state)
        self._param_leaves, self._opt_leaves = jax.tree.leaves(params), jax.tree.leaves(opt_state)
        self.model = nnx.merge(graphdef, params)  # for num_params
        # MFU's numerator per iteration (sequences over all devices) and denominator, once; None off GPU/TPU
        self.flops_per_iter = self.model.flops_per_token() * c["block_size"] * self.accum * self.rows
        peaks = [peak_flops(d) for d in self.mesh.devices.flat]
        self.peak_flops = None if None in peaks else sum(peaks)
        self.hellaswag_examples = None
        if hellaswag_path:
            import hellaswag

            self.hellaswag_examples = hellaswag.load_examples(hellaswag_path, max_len=self.model_config.block_size)
        step = make_train_step(graphdef, tx, c["grad_clip"], lr_schedule=partial(get_lr, c=c))
        self.train_step = self._compile_step(step, params, opt_state)
        self.eval_step = make_eval_step(graphdef, params)
        self.stop_requested = None
        self._first_nonfinite = jax.device_put(jnp.int32(-1), sharding.replicated(self.mesh))
        self.batches = None  # the Prefetcher, while run() runs
        self._unlogged = None  # a log step's (iter, metrics, first non-finite iter so far), read one step late
        self.profile = profile_range(c["profile"]) or (-1, -1)
        self.profile_dir, self._profiling = os.path.join(c["out_dir"], "profile"), False

    # the loop holds params and optimizer state as lists of arrays (see on_leaves)
    @property
    def params(self):
        return self._param_def.unflatten(self._param_leaves)

    @property
    def opt_state(self):
        return self._opt_def.unflatten(self._opt_leaves)

    def _model_config(self):
        c = self.c
        vocab_size = c["vocab_size"]
        if not vocab_size and self.data_vocab_size:
            vocab_size = self.data_vocab_size
            print(f"found vocab_size = {vocab_size} (inside {os.path.join(self.data_dir, 'meta.pkl')})")
        return GPTConfig(block_size=c["block_size"], vocab_size=vocab_size or 50304, n_layer=c["n_layer"],
                         n_head=c["n_head"], n_embd=c["n_embd"], bias=c["bias"], gelu=c["gelu"],
                         **{k: c[k] for k in RUNTIME_FIELDS})

    def _hellaswag_path(self):
        """Before anything is written, so that a missing file fails now rather than at step 5000."""
        if isinstance(self.vocab, list):
            raise UsageError(f"hellaswag_interval={self.c['hellaswag_interval']}: HellaSwag is scored in GPT-2's BPE, "
                             f"and this run's data is character-level ({self.data_dir}/meta.pkl): set "
                             "--hellaswag_interval=0")
        import hellaswag

        path = self.c["hellaswag_path"]
        if not path:
            try:
                if not self.master:  # process 0 downloads; the others then find it (a shared disk) or fetch their own
                    multihost_utils.sync_global_devices("hellaswag download")
                path = hellaswag.download("val")
                if self.master and jax.process_count() > 1:
                    multihost_utils.sync_global_devices("hellaswag download")
            except OSError:
                raise InputNotFound("could not download HellaSwag (offline?): set --hellaswag_path=FILE.jsonl "
                                    "or --hellaswag_interval=0") from None
        elif not os.path.isfile(path):
            raise InputNotFound(f"hellaswag_path {path} does not exist")
        return path

    def eval_hellaswag(self):
        import hellaswag

        model = nnx.merge(self.graphdef, self.params)
        score = hellaswag.evaluate(model, self.hellaswag_examples, mesh=self.mesh)
        if self.master:
            print(f"step {self.iter_num}: hellaswag acc {score.acc:.4f}, acc_norm {score.acc_norm:.4f} "
                  f"({score.count} examples)")
        self.log({"iter": self.iter_num, "hellaswag_acc": score.acc, "hellaswag_acc_norm": score.acc_norm,
                  "hellaswag_count": score.count})

    def _compile_step(self, step, params, opt_state):
        """The jitted step, compiled now (not at step 0) so that its memory is known before anything runs:
        `memory per device` is printed, logged, and checked against the device's limit."""
        compiled, self.state_bytes, self.step_peak_bytes = compile_step(
            step, params, opt_state, (self.accum, self.rows, self.c["block_size"]), self.batch_sharding)
        limit = sharding.device_memory_limit()
        if limit is not None and self.step_peak_bytes > limit:
            raise UsageError(f"the train step needs {self.step_peak_bytes / 2**30:.2f} GiB per device, the device "
                             f"has {limit / 2**30:.2f} GiB: lower --batch_size (raise gradient_accumulation_steps "
                             "to keep the tokens per step), or raise --fsdp / --tensor_parallel")
        return compiled

    def _put(self, x, sharding):
        global_shape = x.shape[:-2] + (self.rows, x.shape[-1])
        return jax.make_array_from_process_local_data(sharding, x, global_shape)

    def estimate_loss(self):
        """Mean loss over eval_iters batches per split, each batch split over all devices."""
        rows = sharding.batch_sharding(self.mesh, ndim=2)
        out = {}
        for split, loader in self.loaders.items():
            with jax.set_mesh(self.mesh):  # the model's sharding constraints apply when the eval step is traced
                losses = [self.eval_step(self._param_leaves, self._put(x, rows), self._put(y, rows))
                          for x, y in loader.eval_batches(self.c["eval_iters"], self.iter_num)]
            out[split] = float(jnp.mean(jnp.stack(losses)))
        return out

    def log(self, record):
        if not self.master:
            return
        path = os.path.join(self.c["out_dir"], runlog.LOG_FILE)
        try:
            runlog.append_line(path, json.dumps(record))
        except OSError as e:
            intact = None if self.last_saved is None else \
                f"checkpoint {self.last_saved} in {checkpoint.ckpt_dir(self.c['out_dir'])}"
            raise runlog.write_failed(path, e, intact) from None
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "iter"}, step=record["iter"])

    def check_finite(self, params=False, first_nonfinite=None):
        """Stop at the first non-finite step, before any checkpoint of it: reads one scalar (at log steps, saves
        and the end; `first_nonfinite`: that scalar as of an earlier step); `params`: also the params, whose last
        update may overflow where its loss did not."""
        bad = int(self._first_nonfinite if first_nonfinite is None else first_nonfinite)
        if bad < 0 and params and not all_finite(self._param_leaves):
            bad = self.iter_num - 1
        if bad >= 0:
            last = (f"the last checkpoint, {checkpoint.ckpt_dir(self.c['out_dir'])}/{self.last_saved}, is from before"
                    if self.last_saved is not None else "no checkpoint was written")
            raise RunStopped(f"iter {bad}: the loss or gradient norm is not finite (the run diverged: lower "
                             f"learning_rate, keep grad_clip); stopped without saving, {last}")

    def save(self, mngr, val_loss=None):
        """A checkpoint of this step. `val_loss`: that of the eval of this step, with which rotation keeps the best
        checkpoint (checkpoint.manager); None for a save without an eval (checkpoint_interval, a stop)."""
        if self.last_saved == self.iter_num:  # e.g. the eval right after a resume
            return
        self.check_finite(params=True)
        checkpoint.check_saved(mngr)  # the previous save, before the next one can rotate its predecessor out
        self.last_saved = self.iter_num
        loader_state = self.batches.state if self.batches is not None else self.train_loader.state_dict()
        meta = checkpoint.meta_for(self.model_config, self.c, self.iter_num, self.best_val_loss, loader_state)
        meta["vocab"] = self.vocab  # what decodes its ids, wherever sample.py runs
        checkpoint.save(mngr, self.iter_num, self.params, self.opt_state, meta, val_loss)
        if self.master:
            print(f"saving checkpoint to {checkpoint.ckpt_dir(self.c['out_dir'])}/{self.iter_num}")

    def _request_stop(self, signum, frame):
        self.stop_requested = signal.Signals(signum).name

    def _stop_agreed(self):
        """With several processes, JAX's preemption service owns SIGTERM: each process's notice reaches all, which
        agree on a step (the largest they have reached, plus one) and all stop there; the step never waits."""
        if jax.process_count() == 1:
            return self.stop_requested
        return "SIGTERM" if multihost_utils.reached_preemption_sync_point(self.iter_num) else None

    def run(self, started=None):
        """The loop, to max_iters or a stop. `started()` is called as the first step begins (train.main: Ctrl-C
        until then ends the process at once, from then on it saves)."""
        try:
            return self._run(started)
        finally:
            if self.lock is not None:
                self.lock.close()

    def _run(self, started):
        c = self.c
        if self.master:
            n_dev, n_proc = jax.device_count(), jax.process_count()
            print(f"{n_dev} device(s) ({jax.devices()[0].device_kind}) on {n_proc} process(es); "
                  f"accumulation {self.accum} x micro-batch {self.rows} ({c['batch_size']} per batch shard)")
            print(f"tokens per iteration will be: {self.tokens_per_iter:,}")
            if c["attention"] == "splash" and sharding.platform_of(self.mesh) != "tpu":
                print("attention='splash' off a TPU: the same kernel in Pallas interpret mode (slow: for tests)")
            print(f"number of parameters: {self.model.num_params() / 1e6:.2f}M; dtype {c['dtype']}")
            print(f"mesh: data {self.mesh.shape['data']} x fsdp {self.mesh.shape['fsdp']} x tensor "
                  f"{self.mesh.shape['tensor']}; memory per device: state {self.state_bytes / 2**30:.2f} GiB, "
                  f"step peak {self.step_peak_bytes / 2**30:.2f} GiB")
        self.wandb = None
        if c["wandb_log"] and self.master:
            import wandb

            wandb.init(project=c["wandb_project"], name=c["wandb_run_name"], config=c)
            self.wandb = wandb
        self.log({"iter": self.iter_num, "event": "resume" if self.last_saved is not None else "start",
                  "dataset": c["dataset"], "config": c,
                  "state_bytes_per_device": self.state_bytes, "step_peak_bytes_per_device": self.step_peak_bytes})
        mngr = checkpoint.manager(c["out_dir"], c["keep_checkpoints"])
        if started is not None:
            started()
        signal.signal(signal.SIGINT, self._request_stop if jax.process_count() == 1 else sigint_as_sigterm)
        if jax.process_count() == 1:
            signal.signal(signal.SIGTERM, self._request_stop)

        self.batches = Prefetcher(self.train_loader, self.accum, partial(self._put, sharding=self.batch_sharding))
        try:
            self._loop(mngr)
        finally:
            self.batches.close()
            self._stop_profile()
        checkpoint.wait_saved(mngr)
        mngr.close()
        return self

    def _loop(self, mngr):
        """The steps, dispatched ahead of the host: nothing in a step waits for the device except the log line,
        which reads the metrics of the step before the one just dispatched (one step late), and evals/saves."""
        c = self.c
        base_key = jax.random.key(c["seed"])
        self._t0, self._last_log_iter, self._mfu = time.time(), self.iter_num, -1.0
        while True:
            last_step = self.iter_num == c["max_iters"]
            if self.iter_num % c["eval_interval"] == 0 or last_step:
                self._log_unlogged(mngr)
                self.evaluate(mngr, last_step)
                self._t0, self._last_log_iter = time.time(), self.iter_num  # eval time is not step time
            if self.hellaswag_examples and (self.iter_num % c["hellaswag_interval"] == 0 or last_step):
                self._log_unlogged(mngr)
                self.eval_hellaswag()
                self._t0, self._last_log_iter = time.time(), self.iter_num
            if c["eval_only"] or self.iter_num >= c["max_iters"]:
                self._log_unlogged(mngr)
                return

            if self.iter_num == self.profile[0]:
                self._log_unlogged(mngr)  # the trace holds the steps alone
                jax.profiler.start_trace(self.profile_dir, create_perfetto_trace=True)
                self._profiling = True
            x, y = self.batches.next()
            key = jax.random.fold_in(base_key, self.iter_num)  # dropout: a function of (seed, iter), resumable
            self._param_leaves, self._opt_leaves, metrics = self.train_step(
                self._param_leaves, self._opt_leaves, x, y, key)
            self._first_nonfinite = first_nonfinite(self._first_nonfinite, self.iter_num, metrics["finite"])
            self.iter_num += 1
            checkpoint.check_saved(mngr)  # a failed save stops the run before the next step
            self._log_unlogged(mngr)  # the previous log step's, while this step runs
            if self.iter_num == self.profile[1]:
                self._stop_profile(metrics)
            if self.iter_num % c["log_interval"] == 0 or self.iter_num == c["max_iters"]:
                self._unlogged = (self.iter_num - 1, metrics, self._first_nonfinite)
            # a step evaluated next is saved by its eval, with its val loss (for rotation to keep the best)
            if self._interval_save_due() and not self._evaluates_next():
                self._log_unlogged(mngr)
                self.save(mngr)
            stop = self._stop_agreed()
            if stop:
                self._log_unlogged(mngr)
                self.save(mngr)
                checkpoint.wait_saved(mngr)
                print(f"{stop}: checkpoint saved at iter {self.iter_num}; "  # every process: each host's own log
                      f"resume with --init_from=resume --out_dir={c['out_dir']}")
                return

    def _stop_profile(self, metrics=None):
        """Ends a trace begun at profile's START: after the last traced step has run (`metrics`: its outputs)."""
        if not self._profiling:
            return
        jax.block_until_ready(metrics)
        jax.profiler.stop_trace()
        self._profiling = False
        if self.master:
            print(f"profile of iterations {self.profile[0]}..{self.iter_num - 1} written to {self.profile_dir}: "
                  f"tensorboard --logdir={self.profile_dir} (profile plugin), or its perfetto_trace.json.gz in "
                  "ui.perfetto.dev")

    def evaluate(self, mngr, last_step):
        """Train and val loss, logged; a checkpoint when val improved (or always_save_checkpoint, or at the end)."""
        c = self.c
        self.check_finite()  # no eval of a diverged run
        losses = self.estimate_loss()
        if self.master:
            print(f"step {self.iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        self.log({"iter": self.iter_num, "train_loss": losses["train"], "val_loss": losses["val"],
                  "lr": float(get_lr(self.iter_num, c))})
        improved = losses["val"] < self.best_val_loss
        self.best_val_loss = min(self.best_val_loss, losses["val"])
        if self.iter_num > 0 and (improved or c["always_save_checkpoint"] or last_step or self._interval_save_due()):
            self.save(mngr, val_loss=losses["val"])

    def _interval_save_due(self):
        return self.c["checkpoint_interval"] and self.iter_num % self.c["checkpoint_interval"] == 0

    def _evaluates_next(self):
        """The loop's next turn begins with an eval of this step."""
        return self.iter_num % self.c["eval_interval"] == 0 or self.iter_num == self.c["max_iters"]

    def _log_unlogged(self, mngr):
        """The log line of the last log step, if not printed yet: the loop's only read of a step's metrics."""
        if self._unlogged is None:
            return
        it, metrics, first_nonfinite_so_far = self._unlogged
        self._unlogged = None
        self.check_finite(first_nonfinite=first_nonfinite_so_far)
        checkpoint.wait_saved(mngr)  # a save still in flight fails at this log line at the latest
        metrics = jax.device_get(metrics)  # waits for step `it`, not for the one dispatched after it
        done = it + 1
        dt = (time.time() - self._t0) / (done - self._last_log_iter)
        self._t0, self._last_log_iter = time.time(), done
        if self.peak_flops is not None and done > 5:  # the first steps include compilation
            step_mfu = self.flops_per_iter / dt / self.peak_flops
            self._mfu = step_mfu if self._mfu < 0 else 0.9 * self._mfu + 0.1 * step_mfu
        mfu = self._mfu if self._mfu >= 0 else None
        if self.master:
            print(f"iter {it}: loss {metrics['loss']:.4f}, time {dt * 1000:.2f}ms, "
                  f"tok/s {self.tokens_per_iter / dt:,.0f}, mfu {f'{mfu * 100:.2f}%' if mfu is not None else 'n/a'}")
        self.log({"iter": it, "loss": float(metrics["loss"]), "lr": float(metrics["lr"]),
                  "grad_norm": float(metrics["grad_norm"]), "ms": dt * 1000, "tok_per_s": self.tokens_per_iter / dt,
                  "mfu": mfu})


def sigint_as_sigterm(signum, frame):
    """Ctrl-C on one process of several: a preemption notice like SIGTERM, so that all stop at one step."""
    os.kill(os.getpid(), signal.SIGTERM)


def keep_freed_memory():
    """On a CPU, keep the memory XLA frees in the process. glibc hands a freed block of over 32 MB, and the top
    of its heap, back to the OS, so the step's one scratch buffer (43 MB for the baby model) came back as fresh
    pages every step, each faulted in and zeroed by the kernel: ~30 ms of system time in a ~65 ms step on 2
    cores (bench_train.py). Linux/glibc only; elsewhere, and on GPU/TPU, nothing changes."""
    if jax.default_backend() == "cpu" and platform.libc_ver()[0] == "glibc":
        libc = ctypes.CDLL(None)
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: trim the heap's top only past 1 GiB free
        libc.mallopt(-4, 0)  # M_MMAP_MAX: no block gets an mmap of its own (they are unmapped when freed)


def setup_distributed():
    """Several processes (hosts) -> one JAX runtime: explicit with JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES and JAX_PROCESS_ID; auto-detected on TPU pod slices, SLURM and Open MPI."""
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize(env["JAX_COORDINATOR_ADDRESS"], int(env["JAX_NUM_PROCESSES"]),
                                   int(env["JAX_PROCESS_ID"]))
    elif env.get("SLURM_NTASKS", "1") != "1" or env.get("OMPI_COMM_WORLD_SIZE", "1") != "1" \
            or "," in env.get("TPU_WORKER_HOSTNAMES", ""):
        jax.distributed.initialize()
    # a process killed or cut off ends the others within seconds, in one line each (JAX's own abort takes 100 s)
    watchdog.watch_processes()


def main(argv=None):
    config = configure(DEFAULTS, sys.argv[1:] if argv is None else argv)
    started = exit_on_interrupt("interrupted before the first step: nothing saved")
    # orbax logs a failed background save as a traceback from each of its threads (24 for a full disk); the
    # run reports that failure itself, in one line (checkpoint.check_saved)
    logging.getLogger("absl").addFilter(lambda record: record.levelno < logging.ERROR)
    checkpoint.use_compilation_cache()
    setup_distributed()
    sharding.start_backend()  # before anything starts it: libtpu's banner on a machine without a TPU is dropped
    keep_freed_memory()
    Trainer(config).run(started)


if __name__ == "__main__":
    exit_on_bad_input(main)
