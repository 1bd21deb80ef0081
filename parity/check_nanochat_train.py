"""
nanochat's training steps: ours against a torch side, from the same weights on the same batches,
float32 on both sides, with the loss and the largest relative param difference after every step.

Ours: what train.py runs, from run.settings.DEFAULTS, config/nanochat_cpu.py and the depth dial
(train_setup.dial) at a tiny depth: make_optimizer ('muonadamw', 'warmdown'), init_state holding
the start's weights, the jitted step (micro-batches scanned, gradients averaged). The torch side:
base_train's loop (each micro-batch's loss / grad_accum_steps backward, the three schedules set on
the param groups, optimizer.step, zero_grad) over parity/nanochat_reference.py's GPT and
parity/nanochat_optim_reference.py's MuonAdamW with base_train's schedules as written here by
reading (BaseTrainSchedules); or, with --own, over nanochat's own GPT (init_weights,
setup_optimizer at the run's rates), its MuonAdamW (eager: torch.compile's CPU build takes
minutes and computes the same float32 arithmetic) and base_train's own three schedule functions,
their definitions exec'd from scripts/base_train.py (the script runs its main at import).
The start: the torch side's init moved by check_nanochat's noise. At nanochat's own init the
projections are 0, so the stream is a multiple of the embedding, which the final norm's scale
invariance cancels: the lambdas' gradients are float32 rounding, which Adam's division by their
root turns into full steps of either sign, on either side.

    python -m parity.check_nanochat_train                    # the torch reference
    python -m parity.check_nanochat_train --own ../nanochat  # nanochat's own code
    python -m parity.check_nanochat_train --drift --own ../nanochat  # bf16's drift, each side

Exit code: 0 parity holds (--drift: 0, it reports), 1 a tolerance is exceeded, 2 bad input.
"""

import argparse
import ast
import contextlib
import math
import os
import sys
import tempfile
from types import SimpleNamespace
from typing import NamedTuple

import jax
import numpy as np
import torch
from flax import nnx

from compute import sharding
from configurator import UsageError, configure, exit_on_bad_input, require_extras
from model import RUNTIME_FIELDS
from parity import nanochat_drift, nanochat_optim_reference, nanochat_reference
from parity.check_nanochat import perturbed
from parity.common import pin_numerics, print_table, verdict
from run import auto_settings, train_setup, train_step
from run.settings import DEFAULTS, accumulation_steps, validate

CONFIG_FILE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "config", "nanochat_cpu.py")
VOCAB = 120  # padded to 128 rows: the head's and the embeddings' rows past it train too (decay)
ACCUM, ROWS, SEQ = 2, 2, 160  # micro-batches, rows each, tokens: past the short window (128)


def run_argv(steps, *extra):
    """config/nanochat_cpu.py at depth 3 (n_embd 48: 3 heads of 16, 1 key/value head), windows
    'SL' tiled (S L L; S = 128 tokens, which the 160-token rows run past), a `steps`-iteration run
    whose warmup (2), warmdown and weight-decay cosine all move within it, ACCUM micro-batches a
    step. Depth 3, not 2: at depth 2 the layer backed out (n_layer // 2) is the last, whose output
    the final norm takes whole, so backout_lambda only scales what the norm unscales: its gradient
    is float32 rounding (nanochat's too)."""
    return [
        CONFIG_FILE,
        "--depth=3",
        "--aspect_ratio=16",
        "--head_dim=16",
        "--n_kv_head=1",
        "--window_pattern=SL",
        f"--block_size={SEQ}",
        f"--vocab_size={VOCAB}",
        f"--batch_size={ROWS}",
        f"--total_batch_size={ACCUM * ROWS * SEQ}",
        f"--max_iters={steps}",
        "--warmup_iters=2",
        "--dtype=float32",
        "--scan_layers=False",
        *extra,
    ]


def run_settings(steps, *extra):
    """train.py's settings `c` for run_argv, after the depth dial (the four rates and the weight
    decay scaled as base_train scales them), and the mesh of one device."""
    c = configure(DEFAULTS, run_argv(steps, *extra))
    validate(c)
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    train_setup.dial(c, VOCAB, mesh, master=False)
    if accumulation_steps(c, 1) != ACCUM:
        raise UsageError(f"the run takes {ACCUM} micro-batches a step")
    return c, mesh


def model_fields(c):
    """nanochat's GPTConfig fields of the run's model."""
    return dict(
        sequence_len=c["block_size"],
        vocab_size=VOCAB,
        n_layer=c["n_layer"],
        n_head=c["n_head"],
        n_kv_head=c["n_kv_head"] or c["n_head"],
        n_embd=c["n_embd"],
        window_pattern=c["window_pattern"],
    )


def make_batches(steps, seed):
    """`steps` batches (x, y), each (ACCUM, ROWS, SEQ) random ids, y the next token of x."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (steps, ACCUM, ROWS, SEQ + 1))
    return [(t[..., :-1].astype(np.int32), t[..., 1:].astype(np.int32)) for t in tokens]


class Ours:
    """train.py's model config, optimizer, state and compiled step for settings `c`, holding
    nanochat's state dict `state` (the start) as pretrained weights."""

    def __init__(self, c, mesh, state):
        runtime = {**{k: c[k] for k in RUNTIME_FIELDS}, **auto_settings.first_candidate(c)}
        config = train_setup.start_for(c, runtime, VOCAB, None, master=False).model_config
        tx = train_step.make_optimizer(c)
        # as train.py starts from pretrained weights (NanochatGPT.from_state: nanochat's layout)
        graphdef, params, opt_state = train_step.init_state(config, mesh, tx, weights=state)
        self.batch_sharding = sharding.batch_sharding(mesh)
        step = train_step.make_train_step(graphdef, tx, c["grad_clip"])
        self.step_fn, _, _ = train_step.compile_step(
            step, params, opt_state, (ACCUM, ROWS, SEQ), self.batch_sharding
        )
        self.graphdef, self.param_def = graphdef, jax.tree.structure(params)
        self.state = jax.tree.leaves(params), jax.tree.leaves(opt_state)
        self.key, self.iter_num = jax.random.key(c["seed"]), 0

    def step(self, x, y):
        """One step on a batch (ACCUM, ROWS, SEQ) -> its mean loss over the micro-batches."""
        key = jax.random.fold_in(self.key, self.iter_num)  # as train.py (no dropout: unused)
        x, y = (jax.device_put(a, self.batch_sharding) for a in (x, y))
        *self.state, metrics = self.step_fn(*self.state, x, y, key)
        self.iter_num += 1
        return float(metrics["loss"])

    def state_dict(self):
        return nnx.merge(self.graphdef, self.param_def.unflatten(self.state[0])).nanochat_state()


class BaseTrainSchedules:
    """base_train's get_lr_multiplier, get_muon_momentum (its 400-step warmup) and
    get_weight_decay, as written there (Python floats), for the settings `c`: written by
    reading scripts/base_train.py, the reference's schedules where no checkout is at hand."""

    def __init__(self, c):
        self.c, self.n = c, c["max_iters"]
        self.warmdown = round(c["cooldown_frac"] * self.n)

    def get_lr_multiplier(self, it):
        if it < self.c["warmup_iters"]:
            return (it + 1) / self.c["warmup_iters"]
        if it <= self.n - self.warmdown:
            return 1.0
        progress = (self.n - it) / self.warmdown
        return progress * 1.0 + (1 - progress) * self.c["final_lr_frac"]

    def get_muon_momentum(self, it):
        start = self.n - self.warmdown
        if it < 400:
            return (1 - it / 400) * 0.85 + it / 400 * 0.97
        if it >= start:
            progress = (it - start) / self.warmdown
            return 0.97 * (1 - progress) + 0.90 * progress
        return 0.97

    def get_weight_decay(self, it):
        return self.c["weight_decay"] * 0.5 * (1 + math.cos(math.pi * it / self.n))


SCHEDULES = ("get_lr_multiplier", "get_muon_momentum", "get_weight_decay")


def own_schedules(checkout, c):
    """base_train's three schedule functions, their definitions exec'd from the checkout's
    scripts/base_train.py in a namespace holding what they read: args (warmup_steps,
    warmdown_ratio, final_lr_frac), num_iterations, weight_decay_scaled (c's, as the dial set
    them)."""
    path = os.path.join(checkout, "scripts", "base_train.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in SCHEDULES]
    if sorted(n.name for n in found) != sorted(SCHEDULES):
        raise UsageError(f"{path}: not every one of {', '.join(SCHEDULES)} is defined there")
    args = SimpleNamespace(
        warmup_steps=c["warmup_iters"],
        warmdown_ratio=c["cooldown_frac"],
        final_lr_frac=c["final_lr_frac"],
    )
    namespace = dict(
        math=math, args=args, num_iterations=c["max_iters"], weight_decay_scaled=c["weight_decay"]
    )
    exec(compile(ast.Module(body=found, type_ignores=[]), path, "exec"), namespace)
    return SimpleNamespace(**{name: namespace[name] for name in SCHEDULES})


def optimizer_rates(c):
    """setup_optimizer's keywords from train.py's names, as base_train passes them (scaled)."""
    return dict(
        unembedding_lr=c["learning_rate"],
        embedding_lr=c["embed_learning_rate"],
        matrix_lr=c["muon_learning_rate"],
        weight_decay=c["weight_decay"],
        scalar_lr=c["scalar_learning_rate"],
    )


class TorchSide:
    """A torch GPT and MuonAdamW stepped by base_train's loop, its schedules `schedules`
    (BaseTrainSchedules' three functions); `eager`: nanochat's own fused steps run uncompiled."""

    def __init__(self, model, optimizer, schedules, eager=False):
        self.model, self.optimizer, self.schedules = model.train(), optimizer, schedules
        self.eager, self.iter_num = eager, 0

    def step(self, x, y):
        """base_train's step on (ACCUM, ROWS, SEQ) -> the mean of its micro-batches' losses."""
        losses = []
        for micro_x, micro_y in zip(torch.from_numpy(x).long(), torch.from_numpy(y).long()):
            loss = self.model(micro_x, micro_y)
            losses.append(float(loss.detach()))
            (loss / len(x)).backward()  # each backward sums the gradient: a mean over them
        it, s = self.iter_num, self.schedules
        lrm, momentum, weight_decay = (
            s.get_lr_multiplier(it),
            s.get_muon_momentum(it),
            s.get_weight_decay(it),
        )
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * lrm
            if group["kind"] == "muon":
                group["momentum"], group["weight_decay"] = momentum, weight_decay
        stance = (
            torch.compiler.set_stance("force_eager") if self.eager else contextlib.nullcontext()
        )
        with stance:
            self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        self.iter_num += 1
        return float(np.mean(losses))

    def state_dict(self):
        return {k: v.detach().float().numpy().copy() for k, v in self.model.state_dict().items()}

    def load(self, state):
        """Hold `state` ({nanochat's name: float32 numpy}) in place of the init."""
        self.model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)


def reference_side(c, seed):
    """parity/nanochat_reference.py's GPT (its init from `seed`), the reference MuonAdamW over
    setup_optimizer's groups at the run's rates, BaseTrainSchedules."""
    torch.manual_seed(seed)
    model = nanochat_reference.GPT(nanochat_reference.Config(**model_fields(c)))
    groups = nanochat_optim_reference.param_groups(
        dict(model.named_parameters()), **optimizer_rates(c)
    )
    optimizer = nanochat_optim_reference.MuonAdamW(groups)
    return TorchSide(model, optimizer, BaseTrainSchedules(c))


def own_side(checkout, c, seed, dtype="float32"):
    """nanochat's own GPT (init_weights from `seed`), its setup_optimizer at the run's rates, its
    MuonAdamW, base_train's own schedules (own_schedules), in `dtype` (its COMPUTE_DTYPE, fixed as
    it is imported: a shell's NANOCHAT_DTYPE does not reach it)."""
    if not os.path.isfile(os.path.join(checkout, "nanochat", "gpt.py")):
        raise UsageError(f"--own {checkout}: no nanochat/gpt.py there (a nanochat checkout?)")
    os.environ["NANOCHAT_DTYPE"] = dtype
    sys.path.insert(0, os.path.abspath(checkout))
    from nanochat import gpt

    torch.manual_seed(seed)
    with contextlib.redirect_stdout(None):  # its padding and LR-scale lines
        model = gpt.GPT(gpt.GPTConfig(**model_fields(c)))
        model.init_weights()
        optimizer = model.setup_optimizer(**optimizer_rates(c))
    return TorchSide(model, optimizer, own_schedules(checkout, c), eager=True)


# Tolerances, float32 on both sides; the numbers seen are over seeds 0-6 of the 6-step run.
# - The loss, the whole model's end-to-end: ~9 (the noise on the head), the first the same forward
#   on the same weights; 1e-5 is ~10 float32 ulps there. Seen: at most 1.4e-6; a 10% wrong weight
#   decay moves the second step's loss by 1.5e-4, a missing cautious mask by 1.4e-3.
# - The matrices and tables (>= 2-D: Muon's, the embeddings', the head's), each one's ||diff|| /
#   ||value||: the gradients differ by float32 rounding, which Muon's normalisation and Adam's
#   division by sqrt(v) carry into the updates at about that order; Muon's cautious mask can flip
#   at an element whose update x param is ~0 (one element moved by lr wd p), as can happen once a
#   run. Seen: at most 8.5e-6 (such a flip); a 10% wrong weight decay: 2.9e-5 after one step,
#   7.8e-5 after two; no cautious mask: 2.9e-4 after one.
# - The scalars (1-D: resid, x0, smear and backout lambdas), each alone or nearly: Adam on one
#   number divides its momentum by the root of its second moment, so as its gradient passes near 0
#   the update carries that gradient's float32 error at full rate (the smear group's 0.2, unscaled
#   by the batch). Seen: 1.2e-5, and once 6.4e-4 (backout_lambda, seed 6, step 2; 1e-5 a step
#   later). A wrong scalar step shows in the loss.
LOSS_TOL = 1e-5
MATRIX_TOL = 5e-5
SCALAR_TOL = 1e-3


class Step(NamedTuple):
    """One step's comparison: the losses, the largest max |diff| / max |value| over every param
    (the brief number), and the largest ||diff|| / ||value|| of the matrices and of the scalars,
    each with its param's name."""

    loss: float  # ours
    their_loss: float
    max_rel: tuple  # (difference, name)
    matrix: tuple
    scalar: tuple

    def ok(self):
        return (
            abs(self.loss - self.their_loss) <= LOSS_TOL
            and self.matrix[0] <= MATRIX_TOL
            and self.scalar[0] <= SCALAR_TOL
        )


def worst(diffs, names):
    """(the largest of diffs over names, its name)."""
    name = max(names, key=diffs.get)
    return diffs[name], name


def relative(a, b, norm):
    """norm(a - b) / norm(b) in float64 (0 where both are 0)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(norm(a), norm(b))
    return float(norm(a - b) / scale) if scale > 0 else 0.0


def compare(loss, their_loss, ours, theirs):
    """A Step from both sides' losses and state dicts ({nanochat's name: array})."""
    largest = lambda x: np.abs(x).max()  # noqa: E731
    max_rel = {k: relative(ours[k], t, largest) for k, t in theirs.items()}
    frobenius = {k: relative(ours[k], t, np.linalg.norm) for k, t in theirs.items()}
    matrices = [k for k, t in theirs.items() if t.ndim >= 2]
    scalars = [k for k, t in theirs.items() if t.ndim < 2]
    return Step(
        loss,
        their_loss,
        worst(max_rel, theirs),
        worst(frobenius, matrices),
        worst(frobenius, scalars),
    )


def run_steps(c, mesh, side, batches, seed):
    """Both sides trained on `batches` from the torch side's init moved by noise (perturbed) ->
    a Step per step."""
    start = perturbed(side.state_dict(), seed)
    side.load(start)
    ours = Ours(c, mesh, start)
    steps = []
    for x, y in batches:
        loss, their_loss = ours.step(x, y), side.step(x, y)
        steps.append(compare(loss, their_loss, ours.state_dict(), side.state_dict()))
    return steps


def within_tolerance(steps):
    return all(step.ok() for step in steps)


def print_steps(steps):
    rows = [
        [
            str(it),
            f"{s.loss:.6f}",
            f"{s.their_loss:.6f}",
            abs(s.loss - s.their_loss),
            *(f"{d:.3g} {name}" for d, name in (s.max_rel, s.matrix, s.scalar)),
        ]
        for it, s in enumerate(steps)
    ]
    headers = ["step", "ours loss", "torch loss", "|dloss|", "max |dp| / max |p|"]
    print_table(rows, headers + ["matrices ||dp|| / ||p||", "scalars ||dp|| / ||p||"])
    print(
        f"tolerances: loss {LOSS_TOL:g}; ||dp|| / ||p|| of each matrix or table {MATRIX_TOL:g}, "
        f"of each scalar param {SCALAR_TOL:g}"
    )


def drift(args, c, mesh, side):
    """--drift: the steps four ways from the same start, ours and nanochat's own (`side`) each in
    float32 and bf16 (parity/nanochat_drift.py); each side's bf16 against its float32 printed."""
    start = perturbed(side.state_dict(), args.seed)
    side.load(start)
    batches = make_batches(args.steps, args.seed)
    bf16, _ = run_settings(args.steps, "--dtype=bfloat16")
    with tempfile.TemporaryDirectory() as folder:
        runs = {
            "ours float32": nanochat_drift.trained(Ours(c, mesh, start), batches),
            "ours bf16": nanochat_drift.trained(Ours(bf16, mesh, start), batches),
            "torch float32": nanochat_drift.trained(side, batches),
            "torch bf16": nanochat_drift.own_bf16(args.own, args.steps, args.seed, start, folder),
        }
    print(
        f"nanochat training steps in bf16 against float32, from the same start on the same "
        f"batches: ours (train.py's step, dtype bfloat16 / float32) and torch (nanochat's own "
        f"code, NANOCHAT_DTYPE bfloat16 / float32); {args.steps} steps, the check's run"
    )
    nanochat_drift.print_drifts(nanochat_drift.drifts(runs, compare))
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--own", metavar="CHECKOUT", help="nanochat's own code from a checkout")
    parser.add_argument("--steps", type=int, default=6, help="steps, the run's max_iters (>= 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drift", action="store_true", help="bf16's drift, each side (--own)")
    parser.add_argument("--bf16-child", help=argparse.SUPPRESS)  # --drift's own bf16 run
    args = parser.parse_args(argv)
    if (args.drift or args.bf16_child) and args.own is None:
        raise UsageError("--drift: nanochat's own code in bf16 (--own CHECKOUT); no reference's")
    if args.steps < 3:
        raise UsageError("--steps must be >= 3: the warmup (2) and the warmdown both within it")
    require_extras("parity")
    pin_numerics()
    c, mesh = run_settings(args.steps)
    if args.own is None:
        side, name = reference_side(c, args.seed), "the torch reference"
    else:
        side = own_side(args.own, c, args.seed, "bfloat16" if args.bf16_child else "float32")
        name = "nanochat's own GPT, MuonAdamW, base_train schedules"
    if args.bf16_child:
        side.load(nanochat_drift.load_start(args.bf16_child))
        batches = make_batches(args.steps, args.seed)
        return nanochat_drift.save_trained(nanochat_drift.trained(side, batches), args.bf16_child)
    if args.drift:
        return drift(args, c, mesh, side)
    records = run_steps(c, mesh, side, make_batches(args.steps, args.seed), args.seed)
    print(
        f"nanochat training steps: ours (train.py's step, float32) vs {name} (float32); depth "
        f"{c['n_layer']}, n_embd {c['n_embd']}, heads {c['n_head']}/{c['n_kv_head']}, windows "
        f"{c['window_pattern']}, vocab {VOCAB}, batch ({ACCUM}, {ROWS}, {SEQ}), max_iters "
        f"{c['max_iters']}, warmup {c['warmup_iters']}"
    )
    print_steps(records)
    return 0 if verdict(within_tolerance(records), "nanochat training parity") else 1


if __name__ == "__main__":
    exit_on_bad_input(main)
