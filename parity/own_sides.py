"""
The records' own code as the torch side of parity.check_speedrun (`--own CHECKOUT`): the record's
GPT, optimizers, schedule and training step as its file has them (parity/record_code.py), stepped
on the check's batches; its own loader read beside ours; and the report of a run from the record's
own init. Not a module to run: check_speedrun runs it.
"""

import contextlib
import os
from types import SimpleNamespace

import numpy as np
import torch

from parity.common import print_table
from parity.record_code import (
    EDITS,
    STAND_INS,
    OneProcess,
    dense_flex_attention,
    plain_head,
)
from parity.speedrun20_training import gpt_sizes, grad_norm
from parity.train_report import LOSS_TOL, rel


class LossRecorder:
    """The model as the record's loop calls it, where the record has torch.compile(model) (and, for
    record 5, DDP around it): each call's loss kept; the rest is the model's."""

    def __init__(self, model, loss_of):
        self.module, self.loss_of, self.losses = model, loss_of, []

    def __call__(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        self.losses.append(self.loss_of(out).item())
        return out

    def __getattr__(self, name):  # parameters, zero_grad, train
        return getattr(self.module, name)

    @contextlib.contextmanager
    def no_sync(self):  # DDP's: one process has nothing to sync
        yield


class OwnSide:
    """A record's own code as a parity side: its set-up statements run once on `model` (the
    record's GPT holding the check's initial weights), then step(x, y) runs its training step and
    returns {"loss": the mean of the step's losses, "grad_norm": the gradient's norm as its first
    optimizer takes it, "lr": that optimizer's first group's}."""

    def __init__(self, code, namespace, model, loss_of):
        self.code, self.ns, self.model = code, namespace, model
        namespace["model"] = model
        exec(code.main("setup"), namespace)
        self.seen = {}
        namespace["optimizer1"].register_step_pre_hook(self._before_step)
        namespace["model"] = self.recorder = LossRecorder(model, loss_of)
        self._step = code.main("step")

    def _before_step(self, optimizer, args, kwargs):
        self.seen["grad_norm"] = grad_norm(self.model)  # the grads as the optimizers take them
        self.seen["lr"] = optimizer.param_groups[0]["lr"]

    def run_step(self):
        self.recorder.losses.clear()
        exec(self._step, self.ns)
        return {
            "loss": float(np.mean(self.recorder.losses)),
            "grad_norm": self.seen["grad_norm"],
            "lr": self.seen["lr"],
        }

    def state_dict(self):
        # copies: the params train in place
        return {k: v.detach().float().numpy().copy() for k, v in self.model.state_dict().items()}


def load_state(model, path):
    """The weights of a state_step.pt (torch.compile's `_orig_mod.` names) into the record's GPT."""
    state = torch.load(path, map_location="cpu", weights_only=True)["model"]
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in state.items()})
    return model


class Record20Own(OwnSide):
    """Record 20's GPT (at run.c's sizes), Adam and Muon groups, cooldown and window schedules and
    loop body, run in `dtype` as one process standing for `world` ranks."""

    def __init__(self, code, path, run, world, dtype=torch.float32):
        namespace = code.run_definitions(
            flex_attention=dense_flex_attention, lm_head_fp8=plain_head, dist=OneProcess(world)
        )
        model = load_state(namespace["GPT"](**gpt_sizes(run.c)), path).to(dtype)
        args = SimpleNamespace(
            num_iterations=run.steps, cooldown_frac=run.c["cooldown_frac"], seq_len=run.seq_len
        )
        namespace.update(rank=0, world_size=1, args=args, train_steps=run.steps)
        super().__init__(code, namespace, model, lambda loss: loss)
        self._window, self.it = code.main("window"), 0

    def step(self, x, y):
        inputs = torch.from_numpy(np.asarray(x, np.int32).reshape(-1))
        targets = torch.from_numpy(np.asarray(y, np.int64).reshape(-1))
        self.ns.update(step=self.it, train_loader=iter([(inputs, targets)]))
        exec(self._window, self.ns)
        self.it += 1
        return self.run_step()


class Record5Own(OwnSide):
    """Record 5's GPT (config: GPTConfig's fields), AdamW on the tied head and Muon (at 0.1 of its
    rate) on the blocks, trapezoid schedule and training section, fp32 (its bf16 autocast off)."""

    def __init__(self, code, path, config, run):
        namespace = code.run_definitions(ctx=contextlib.nullcontext())
        model = load_state(namespace["GPT"](namespace["GPTConfig"](**config)), path)
        c = run.c
        args = SimpleNamespace(
            learning_rate=c["learning_rate"],
            weight_decay=c["weight_decay"],
            num_iterations=run.steps,
            warmup_iters=c["warmup_iters"],
            warmdown_iters=c["warmdown_iters"],
        )
        namespace.update(raw_model=model, args=args, train_accumulation_steps=run.accum)
        super().__init__(code, namespace, model, lambda out: out[1])

    def step(self, x, y):
        batches = [
            (torch.from_numpy(np.asarray(X, np.int64)), torch.from_numpy(np.asarray(Y, np.int64)))
            for X, Y in zip(x, y)
        ]
        # the loop takes x, y, then fetches each next micro-batch (and the next step's first)
        fetched = iter(batches[1:] + [(None, None)])
        loader = SimpleNamespace(next_batch=lambda: next(fetched))
        self.ns.update(x=batches[0][0], y=batches[0][1], train_loader=loader)
        return self.run_step()

    def state_dict(self):  # without the tied lm_head.weight (transformer.wte.weight holds it)
        return {k: v for k, v in super().state_dict().items() if k != "lm_head.weight"}


def check_record20_loader(code, data_dir, batches):
    """Record 20's own distributed_data_generator (one process, the step's tokens) yields our
    batches."""
    generator = code.run_definitions()["distributed_data_generator"]
    with contextlib.chdir(data_dir):  # it globs under the working directory
        theirs = generator("*_train_*.bin", batches[0][0].size, 0, 1)
        for x, y in batches:
            inputs, targets = next(theirs)
            if not (
                np.array_equal(x.reshape(-1), inputs) and np.array_equal(y.reshape(-1), targets)
            ):
                raise AssertionError("our record-20 loader's steps differ from the record's own")


def check_record5_loader(code, data_dir, batches):
    """Record 5's own DistributedDataLoader (one process holding the ranks' rows) yields our
    micro-batches."""
    loader_class = code.run_definitions()["DistributedDataLoader"]
    accum, B, T = batches[0][0].shape
    theirs = loader_class(os.path.join(data_dir, "*_train_*.bin"), B, T, 0, 1)
    for x, y in batches:
        for X, Y in zip(x, y):
            x_ref, y_ref = theirs.next_batch()
            if not (np.array_equal(X, x_ref.numpy()) and np.array_equal(Y, y_ref.numpy())):
                raise AssertionError("our .bin loader's batches differ from the record's own")


def print_changes(code):
    """What differs from the record's file, as the check runs it."""
    print(f"the record's own code: {code.path}, changed for one CPU process in fp32:")
    for edit in EDITS[code.record]:
        print(f"  {edit.old.strip()!r} -> {edit.new.strip()!r}: {edit.why}")
    for line in STAND_INS[code.record]:
        print(f"  {line}")


def report_record_start(results, judged_steps=2):
    """From the record's own init (its zero projections and head): ours and the record's code in
    fp32 beside the record's code in float64, every step. Judged: the first `judged_steps` steps'
    losses, before the lambdas' and skip weights' first updates (rounding noise that Adam's eps of
    1e-10 turns into full steps) can part them; later steps are reported. -> ok."""
    ours, fp32, fp64 = (
        [r["loss"] for r in results[side]["records"]] for side in ("jax", "torch", "torch_fp64")
    )
    print_table(
        [
            [str(i), f"{o:.6f}", f"{f:.6f}", f"{d:.6f}", rel(o, f), rel(f, d), rel(o, d)]
            for i, (o, f, d) in enumerate(zip(ours, fp32, fp64))
        ],
        [
            "step",
            "loss ours",
            "record fp32",
            "record fp64",
            "ours vs record fp32",
            "record fp32 vs fp64",
            "ours vs fp64",
        ],  # fmt: skip
    )
    ours_gap = max(rel(o, f) for o, f in zip(ours, fp32))
    noise = max(rel(f, d) for f, d in zip(fp32, fp64))
    print(
        f"from the record's own init, the record's fp32 run parts from its float64 run by up to "
        f"{noise:.1e}, ours from the record's fp32 by up to {ours_gap:.1e}: the scalars' first "
        "gradients are 0 in exact arithmetic, rounding noise in fp32, which Adam's eps of 1e-10 "
        "turns into full steps (docs/speedrun.md)"
    )
    worst = max(rel(o, f) for o, f in zip(ours[:judged_steps], fp32[:judged_steps]))
    ok = worst <= LOSS_TOL
    print(
        f"steps 0-{judged_steps - 1}: worst |Δloss|/loss {worst:.1e} (tolerance {LOSS_TOL:g}): "
        f"{'OK' if ok else 'NOT OK'}; later steps reported, not judged (an ill-conditioned start)"
    )
    return ok
