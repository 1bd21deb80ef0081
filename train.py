"""
nanoGPT's training script in JAX. It runs on one CPU, one GPU, or every device of every host, on the
mesh ('data', 'fsdp', 'tensor') of compute/sharding.py: the batch is split over data x fsdp; params,
gradients and optimizer state over fsdp (ZeRO-3) and tensor (Megatron), replicated over data. XLA
inserts the collectives.

To run on a single machine (all its devices):
$ python train.py config/train_shakespeare_char.py
$ python train.py --batch_size=32 --dataset=shakespeare_char
# gpt2-xl, params/grads/Adam split 8 ways
$ python train.py config/finetune_shakespeare.py --fsdp=8

To run on several hosts, start the same command on each host; jax.distributed.initialize() finds the
others on a TPU pod slice (gcloud ... tpu-vm ssh --worker=all --command="python train.py ..."),
under SLURM or Open MPI; elsewhere set JAX_COORDINATOR_ADDRESS=host0:1234 JAX_NUM_PROCESSES=N
JAX_PROCESS_ID=i.
"""

import collections
import gc
import sys
import time
from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

import hellaswag
from archs import models
from compute import sharding
from configurator import command_line_keys, configure, exit_on_bad_input
from dataio import hellaswag_data
from dataio.dataloader import data_dir_for, data_meta, val_batches_for
from dataio.prefetch import Prefetcher
from model import RUNTIME_FIELDS
from run import auto_settings, checkpoint, runlog, train_setup
from run.settings import (
    DEFAULTS,
    accumulation_steps,
    profile_range,
    resolve_dtype,
    resolve_scan_layers,
    validate,
)
from run.train_step import (
    all_finite,
    bits_per_byte,
    first_nonfinite,
    init_state,
    lr_of,
    make_eval_step,
    make_optimizer,
)

# steps the loop dispatches ahead of the one the device runs: one keeps the device busy while the
# host reads the next batch, and a stop (SIGTERM: ~30 s of notice on a spot VM) waits for that one
STEPS_AHEAD = 1


class Trainer:
    """Everything a run holds, set up in __init__ (which validates all input before writing
    anything) and advanced by run(). `typed`: the settings typed on the command line
    (configurator.command_line_keys), which a resume names where the checkpoint overrides them."""

    def __init__(self, config: dict, typed=()):
        validate(config)
        c = self.c = dict(config)
        self.settings = dict(config)  # as given: what was 'auto' (auto_settings.line)
        self.master = jax.process_index() == 0
        self.mesh = sharding.make_mesh(c["fsdp"], c["tensor_parallel"])
        # before anything reads out_dir: a resume reads what process 0 wrote
        if jax.process_count() > 1:
            runlog.check_shared(c["out_dir"], self.master)
        platform = sharding.platform_of(self.mesh)  # the program's, not the host's
        c["dtype"] = resolve_dtype(c["dtype"], platform)
        c["scan_layers"] = resolve_scan_layers(c["scan_layers"], platform, c["arch"])
        # the model's shape (and on resume the block_size), from the settings, the checkpoint's
        # meta (read once) or the weights' files; then the batches and the data (a missing or bad
        # dataset fails before anything is written)
        self.data_dir = data_dir_for(c["dataset"])
        train_setup.take_from_start(c, self.data_dir, typed)
        data_vocab_size, self.vocab = data_meta(self.data_dir, c["tokenizer"])
        train_setup.dial(c, data_vocab_size, self.mesh, self.master)  # nanochat's depth
        # until compiled
        runtime = {**{k: c[k] for k in RUNTIME_FIELDS}, **auto_settings.first_candidate(c)}
        start = train_setup.start_for(
            c, runtime, data_vocab_size, self.data_dir, self.master, typed
        )
        self.batch_sharding = sharding.batch_sharding(self.mesh)
        # data x fsdp: the devices of a tensor group share rows
        shards = sharding.batch_shards(self.mesh)
        self.accum = accumulation_steps(c, shards)  # micro-batches per step on each batch shard
        self.rows = c["batch_size"] * shards  # global micro-batch
        self.tokens_per_iter = self.accum * self.rows * c["block_size"]
        # val batches per eval: the record's fixed val_tokens from the val shards' start, else
        # eval_iters
        self.eval_batches = {
            "train": c["eval_iters"],
            "val": val_batches_for(c["val_tokens"], self.rows, c["block_size"]) or c["eval_iters"],
        }
        model_config, self.mngr = start.model_config, start.mngr
        self.iter_num, self.best_val_loss = start.iter_num, start.best_val_loss
        self.last_saved = self.iter_num if start.meta is not None else None
        if start.meta is not None:
            self.vocab = start.meta.get("vocab", self.vocab)
        self.model_config = (
            replace(model_config, block_size=c["block_size"]) if start.weights else model_config
        )
        sharding.check_model_fits_mesh(self.model_config, self.mesh)
        models.check_run(self.model_config, self.mesh.devices.flat[0])
        self.loaders, self.train_loader = train_setup.make_loaders(
            c,
            self.data_dir,
            self.batch_sharding,
            self.accum,
            self.rows,
            self.model_config.vocab_size,
            data_vocab_size,
        )
        self.progress = None  # lr_schedule='sft': each step's progress through the conversations
        if c["lr_schedule"] == "sft":
            self.progress = train_setup.sft_horizon(c, self.train_loader, self.accum, self.master)
        if start.meta is not None:
            self.train_loader.load_state_dict(start.meta["loader"])
        train_setup.check_one_run(c)
        hellaswag_file = None
        if c["hellaswag_interval"] > 0:
            hellaswag_file = train_setup.hellaswag_path(c, self.vocab, self.data_dir, self.master)

        # out_dir is made and locked before the model is built, so that a second run on it is
        # refused at once
        start_over = (checkpoint.CKPT_SUBDIR, runlog.LOG_FILE) if c["start_over"] else ()
        self.lock = runlog.claim_out_dir(c["out_dir"], start_over) if self.master else None
        try:
            self._build(model_config, start.weights, start.meta, hellaswag_file)
        # a failed start leaves out_dir to the next run (in this process too: a notebook's)
        except BaseException:
            if self.lock is not None:
                self.lock.close()
            raise

    def _build(self, model_config, pretrained, meta, hellaswag_file):
        """The model, optimizer state and compiled steps, in out_dir's lock."""
        c = self.c
        tx = make_optimizer(c, self.progress)
        self.graphdef, params, opt_state = init_state(
            model_config,
            self.mesh,
            tx,
            seed=c["seed"],
            weights=pretrained,
            block_size=c["block_size"],
            restore=None if meta is None else (c["out_dir"], meta, self.mngr),
        )
        self._param_def, self._opt_def = jax.tree.structure(params), jax.tree.structure(opt_state)
        self._param_leaves, self._opt_leaves = jax.tree.leaves(params), jax.tree.leaves(opt_state)
        self.hellaswag_examples = None
        if hellaswag_file:
            self.hellaswag_examples = hellaswag_data.load_examples(
                hellaswag_file, max_len=self.model_config.block_size
            )
        self.train_step = self._compile_step(tx, params, opt_state)
        token_bytes = getattr(self.train_loader, "token_bytes", None)  # a nanochat tokenizer's
        self.eval_step = make_eval_step(self.graphdef, params, token_bytes)
        flops_per_iter = nnx.merge(self.graphdef, params).flops_per_token() * self.tokens_per_iter
        self.out = runlog.RunLog(
            c,
            self.master,
            self.tokens_per_iter,
            flops_per_iter,
            list(self.mesh.devices.flat),
            profile_range(c["profile"]),
        )
        self._first_nonfinite = jax.device_put(jnp.int32(-1), sharding.replicated(self.mesh))
        self.batches = None  # the Prefetcher, while run() runs
        # a log step's (iter, metrics, first non-finite iter so far), read one step late
        self._unlogged = None

    # the loop holds params and optimizer state as lists of arrays (see on_leaves)
    @property
    def params(self):
        return self._param_def.unflatten(self._param_leaves)

    @property
    def opt_state(self):
        return self._opt_def.unflatten(self._opt_leaves)

    def eval_hellaswag(self):
        model = nnx.merge(self.graphdef, self.params)
        self.out.hellaswag(
            self.iter_num, hellaswag.evaluate(model, self.hellaswag_examples, self.mesh)
        )

    def _compile_step(self, tx, params, opt_state):
        """The jitted step, compiled now (not at step 0) so that its memory is known before anything
        runs: remat and loss_chunk 'auto' take the least recompute that fits (auto_settings);
        `memory per device` is printed, logged, and checked against the device's limit. Sets the
        graphdef and model config of the settings compiled."""
        c = self.c
        fit, self.auto_line = auto_settings.compile_train_step(
            self.graphdef,
            params,
            opt_state,
            tx,
            (self.accum, self.rows, c["block_size"]),
            self.batch_sharding,
            self.settings,
            c["grad_clip"],
            lr_schedule=lr_of(c, self.progress),
            **models.arch_of(c["arch"]).step_inputs(c, self.accum * c["batch_size"]),
        )
        self.state_bytes, self.step_peak_bytes = fit.state_bytes, fit.peak
        fit.check()
        self.graphdef, self.model_config = fit.graphdef, fit.config
        c["remat"], c["loss_chunk"] = fit.config.remat, fit.config.loss_chunk
        return fit.step

    def _put(self, x, sharding):
        global_shape = x.shape[:-2] + (self.rows, x.shape[-1])
        return jax.make_array_from_process_local_data(sharding, x, global_shape)

    def estimate_loss(self):
        """Mean loss over eval_iters batches per split (val: val_tokens' worth, where set), each
        batch split over all devices; None when a stop came meanwhile."""
        rows = sharding.batch_sharding(self.mesh, ndim=2)
        out, began, batches = {}, time.time(), sum(self.eval_batches.values())
        inputs = models.arch_of(self.c["arch"]).eval_inputs(self.iter_num, self.c)
        for split, loader in self.loaders.items():
            losses = []
            # the model's sharding constraints apply when the eval step is traced
            with jax.set_mesh(self.mesh):
                for x, y in loader.eval_batches(self.eval_batches[split], self.iter_num):
                    x, y = self._put(x, rows), self._put(y, rows)
                    losses.append(self.eval_step(self._param_leaves, x, y, inputs))
                    self.out.eval_ran(losses, batches, began)
                    # as the steps: one batch ahead of the device, so that a stop ends the eval
                    if len(losses) > STEPS_AHEAD:
                        losses[-1 - STEPS_AHEAD].block_until_ready()
                    if self.stops.requested:
                        return None
            if losses[0].ndim:  # [loss, nats, bytes]: bits per byte too
                out[split], out[f"{split}_bpb"] = bits_per_byte(losses)
            else:
                out[split] = float(jnp.mean(jnp.stack(losses)))
        return out

    def check_finite(self, params=False, first_nonfinite=None):
        """Stop at the first non-finite step, before any checkpoint of it: reads one scalar (at log
        steps, saves and the end; `first_nonfinite`: that scalar as of an earlier step); `params`:
        also the params, whose last update may overflow where its loss did not."""
        bad = int(self._first_nonfinite if first_nonfinite is None else first_nonfinite)
        if bad < 0 and params and not all_finite(self._param_leaves):
            bad = self.iter_num - 1
        if bad >= 0:
            raise train_setup.diverged(bad, self.c["out_dir"], self.last_saved)

    def save(self, val_loss=None):
        """A checkpoint of this step. `val_loss`: that of the eval of this step, with which rotation
        keeps the best checkpoint (checkpoint.manager); None for a save without an eval
        (checkpoint_interval, a stop)."""
        if self.last_saved == self.iter_num:  # e.g. the eval right after a resume
            return
        self.check_finite(params=True)
        self.last_saved = self.iter_num
        loader_state = (
            self.batches.state if self.batches is not None else self.train_loader.state_dict()
        )
        meta = checkpoint.meta_for(
            self.model_config, self.c, self.iter_num, self.best_val_loss, loader_state
        )
        meta["vocab"] = self.vocab  # what decodes its ids, wherever sample.py runs
        checkpoint.save(self.mngr, self.iter_num, self.params, self.opt_state, meta, val_loss)
        self.out.intact = f"checkpoint {self.iter_num} in {checkpoint.ckpt_dir(self.c['out_dir'])}"
        # the log as far as this checkpoint (on an object store, it is rewritten now)
        self.out.flush()
        self.out.print(
            f"saving checkpoint to {checkpoint.ckpt_dir(self.c['out_dir'])}/{self.iter_num}"
        )

    def run(self, started=None):
        """The loop, to max_iters or a stop, as nanoGPT's: an eval (and a save) every
        eval_interval, then a step, a log line every log_interval. Each step is dispatched before
        the device has run the previous one, and no further (STEPS_AHEAD): the host waits for that
        one, reads a log line's metrics one step late, and waits for evals and saves; it reads
        nothing else of the device.
        `started()` is called as the first step begins (train.main: Ctrl-C until then ends the
        process at once, from then on it saves)."""
        c, out = self.c, self.out
        try:
            self.announce()
            # the run's one checkpoint manager: a resume's, which read its checkpoint, else a new
            # one (makes ckpt/)
            self.mngr = self.mngr or checkpoint.manager(c["out_dir"], c["keep_checkpoints"])
            if started is not None:
                started()
            # from the first step on, SIGINT and SIGTERM save and stop
            self.stops = train_setup.Stops()
            # the start-up's objects (modules, traced programs) left out of the loop's garbage
            # collections: a full one over them pauses the host (on an H200 one log line of 16
            # read 1,455 ms and the next 525 for ~990 ms steps)
            gc.freeze()
            self.batches = Prefetcher(
                self.train_loader, self.accum, partial(self._put, sharding=self.batch_sharding)
            )
            base_key = jax.random.key(c["seed"])
            in_flight = collections.deque()  # a value of each step the device may not have run
            out.clock.start(self.iter_num)
            try:
                while True:
                    last_step = self.iter_num == c["max_iters"]
                    # eval_only: at any step
                    if self.iter_num % c["eval_interval"] == 0 or last_step or c["eval_only"]:
                        self._log_unlogged()
                        self.evaluate(last_step, save=not c["eval_only"])
                        out.clock.start(self.iter_num)  # eval time is not step time
                    if self.hellaswag_examples and (
                        self.iter_num % c["hellaswag_interval"] == 0 or last_step
                    ):
                        self._log_unlogged()
                        self.eval_hellaswag()
                        out.clock.start(self.iter_num)
                    if c["eval_only"] or self.iter_num >= c["max_iters"]:
                        self._log_unlogged()
                        break

                    if self.iter_num == out.profile[0]:
                        self._log_unlogged()  # the trace holds the steps alone
                        out.start_profile()
                    x, y = self.batches.next()
                    # dropout: a function of (seed, iter), resumable
                    key = jax.random.fold_in(base_key, self.iter_num)
                    self._param_leaves, self._opt_leaves, metrics = self.train_step(
                        self._param_leaves, self._opt_leaves, x, y, key
                    )
                    self._first_nonfinite = first_nonfinite(
                        self._first_nonfinite, self.iter_num, metrics["finite"]
                    )
                    self.iter_num += 1
                    # the host at most STEPS_AHEAD steps ahead of the device: a stop waits for
                    # those alone, and the next step is queued while this one runs
                    in_flight.append(metrics["finite"])
                    if len(in_flight) > STEPS_AHEAD:
                        in_flight.popleft().block_until_ready()
                        out.step_ran(self.iter_num - 1 - STEPS_AHEAD)
                    # a failed save stops the run before the next step
                    checkpoint.check_saved(self.mngr)
                    self._log_unlogged()  # the previous log step's, while this step runs
                    if self.iter_num == out.profile[1]:
                        out.stop_profile(self.iter_num - 1, metrics)
                    if self.iter_num % c["log_interval"] == 0 or self.iter_num == c["max_iters"]:
                        self._unlogged = (self.iter_num - 1, metrics, self._first_nonfinite)
                        out.clock.watch(self.iter_num - 1, metrics)
                    # a step evaluated next is saved by its eval, with its val loss (for rotation
                    # to keep the best)
                    if self._interval_save_due() and not self._evaluates_next():
                        self._log_unlogged()
                        self.save()
                    stop = self.stops.agreed(self.iter_num)
                    if stop:
                        self._log_unlogged()
                        self.save()
                        checkpoint.wait_saved(self.mngr)
                        # every process: each host's own log
                        print(
                            f"{stop}: checkpoint saved at iter {self.iter_num}; "
                            f"resume with --init_from=resume --out_dir={c['out_dir']}"
                        )
                        break
            finally:
                gc.unfreeze()  # collectable again once the loop is done (a notebook's next run)
                self.batches.close()
                out.stop_profile(self.iter_num - 1)
            checkpoint.wait_saved(self.mngr)
            self.mngr.close()
            out.flush()
            return self
        finally:
            if self.lock is not None:
                self.lock.close()

    def announce(self):
        """The start-up lines (runlog.startup_lines), wandb, and the log's first record."""
        n_params = nnx.merge(self.graphdef, self.params).num_params()
        memory = (self.state_bytes, self.step_peak_bytes)
        lines = runlog.startup_lines(
            self.c,
            self.mesh,
            (self.accum, self.rows),
            self.auto_line,
            n_params,
            self.model_config,
            memory,
        )
        resumed = self.last_saved is not None
        self.out.start(self.c, lines, self.iter_num, resumed, memory, self.auto_line)

    def evaluate(self, last_step, save=True):
        """Train and val loss, logged; with `save`, a checkpoint when val improved (or
        always_save_checkpoint, or at the end). eval_only never saves: it evaluates a checkpoint
        that is already there."""
        c = self.c
        self.check_finite()  # no eval of a diverged run
        began = time.time()
        losses = self.estimate_loss()
        if losses is None:  # a stop came: the loop's next step saves and exits
            return
        lr = float(lr_of(c, self.progress)(self.iter_num))
        self.out.eval_line(self.iter_num, losses, lr, time.time() - began)
        improved = losses["val"] < self.best_val_loss
        self.best_val_loss = min(self.best_val_loss, losses["val"])
        if (
            save
            and self.iter_num > 0
            and (improved or c["always_save_checkpoint"] or last_step or self._interval_save_due())
        ):
            self.save(val_loss=losses["val"])

    def _interval_save_due(self):
        return self.c["checkpoint_interval"] and self.iter_num % self.c["checkpoint_interval"] == 0

    def _evaluates_next(self):
        """The loop's next turn begins with an eval of this step."""
        return self.iter_num % self.c["eval_interval"] == 0 or self.iter_num == self.c["max_iters"]

    def _log_unlogged(self):
        """The log line of the last log step, if not printed yet: the loop's only read of a step's
        metrics."""
        if self._unlogged is None:
            return
        it, metrics, first_nonfinite_so_far = self._unlogged
        self._unlogged = None
        self.check_finite(first_nonfinite=first_nonfinite_so_far)
        # a save still in flight fails at this log line at the latest
        checkpoint.wait_saved(self.mngr)
        # waits for step `it`, not for the one dispatched after it
        self.out.step(it, jax.device_get(metrics))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    config = configure(DEFAULTS, argv)
    started = train_setup.prepare_process()
    Trainer(config, typed=command_line_keys(argv)).run(started)


if __name__ == "__main__":
    exit_on_bad_input(main)
