"""
nanoGPT's training script in JAX. It runs on one CPU, one GPU, or every device of every host: the batch
is split over a 1-D device mesh (axis 'data'), params and optimizer state are replicated, and the
gradient average across devices is the all-reduce XLA inserts for the replicated update.

To run on a single machine (all its devices):
$ python train.py config/train_shakespeare_char.py
$ python train.py --batch_size=32 --dataset=shakespeare_char

To run on several hosts, start the same command on each host; jax.distributed.initialize() finds the
others on a TPU pod slice (gcloud ... tpu-vm ssh --worker=all --command="python train.py ..."), under SLURM
or Open MPI; elsewhere set JAX_COORDINATOR_ADDRESS=host0:1234 JAX_NUM_PROCESSES=N JAX_PROCESS_ID=i.
"""

import ctypes
import json
import math
import os
import pickle
import platform
import signal
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import checkpoint
from configurator import configure
from dataloader import make_loader
from model import GPT, RUNTIME_FIELDS, GPTConfig, mean_of

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
    init_from="scratch",  # 'scratch' | 'resume' | 'gpt2*' | an HF GPT-2 directory
    # wandb logging
    wandb_log=False,
    wandb_project="owt",
    wandb_run_name="gpt2",
    # data
    dataset="openwebtext",  # a folder under data/, or a path
    shuffle_shards=False,  # .npy shard datasets: visit the shards in a seeded order each epoch
    gradient_accumulation_steps=5 * 8,  # total micro-batches per step, over all devices
    total_batch_size=0,  # tokens per step; when > 0, gradient_accumulation_steps is derived from it
    batch_size=12,  # micro-batch size per device
    block_size=1024,
    # model
    n_layer=12,
    n_head=12,
    n_embd=768,
    vocab_size=0,  # 0: from data/<dataset>/meta.pkl, else GPT-2's 50257 padded to 50304
    dropout=0.0,  # for pretraining 0 is good, for finetuning try 0.1+
    bias=False,  # do we use bias inside LayerNorm and Linear layers?
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
    # system
    dtype="auto",  # 'float32' | 'bfloat16' | 'auto' (bfloat16 on GPU/TPU, float32 on CPU)
    attention="auto",  # 'xla' | 'cudnn' (fused flash attention: NVIDIA Ampere+, bf16) | 'auto' (cudnn where it runs)
    remat="none",  # recompute in the backward pass to save memory: 'none' | 'block' | 'dots' (keeps matmul outputs)
    loss_chunk=0,  # the loss's logits this many positions at a time (memory B x loss_chunk x vocab); 0: all at once
    seed=1337,
)


def get_lr(it, c):
    """nanoGPT's schedule: linear warmup, cosine decay to min_lr, then min_lr. Works on ints and tracers."""
    if not c["decay_lr"]:
        return jnp.asarray(c["learning_rate"], jnp.float32)
    it = jnp.asarray(it, jnp.float32)
    warmup = c["learning_rate"] * (it + 1) / (c["warmup_iters"] + 1)
    ratio = jnp.clip((it - c["warmup_iters"]) / max(c["lr_decay_iters"] - c["warmup_iters"], 1), 0.0, 1.0)
    coeff = 0.5 * (1.0 + jnp.cos(math.pi * ratio))  # coeff ranges 0..1
    cosine = c["min_lr"] + coeff * (c["learning_rate"] - c["min_lr"])
    return jnp.where(it < c["warmup_iters"], warmup, jnp.where(it > c["lr_decay_iters"], c["min_lr"], cosine))


def decay_mask(params):
    """nanoGPT's grouping: every >=2-D tensor decays (matmul weights and embeddings), biases and norms don't."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(c):
    return optax.adamw(learning_rate=partial(get_lr, c=c), b1=c["beta1"], b2=c["beta2"], eps=1e-8,
                       weight_decay=c["weight_decay"], mask=decay_mask)


def batch_loss(model, x, y, key=None):
    """The model's mean loss on a batch (B, T) (GPT.loss: the logits in chunks where loss_chunk says so). On a
    single CPU device the rows go through the model as two independent halves, which XLA:CPU's executor runs side
    by side on two cores: ~7% faster a step than one batch whose every op splits its work over the threads
    (bench_train.py). Same loss: one mean over both halves' targets; dropout draws a key per half."""
    if jax.default_backend() != "cpu" or jax.device_count() > 1 or x.shape[0] % 2:
        return model.loss(x, y, key=key)
    keys = jax.random.split(key) if key is not None else (None, None)
    halves = [model.loss_terms(model.hidden_states(rows, k)[1], targets)
              for rows, targets, k in zip(jnp.split(x, 2), jnp.split(y, 2), keys)]
    return mean_of(*(a + b for a, b in zip(*halves)))  # (total, count) of both halves


def make_train_step(graphdef, tx, grad_clip):
    """The one jitted step: scan over micro-batches (memory flat in their number), average the grads,
    clip by global norm as torch.nn.utils.clip_grad_norm_ does, apply AdamW. x, y: (accum, B, T)."""

    def loss_fn(params, x, y, key):
        return batch_loss(nnx.merge(graphdef, params), x, y, key)

    @partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, x, y, key):
        accum = x.shape[0]

        def micro_step(grad_sum, batch):
            x, y, key = batch
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y, key)
            return jax.tree.map(jnp.add, grad_sum, grads), loss

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, losses = jax.lax.scan(micro_step, zeros, (x, y, jax.random.split(key, accum)))
        # the loss is a mean over each micro-batch; the sum over micro-batches must become a mean too
        grads = jax.tree.map(lambda g: g / accum, grads)
        grad_norm = optax.tree.norm(grads)
        if grad_clip > 0.0:
            scale = jnp.minimum(1.0, grad_clip / (grad_norm + 1e-6))
            grads = jax.tree.map(lambda g: g * scale, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": jnp.mean(losses), "grad_norm": grad_norm}

    return train_step


def on_leaves(step, params, opt_state):
    """`step` over flat lists of arrays: (param leaves, opt leaves, x, y, key) -> the same, and metrics.
    jit flattens nnx Variables in Python, ~6 ms a call for the baby model's 158 (CPU time a 2-core machine
    takes from the step itself); lists of arrays cost ~1.7 ms."""
    param_def, opt_def = jax.tree.structure(params), jax.tree.structure(opt_state)

    @partial(jax.jit, donate_argnums=(0, 1))
    def leaves_step(params, opt_state, x, y, key):
        params, opt_state, metrics = step(param_def.unflatten(params), opt_def.unflatten(opt_state), x, y, key)
        return jax.tree.leaves(params), jax.tree.leaves(opt_state), metrics

    return leaves_step


def make_eval_step(graphdef, params):
    """Mean loss of one batch; takes the param leaves, as the train step does (see on_leaves)."""
    param_def = jax.tree.structure(params)

    @jax.jit
    def eval_step(param_leaves, x, y):
        return nnx.merge(graphdef, param_def.unflatten(param_leaves)).loss(x, y)

    return eval_step


def resolve_dtype(dtype):
    if dtype == "auto":
        return "float32" if jax.default_backend() == "cpu" else "bfloat16"
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {dtype!r}")
    return dtype


def data_dir_for(dataset):
    return dataset if os.path.isdir(dataset) and not os.path.isdir(os.path.join("data", dataset)) \
        else os.path.join("data", dataset)


class Trainer:
    """Everything a run holds, set up in __init__ (which validates all input before writing anything)
    and advanced by run()."""

    def __init__(self, config: dict):
        c = self.c = dict(config)
        c["dtype"] = resolve_dtype(c["dtype"])
        self.master = jax.process_index() == 0
        devices = jax.devices()
        # Auto axes: XLA propagates the batch sharding and inserts the gradient all-reduce
        self.mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
        self.replicated = NamedSharding(self.mesh, P())
        self.batch_sharding = NamedSharding(self.mesh, P(None, "data", None))
        if c["total_batch_size"] > 0:  # build-nanogpt: fixed tokens per step, whatever the device count
            per_step = c["batch_size"] * c["block_size"] * len(devices)
            if c["total_batch_size"] % per_step:
                raise ValueError(f"total_batch_size={c['total_batch_size']} is not a multiple of batch_size x "
                                 f"block_size x devices = {per_step}: change batch_size")
            c["gradient_accumulation_steps"] = c["total_batch_size"] // per_step * len(devices)
        if c["gradient_accumulation_steps"] % len(devices):
            raise ValueError(f"gradient_accumulation_steps={c['gradient_accumulation_steps']} must be divisible by "
                             f"the number of devices ({len(devices)})")
        self.accum = c["gradient_accumulation_steps"] // len(devices)
        self.rows = c["batch_size"] * len(devices)  # global micro-batch
        self.tokens_per_iter = self.accum * self.rows * c["block_size"]

        # data first: a missing dataset fails before anything is written
        self.data_dir = data_dir_for(c["dataset"])
        row_slice = self._process_rows((self.accum, self.rows, c["block_size"]))
        loader = partial(make_loader, self.data_dir, block_size=c["block_size"], rows=self.rows, seed=c["seed"],
                         row_slice=row_slice, shuffle_shards=c["shuffle_shards"])
        self.loaders = {"train": loader("train"), "val": loader("val")}
        self.iter_num, self.best_val_loss, self.last_saved = 0, float("inf"), None

        # model + optimizer state, from scratch, a checkpoint or GPT-2 weights
        tx = make_optimizer(c)
        meta = None
        if c["init_from"] == "scratch":
            model = GPT(self._model_config(), nnx.Rngs(c["seed"]))
        elif c["init_from"] == "resume":
            meta = checkpoint.restore(c["out_dir"])["meta"]
            model_config = checkpoint.model_config_from_meta(meta, **{k: c[k] for k in RUNTIME_FIELDS})
            model = nnx.eval_shape(lambda: GPT(model_config, nnx.Rngs(0)))
        else:
            model = GPT.from_pretrained(c["init_from"], **{k: c[k] for k in RUNTIME_FIELDS})
            if c["block_size"] < model.config.block_size:
                model.crop_block_size(c["block_size"])
        self.model_config = model.config
        if c["block_size"] > self.model_config.block_size:
            raise ValueError(f"block_size={c['block_size']} exceeds the model's {self.model_config.block_size}")
        graphdef, params = nnx.split(model)
        if meta is None:
            params = jax.device_put(params, self.replicated)
            opt_state = jax.jit(tx.init, out_shardings=self.replicated)(params)
        else:
            opt_template = jax.eval_shape(tx.init, params)
            restored = checkpoint.restore(c["out_dir"], params=params, opt_state=opt_template,
                                          sharding=self.replicated)
            params, opt_state = restored["params"], restored["opt_state"]
            self.iter_num, self.best_val_loss = meta["iter_num"], meta["best_val_loss"]
            self.last_saved = self.iter_num
            self.loaders["train"].load_state_dict(meta["loader"])
        self.graphdef = graphdef
        self._param_def, self._opt_def = jax.tree.structure(params), jax.tree.structure(opt_state)
        self._param_leaves, self._opt_leaves = jax.tree.leaves(params), jax.tree.leaves(opt_state)
        self.model = nnx.merge(graphdef, params)  # for num_params / estimate_mfu
        self.hellaswag_examples = self._load_hellaswag() if c["hellaswag_interval"] > 0 else None
        self.train_step = on_leaves(make_train_step(graphdef, tx, c["grad_clip"]), params, opt_state)
        self.eval_step = make_eval_step(graphdef, params)
        self.stop_requested = None

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
        meta_path = os.path.join(self.data_dir, "meta.pkl")
        if not vocab_size and os.path.exists(meta_path):
            with open(meta_path, "rb") as f:
                vocab_size = pickle.load(f)["vocab_size"]
            print(f"found vocab_size = {vocab_size} (inside {meta_path})")
        return GPTConfig(block_size=c["block_size"], vocab_size=vocab_size or 50304, n_layer=c["n_layer"],
                         n_head=c["n_head"], n_embd=c["n_embd"], bias=c["bias"], **{k: c[k] for k in RUNTIME_FIELDS})

    def _load_hellaswag(self):
        """At start-up, so that a missing file fails now rather than at step 5000."""
        import hellaswag

        path = self.c["hellaswag_path"]
        if not path:
            try:
                path = hellaswag.download("val")
            except OSError:
                raise OSError("could not download HellaSwag (offline?): set --hellaswag_path=FILE.jsonl "
                              "or --hellaswag_interval=0") from None
        elif not os.path.isfile(path):
            raise FileNotFoundError(f"hellaswag_path {path} does not exist")
        return hellaswag.load_examples(path, max_len=self.model_config.block_size)

    def eval_hellaswag(self):
        import hellaswag

        model = nnx.merge(self.graphdef, self.params)
        score = hellaswag.evaluate(model, self.hellaswag_examples, mesh=self.mesh)
        if self.master:
            print(f"step {self.iter_num}: hellaswag acc {score.acc:.4f}, acc_norm {score.acc_norm:.4f} "
                  f"({score.count} examples)")
        self.log({"iter": self.iter_num, "hellaswag_acc": score.acc, "hellaswag_acc_norm": score.acc_norm,
                  "hellaswag_count": score.count})

    def _process_rows(self, global_shape):
        """The rows of the global micro-batch that live on this process's devices (a contiguous range)."""
        index = self.batch_sharding.addressable_devices_indices_map(global_shape).values()
        lo = min(i[1].start or 0 for i in index)
        hi = max(i[1].stop or global_shape[1] for i in index)
        return slice(lo, hi)

    def _put(self, x, sharding):
        global_shape = x.shape[:-2] + (self.rows, x.shape[-1])
        return jax.make_array_from_process_local_data(sharding, x, global_shape)

    def estimate_loss(self):
        """Mean loss over eval_iters batches per split, each batch split over all devices."""
        sharding = NamedSharding(self.mesh, P("data", None))
        out = {}
        for split, loader in self.loaders.items():
            losses = [self.eval_step(self._param_leaves, self._put(x, sharding), self._put(y, sharding))
                      for x, y in loader.eval_batches(self.c["eval_iters"], self.iter_num)]
            out[split] = float(jnp.mean(jnp.stack(losses)))
        return out

    def log(self, record):
        if not self.master:
            return
        with open(os.path.join(self.c["out_dir"], "log.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "iter"}, step=record["iter"])

    def save(self, mngr):
        if self.last_saved == self.iter_num:  # e.g. the eval right after a resume
            return
        self.last_saved = self.iter_num
        meta = checkpoint.meta_for(self.model_config, self.c, self.iter_num, self.best_val_loss,
                                   self.loaders["train"].state_dict())
        checkpoint.save(mngr, self.iter_num, self.params, self.opt_state, meta)
        if self.master:
            print(f"saving checkpoint to {checkpoint.ckpt_dir(self.c['out_dir'])}/{self.iter_num}")

    def _request_stop(self, signum, frame):
        self.stop_requested = signal.Signals(signum).name

    def run(self):
        c = self.c
        if self.master:
            os.makedirs(c["out_dir"], exist_ok=True)
            n_dev, n_proc = jax.device_count(), jax.process_count()
            print(f"{n_dev} device(s) ({jax.devices()[0].device_kind}) on {n_proc} process(es); "
                  f"accumulation {self.accum} x micro-batch {self.rows} ({c['batch_size']} per device)")
            print(f"tokens per iteration will be: {self.tokens_per_iter:,}")
            print(f"number of parameters: {self.model.num_params() / 1e6:.2f}M; dtype {c['dtype']}")
        self.wandb = None
        if c["wandb_log"] and self.master:
            import wandb

            wandb.init(project=c["wandb_project"], name=c["wandb_run_name"], config=c)
            self.wandb = wandb
        self.log({"iter": self.iter_num, "event": "start", "dataset": c["dataset"], "config": c})
        mngr = checkpoint.manager(c["out_dir"], c["keep_checkpoints"])
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._request_stop)

        base_key = jax.random.key(c["seed"])
        t0, last_log_iter, mfu = time.time(), self.iter_num, -1.0
        while True:
            if self.iter_num % c["eval_interval"] == 0:
                losses = self.estimate_loss()
                if self.master:
                    print(f"step {self.iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
                self.log({"iter": self.iter_num, "train_loss": losses["train"], "val_loss": losses["val"],
                          "lr": float(get_lr(self.iter_num, c))})
                improved = losses["val"] < self.best_val_loss
                self.best_val_loss = min(self.best_val_loss, losses["val"])
                if self.iter_num > 0 and (improved or c["always_save_checkpoint"]):
                    self.save(mngr)
                t0, last_log_iter = time.time(), self.iter_num  # eval time is not step time
            if self.hellaswag_examples and (self.iter_num % c["hellaswag_interval"] == 0
                                            or self.iter_num == c["max_iters"]):
                self.eval_hellaswag()
                t0, last_log_iter = time.time(), self.iter_num
            if c["eval_only"]:
                break
            if self.iter_num >= c["max_iters"]:
                break

            x, y = self.loaders["train"].next(self.accum)
            key = jax.random.fold_in(base_key, self.iter_num)  # dropout: a function of (seed, iter), resumable
            self._param_leaves, self._opt_leaves, metrics = self.train_step(
                self._param_leaves, self._opt_leaves, self._put(x, self.batch_sharding),
                self._put(y, self.batch_sharding), key)
            self.iter_num += 1

            if self.iter_num % c["log_interval"] == 0 or self.iter_num == c["max_iters"]:
                loss = float(metrics["loss"])  # the only host sync in the loop
                dt = (time.time() - t0) / (self.iter_num - last_log_iter)
                t0, last_log_iter = time.time(), self.iter_num
                step_mfu = self.model.estimate_mfu(c["gradient_accumulation_steps"] * c["batch_size"], dt)
                if step_mfu is not None and self.iter_num > 5:  # the first steps include compilation
                    mfu = step_mfu if mfu < 0 else 0.9 * mfu + 0.1 * step_mfu
                lr = float(get_lr(self.iter_num - 1, c))
                if self.master:
                    print(f"iter {self.iter_num - 1}: loss {loss:.4f}, time {dt * 1000:.2f}ms, "
                          f"tok/s {self.tokens_per_iter / dt:,.0f}, mfu {f'{mfu * 100:.2f}%' if mfu >= 0 else 'n/a'}")
                self.log({"iter": self.iter_num - 1, "loss": loss, "lr": lr, "grad_norm": float(metrics["grad_norm"]),
                          "ms": dt * 1000, "tok_per_s": self.tokens_per_iter / dt,
                          "mfu": mfu if mfu >= 0 else None})
            if c["checkpoint_interval"] and self.iter_num % c["checkpoint_interval"] == 0:
                self.save(mngr)
            if self.stop_requested:
                self.save(mngr)
                mngr.wait_until_finished()
                if self.master:
                    print(f"{self.stop_requested}: checkpoint saved at iter {self.iter_num}; "
                          f"resume with --init_from=resume --out_dir={c['out_dir']}")
                break
        mngr.wait_until_finished()
        mngr.close()
        return self


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


def main(argv=None):
    config = configure(DEFAULTS, sys.argv[1:] if argv is None else argv)
    setup_distributed()
    keep_freed_memory()
    Trainer(config).run()


if __name__ == "__main__":
    from parity.common import exit_on_bad_input

    exit_on_bad_input(main)
