"""
A run's I/O besides its checkpoints (seqax's training_io.py): the out_dir claimed (its lock is
run/run_lock.py's), log.jsonl, the lines on stdout, wandb, the profiler window, and MFU. Writing
fails in one line: a full disk stops the run (RunStopped, exit 1), a path the OS refuses is the
user's to fix (UsageError, exit 2).
"""

import errno
import json
import os
import secrets
import time

import jax

from compute import sharding
from configurator import RunStopped, UsageError
from dataio import storage
from run import run_lock
from run.step_clock import StepClock, duration, mfu

LOG_FILE = "log.jsonl"
# process 0 writes it at start; every process must read it back (check_shared)
SHARED_MARKER = "hosts.check"
# log.jsonl on an object store: rewritten whole at most this often, and at every save
LOG_FLUSH_S = 15


def startup_lines(c, mesh, accum_rows, auto_line, n_params, model_config, memory):
    """train.py's start-up lines, nanoGPT's and more: the devices, the batch and tokens per
    iteration, what each 'auto' setting became, the parameters, optimizer and schedule, the mesh,
    and memory per device (the state's, and the compiled step's peak: `memory`, in bytes)."""
    accum, rows = accum_rows
    lines = [
        f"{jax.device_count()} device(s) ({jax.devices()[0].device_kind}) on "
        f"{jax.process_count()} process(es); accumulation {accum} x micro-batch {rows} "
        f"({c['batch_size']} per batch shard)\ntokens per iteration will be: "
        f"{accum * rows * c['block_size']:,}"
    ]
    if auto_line:
        lines.append(auto_line)
    if c["attention"] == "splash" and sharding.platform_of(mesh) != "tpu":
        lines.append(
            "attention='splash' off a TPU: the same kernel in Pallas interpret mode (slow: for "
            "tests)"
        )
    optimizer = (
        f"Muon (lr {c['muon_learning_rate']:g}) on the blocks' matrices, Adam (lr "
        f"{c['learning_rate']:g}) on the rest"
        if c["optimizer"] == "muon"
        else f"Muon (lr {c['muon_learning_rate']:g}) on the blocks' matrices, Adam on the head "
        f"(lr {c['learning_rate']:g}), embeddings ({c['embed_learning_rate']:g}) and scalars "
        f"({c['scalar_learning_rate']:g})"
        if c["optimizer"] == "muon20"
        else f"nanochat's MuonAdamW: Muon (lr {c['muon_learning_rate']:g}) on the blocks' "
        f"matrices, AdamW on the head (lr {c['learning_rate']:g}), embeddings "
        f"({c['embed_learning_rate']:g}) and scalars ({c['scalar_learning_rate']:g}), before "
        "1/sqrt(n_embd/768)"
        if c["optimizer"] == "muonadamw"
        else f"AdamW (lr {c['learning_rate']:g})"
    )
    lines.append(
        f"number of parameters: {n_params / 1e6:.2f}M (arch {model_config.arch}); dtype "
        f"{c['dtype']}{tables(c)}; {optimizer}, {c['lr_schedule']} schedule{fp8_head(c)}\n"
        f"mesh: data {mesh.shape['data']} x fsdp {mesh.shape['fsdp']} x tensor "
        f"{mesh.shape['tensor']}; memory per device: state {memory[0] / 2**30:.2f} GiB, step peak "
        f"{memory[1] / 2**30:.2f} GiB"
    )
    return lines


def tables(c):
    """Record 20's embedding tables in the start-up line, where they are bf16 (embed_dtype)."""
    return ", embedding tables bfloat16" if c.get("embed_dtype") == "bfloat16" else ""


def fp8_head(c):
    """How the start-up line names the FP8 head (layers.fp8_head), where it is on."""
    if not c.get("fp8_head"):
        return ""
    return "; FP8 head in training (the record's e4m3/e5m2 rounding, multiplied in bf16)"


class RunLog:
    """What a run says as it goes: lines on stdout (process 0), records in out_dir/log.jsonl and
    wandb, each log step's line with its time, tokens/s and MFU, and a jax.profiler trace of the
    iterations `profile` names."""

    def __init__(self, c, master, tokens_per_iter, flops_per_iter, devices, profile=None):
        self.path, self.master = storage.join(c["out_dir"], LOG_FILE), master
        self.tokens_per_iter, self.flops_per_iter, self.devices = (
            tokens_per_iter,
            flops_per_iter,
            devices,
        )
        self.intact = None  # the last checkpoint, in words, for the line of a failed write
        self.wandb = None
        self.profile, self.profile_dir = profile or (-1, -1), storage.join(c["out_dir"], "profile")
        self.log = (ObjectLog(self.path) if storage.is_url(self.path) else None) if master else None
        self.profiling = False
        self.mfu = None  # a running average, once past the first steps (compilation)
        self.clock = StepClock(c["max_iters"], c["eval_interval"])

    def start(self, c, lines, it, resumed, memory, auto_line):
        """The run's start at iteration `it`: its start-up `lines` (startup_lines), wandb, and the
        log's first record (`memory`: the state's and the step's peak bytes per device)."""
        for line in lines:
            self.print(line)
        if c["wandb_log"] and self.master:
            import wandb  # optional: imported only when asked for

            wandb.init(project=c["wandb_project"], name=c["wandb_run_name"], config=c)
            self.wandb = wandb
        self.record(
            {
                "iter": it,
                "event": "resume" if resumed else "start",
                "dataset": c["dataset"],
                "config": c,
                "state_bytes_per_device": memory[0],
                "step_peak_bytes_per_device": memory[1],
                "auto_settings": auto_line,
            }
        )

    def print(self, *args):
        if self.master:
            print(*args)

    def record(self, record):
        if not self.master:
            return
        try:
            self.log.append(json.dumps(record)) if self.log is not None else append_line(
                self.path, json.dumps(record)
            )
        except OSError as e:
            raise write_failed(self.path, e, self.intact) from None
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "iter"}, step=record["iter"])

    def flush(self):
        """The records so far into the log, now (at a save: a resume finds the log as far as its
        checkpoint)."""
        if self.log is not None:
            self.log.flush()

    def eval_line(self, it, losses, lr, seconds):
        """An eval's line and record; its `seconds` count in the eta, for each eval to come."""
        self.clock.eval_s = seconds
        bpb = f", val bpb {losses['val_bpb']:.4f}" if "val_bpb" in losses else ""
        self.print(
            f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}{bpb}"
        )
        bpbs = {f"{k}_bpb": losses[f"{k}_bpb"] for k in ("train", "val") if f"{k}_bpb" in losses}
        self.record(
            {"iter": it, "train_loss": losses["train"], "val_loss": losses["val"], "lr": lr, **bpbs}
        )

    def step_ran(self, it):
        """Step `it` has run (the loop waited for it): three steps in, once, a line when the run as
        configured will take very long here."""
        line = self.clock.first_estimate(it)
        if line:
            self.print(line)

    def eval_ran(self, losses, batches, began):
        """An eval's batches so far (`losses`, of `batches`, begun at time `began`): at the run's
        first eval's second batch, once, a line when the eval will take very long here."""
        if len(losses) == 2 and not self.clock.eval_said:
            jax.block_until_ready(losses)
            line = self.clock.first_eval_estimate(2, batches, time.time() - began)
            if line:
                self.print(line)

    def hellaswag(self, it, score):
        """HellaSwag's score (hellaswag.Score) of step `it`: a line and a record."""
        self.print(
            f"step {it}: hellaswag acc {score.acc:.4f}, acc_norm {score.acc_norm:.4f} "
            f"({score.count} examples)"
        )
        self.record(
            {
                "iter": it,
                "hellaswag_acc": score.acc,
                "hellaswag_acc_norm": score.acc_norm,
                "hellaswag_count": score.count,
            }
        )

    def step(self, it, metrics):
        """Log step `it` (its metrics read back to the host): one line, one record. Its time: the
        clock's lap (step_clock.StepClock.lap)."""
        done = it + 1
        dt = self.clock.lap(it)
        step_mfu = mfu(self.flops_per_iter, dt, self.devices)
        if step_mfu is not None and done > 5:  # the first steps include compilation
            self.mfu = step_mfu if self.mfu is None else 0.9 * self.mfu + 0.1 * step_mfu
        shown = f"{self.mfu * 100:.2f}%" if self.mfu is not None else "n/a"
        self.print(
            f"iter {it}: loss {metrics['loss']:.4f}, time {dt * 1000:.2f}ms, "
            f"tok/s {self.tokens_per_iter / dt:,.0f}, mfu {shown}, "
            f"eta {duration(self.clock.eta(done))}"
        )
        self.record(
            {
                "iter": it,
                "loss": float(metrics["loss"]),
                "lr": float(metrics["lr"]),
                "grad_norm": float(metrics["grad_norm"]),
                "ms": dt * 1000,
                "tok_per_s": self.tokens_per_iter / dt,
                "mfu": self.mfu,
            }
        )

    def start_profile(self):
        jax.profiler.start_trace(self.profile_dir, create_perfetto_trace=True)
        self.profiling = True

    def stop_profile(self, last_iter, metrics=None):
        """Ends a trace begun at profile's START: after the last traced step has run (`metrics`: its
        outputs)."""
        if not self.profiling:
            return
        jax.block_until_ready(metrics)
        jax.profiler.stop_trace()
        self.profiling = False
        self.print(
            f"profile of iterations {self.profile[0]}..{last_iter} written to {self.profile_dir}: "
            f"tensorboard --logdir={self.profile_dir} (profile plugin), or its "
            "perfetto_trace.json.gz in ui.perfetto.dev"
        )


def nearest_existing(path):
    """`path`, or the closest of its parents that exists: where creating it would begin."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return existing


def check_out_dir(out_dir):
    """out_dir must be a directory, or creatable as one by this user: checked before anything is
    written. A URL: credentials, the bucket and this account's access to it
    (storage.check_reachable)."""
    if storage.is_url(out_dir):
        return storage.check_reachable(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UsageError(f"out_dir {out_dir} is a file: give a directory")
    # makedirs would say only "File exists"
    if os.path.islink(out_dir) and not os.path.exists(out_dir):
        raise UsageError(
            f"out_dir {out_dir} is a link to {os.readlink(out_dir)}, which does not exist: create "
            "it, or give another --out_dir"
        )
    existing = nearest_existing(out_dir)
    if not os.path.isdir(existing):
        raise UsageError(f"out_dir {out_dir} cannot be created: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(
            f"out_dir {out_dir} cannot be written: {existing} is not writable by this user"
        )


def check_results_file(path, flag):
    """A file a script writes its results to when its work is done (eval.py --output, hellaswag.py
    --out): checked before the work starts, so that hours of evaluation never end in an unwritable
    path."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{flag}={path} is a directory: give a file's path")
    if not os.path.isdir(directory):
        raise UsageError(
            f"{flag}={path}: its directory {directory} does not exist: create it, or give another "
            "path"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UsageError(
            f"{flag}={path} cannot be written: {directory} is not writable by this user"
        )


def write_results(path, text, flag):
    """`text` to `path` whole or not at all (a temporary file, then renamed over it). A write that
    fails all the same is one line; the caller has printed the results first, so nothing is lost."""
    try:
        storage.write_bytes(path, text.encode())
    except OSError as e:
        raise UsageError(
            f"{flag}={path} could not be written ({e.strerror or e}); the results are printed above"
        ) from None


def write_failed(path, error, intact=None):
    """An OSError writing the run's own files, as one line: a full disk or quota stops the run
    (RunStopped); anything else (a path the OS refuses, /proc/x) is the user's to fix (UsageError).
    `intact`: the last checkpoint, in words ('checkpoint 20 in out/ckpt'), or None."""
    reason = error.strerror or str(error)
    if error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return UsageError(f"cannot write {path} ({reason}): give another --out_dir")
    kept = f"{intact} is intact" if intact else "nothing was saved"
    return RunStopped(
        f"cannot write {path} ({reason}): the run stopped, {kept}; free space and "
        f"{'resume with --init_from=resume' if intact else 'run again'}"
    )


def claim_out_dir(out_dir, move_aside=()):
    """out_dir made and locked for this run (returns the open lock file: closing it releases the
    lock); the entries `move_aside` names (a start over: the previous run's checkpoints and log)
    moved to out_dir/previous-<time>-<pid>/, never mixed with this run's; a log line cut by a crash
    dropped."""
    try:
        storage.makedirs(out_dir)
        lock = (
            run_lock.ObjectLock(out_dir)
            if storage.is_url(out_dir)
            else run_lock.lock_out_dir(out_dir)
        )
    except OSError as e:
        raise write_failed(e.filename or out_dir, e) from None
    old = [p for p in move_aside if storage.exists(storage.join(out_dir, p))]
    if old:
        aside = storage.join(out_dir, f"previous-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        storage.makedirs(aside)
        for p in old:
            storage.move(storage.join(out_dir, p), storage.join(aside, p))
        print(f"start_over: the previous run's {' and '.join(old)} moved to {aside}")
    if not storage.is_url(out_dir):  # an object is never cut: it is written whole
        drop_partial_line(os.path.join(out_dir, LOG_FILE))
    return lock


def check_shared(out_dir, master):
    """A run of several processes needs one out_dir that every process reads and writes (each writes
    its shards of a checkpoint; a resume reads what process 0 wrote): process 0 writes a marker of
    this start, every process reads it back, and if one does not (each host's own disk), every
    process stops with one line."""
    from jax.experimental import multihost_utils

    nonce = int(multihost_utils.broadcast_one_to_all(secrets.randbits(31)))
    marker = storage.join(out_dir, SHARED_MARKER)
    if master:
        try:
            storage.makedirs(out_dir)
            storage.write_bytes(marker, str(nonce).encode())
        except OSError as e:
            raise write_failed(marker, e) from None
    multihost_utils.sync_global_devices("out_dir marker written")
    try:
        seen = storage.read_bytes(marker) == str(nonce).encode()
    except OSError:
        seen = False
    seen_by = multihost_utils.process_allgather(seen)
    if not all(seen_by):
        blind = [str(i) for i, ok in enumerate(seen_by) if not ok]
        raise UsageError(
            f"out_dir {out_dir} is not shared by the run's hosts: process(es) {', '.join(blind)} "
            "do not see what process 0 wrote there; give every host the same --out_dir: "
            "gs://bucket/run (Cloud Storage) or a shared filesystem (NFS, Filestore)"
        )


class ObjectLog:
    """log.jsonl on an object store, where an object is never appended to: the log so far is held
    here (read back at a resume) and the object rewritten whole, at most every LOG_FLUSH_S and at
    every save, so that it is never cut, and a resume finds every record up to its checkpoint."""

    def __init__(self, url):
        self.url = url
        try:
            self.text = storage.read_bytes(url).decode()
        except FileNotFoundError:
            self.text = ""
        self.flushed, self.dirty = time.time(), False

    def append(self, line):
        self.text += line + "\n"
        self.dirty = True
        if time.time() - self.flushed >= LOG_FLUSH_S:
            self.flush()

    def flush(self):
        if self.dirty:
            storage.write_bytes(self.url, self.text.encode())
            self.flushed, self.dirty = time.time(), False


def append_line(path, line):
    """One write() of the whole line, so that a crash leaves at most a partial last line, never two
    mixed."""
    data = (line + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.ENOSPC, "short write (disk full?)", path)
    finally:
        os.close(fd)


def drop_partial_line(path):
    """Cut a last line without its newline (a crash mid-write), which would otherwise sit mid-file
    once appended to."""
    if not os.path.exists(path):
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)
