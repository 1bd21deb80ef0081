"""
Training parity for the speedrun recipes (--record 20: parity/speedrun20_check.py): modded-nanogpt's
record 5 in PyTorch
(parity/speedrun_reference.py: its GPT, Muon on the blocks and Adam on the tied head, the trapezoid
schedule, its sequential shard loader) against train.py's own jitted step with arch='speedrun',
optimizer='muon', lr_schedule='trapezoid' (train_step's make_optimizer, init_state and
make_train_step on compute/sharding.py's mesh), from the same weights (a state_step.pt the reference
writes, read by ours as --init_from reads it) on the same llm.c .bin shards (each side reads them
with its own loader): loss, grad norm and lr at every step, every parameter at the end.
The run crosses the zero-initialised projections' first steps and a warmdown to 0.

    # tiny, fp32 (Newton-Schulz in fp32), 12 steps, offline
    python -m parity.check_speedrun
    # each step's rows as 2 micro-batches (the record's accum)
    python -m parity.check_speedrun --accum 2
    python -m parity.check_speedrun --fsdp 4 --tensor_parallel 2   # sharded: 8 (fake CPU) devices
    # ours bf16 (NS bf16) and torch autocast-bf16, vs fp32
    python -m parity.check_speedrun --dtype bfloat16
    python -m parity.check_speedrun --scan_layers --remat qkv_proj --attention splash --seq-len 128
    # record 20 (parity/speedrun20_check.py), on one device and on a mesh
    python -m parity.check_speedrun --record 20
    python -m parity.check_speedrun --record 20 --fsdp 4 --tensor_parallel 2
    python -m parity.check_speedrun --record 20 --dtype bfloat16   # and the record's bf16
    python -m parity.check_speedrun --record 20 --dtype bfloat16 --seeds 6   # judged by medians
    # the torch side: the record's own code from a modded-nanogpt checkout (parity/record_code.py)
    python -m parity.check_speedrun --record 20 --own ../modded-nanogpt
    python -m parity.check_speedrun --record 20 --own ../modded-nanogpt --record-init  # its start
    python -m parity.check_speedrun --own ../modded-nanogpt   # record 5's train_gpt2.py

Exit code: 0 parity holds, 1 a tolerance is exceeded, 2 bad input. The tolerances are
check_train's (parity/train_report.py).
"""

import argparse
import os
import sys
import tempfile

import numpy as np

from configurator import UsageError, exit_on_bad_input, require_extras
from parity import speedrun20_check
from parity.check_train import rerun_with_fake_devices
from parity.common import add_step_args, pin_numerics, print_table, write_datafile
from parity.speedrun20_check import RUN20
from parity.train_report import report, report_bf16_seeds
from parity.train_sides import JaxTrainer, Run, check_rows, train_side

TINY = dict(vocab_size=128, n_layer=2, n_head=2, n_embd=64)
# the record's optimizer settings at a learning rate that moves a tiny model far in a dozen steps
TINY_RUN = dict(
    rows=16, seq_len=32, learning_rate=1e-2, muon_learning_rate=5e-3, steps=12, warmdown_iters=4
)
# per train shard: a dozen steps of 16 x 32 cross a shard end (its tail dropped)
SHARD_TOKENS = 12_000


def write_shards(data_dir, vocab_size, n_shards=2, seed=0):
    """llm.c .bin shards with something to learn: each token the previous one plus 1, 2 or 3 (mod
    vocab). -> the shards' token arrays."""
    rng = np.random.default_rng(seed)
    shards = []
    for i in range(n_shards):
        shards.append((np.cumsum(rng.integers(1, 4, SHARD_TOKENS)) % vocab_size).astype(np.uint16))
        write_datafile(os.path.join(data_dir, f"tiny_train_{i:06d}.bin"), shards[-1])
    return shards


def make_batches(run, shards):
    """run.steps batches (x, y), each (accum, rows / accum, T): ours from train.py's loader,
    asserted equal to the record's loader's on the same shards (one process holding the record's
    ranks' rows)."""
    from dataio.dataloader import make_loader
    from parity.speedrun_reference import SequentialLoader

    B = run.rows // run.accum
    ours = make_loader(
        run.data_dir, "train", run.seq_len, B, run.c["seed"], vocab_size=TINY["vocab_size"]
    )
    theirs = SequentialLoader(shards, B, run.seq_len)
    batches = [ours.next(run.accum) for _ in range(run.steps)]
    for x, y in batches:
        for X, Y in zip(x, y):
            x_ref, y_ref = theirs.next_batch()
            if not (np.array_equal(X, x_ref.numpy()) and np.array_equal(Y, y_ref.numpy())):
                raise AssertionError("our .bin loader's batches differ from the record's")
    return batches


class TorchSide:
    """The record's model and training section as parity/speedrun_reference.py has them, from the
    state_step.pt."""

    def __init__(self, path, c, autocast_bf16=False):
        import torch

        from parity.speedrun_reference import GPT, GPTConfig, Trainer

        model = GPT(GPTConfig(**TINY))
        state = torch.load(path, map_location="cpu", weights_only=True)["model"]
        model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in state.items()})
        self.trainer = Trainer(model, c, autocast_bf16)
        self.step, self.state_dict = self.trainer.step, self.trainer.state_dict


class JaxSide(JaxTrainer):
    """train.py's step (parity.train_sides.JaxTrainer), its params named as the record's state
    dict."""

    def state_dict(self):
        from flax import nnx

        from dataio.pretrained import to_modded_state

        state = to_modded_state(nnx.merge(self.graphdef, self.defs[0].unflatten(self.state[0])))
        return {k: np.asarray(v, np.float32) for k, v in state.items() if k != "lm_head.weight"}


def make_run(args, tmp, own=None):
    """(Run, the shards' tokens): the tiny record-5 model saved by the reference (or by the
    record's own code `own`, a parity.record_code.RecordCode) as a state_step.pt, the shards."""
    import torch

    from parity.speedrun_reference import GPT, GPTConfig
    from run.settings import DEFAULTS

    torch.manual_seed(args.seed)
    model_path = os.path.join(tmp, "state_step000000.pt")
    if own is not None:
        GPT, GPTConfig = (own.run_definitions()[name] for name in ("GPT", "GPTConfig"))
    # as torch.compile's
    state = {f"_orig_mod.{k}": v for k, v in GPT(GPTConfig(**TINY)).state_dict().items()}
    torch.save(dict(step=0, model=state), model_path)
    data_dir = os.path.join(tmp, "data")
    os.makedirs(data_dir)
    shards = write_shards(data_dir, TINY["vocab_size"], seed=args.seed)
    seq_len = args.seq_len or TINY_RUN["seq_len"]
    c = dict(
        DEFAULTS,
        arch="speedrun",
        n_layer=TINY["n_layer"],
        n_head=TINY["n_head"],
        n_embd=TINY["n_embd"],
        bias=False,
        dropout=0.0,
        optimizer="muon",
        learning_rate=TINY_RUN["learning_rate"],
        # the record's own code sets Muon's rate to 0.1 of Adam's
        muon_learning_rate=TINY_RUN["learning_rate"] / 10
        if own is not None
        else TINY_RUN["muon_learning_rate"],
        muon_momentum=0.95,
        muon_ns_dtype="float32" if args.dtype == "float32" else "bfloat16",
        beta1=0.9,
        beta2=0.95,
        weight_decay=0.0,
        grad_clip=0.0,
        lr_schedule="trapezoid",
        warmup_iters=0,
        warmdown_iters=TINY_RUN["warmdown_iters"],
        max_iters=args.steps,
        seed=args.seed,
        attention=args.attention,
        remat=args.remat,
        loss_chunk=args.loss_chunk,
        scan_layers=args.scan_layers,
    )
    if args.attention == "splash" and seq_len % 128:  # else XLA's attention would run in its place
        raise UsageError(
            f"--attention splash needs a --seq-len that is a multiple of 128, got {seq_len}"
        )
    run = Run(
        c,
        model_path,
        data_dir,
        args.steps,
        TINY_RUN["rows"],
        seq_len,
        args.accum,
        args.devices,
        args.fsdp,
        args.tensor_parallel,
    )
    return run, shards


def check(run, shards, dtype="float32", own=None):
    """Train both sides on the same batches; print the report; return (ok, figures). own (a
    parity.record_code.RecordCode): the record's own code is the torch side, its loader checked
    beside ours."""
    import jax

    from parity import own_sides

    pin_numerics()
    batches = make_batches(run, shards)
    if own is not None:
        own_sides.print_changes(own)
        own_sides.check_record5_loader(own, run.data_dir, batches)
    c = run.c
    print(
        f"{run.steps} steps of {run.rows} x {run.seq_len} tokens ({run.accum} micro-batch(es)), "
        f"{dtype}; torch on cpu, ours on {run.devices} {jax.devices()[0].platform} device(s) (fsdp "
        f"{run.fsdp}, tensor {run.tensor_parallel}; attention {c['attention']}, remat "
        f"{c['remat']}, loss_chunk {c['loss_chunk']}, scan_layers {c['scan_layers']}); the two "
        "loaders' batches equal"
    )
    print(
        f"record 5: Adam lr {c['learning_rate']:g} on the tied head, Muon lr "
        f"{c['muon_learning_rate']:g} (momentum {c['muon_momentum']}, Newton-Schulz in "
        f"{c['muon_ns_dtype']}) on the blocks, trapezoid (warmup {c['warmup_iters']}, warmdown "
        f"{c['warmdown_iters']} to 0 at {c['max_iters']}), no clipping"
    )
    sides = {
        "torch": lambda: TorchSide(run.model_dir, dict(c, muon_ns_dtype="float32")),
        "jax": lambda: JaxSide(run, dtype),
    }
    if own is not None:
        sides["torch"] = lambda: own_sides.Record5Own(own, run.model_dir, TINY, run)
    if dtype == "bfloat16":  # the record's own bf16: autocast and Newton-Schulz in bf16
        sides["torch_bf16"] = lambda: TorchSide(run.model_dir, c, autocast_bf16=True)
    results = {side: train_side(make(), batches) for side, make in sides.items()}
    ok, figures = report(run, results, dtype)
    moved = {
        k: float(np.abs(v).max())
        for k, v in results["torch"]["final"].items()
        if k.endswith("c_proj.weight")
    }
    print_table(
        [[k, v] for k, v in moved.items()],
        ["zero-initialised projection", f"max |w| after {run.steps} steps"],
    )
    return ok and min(moved.values()) > 0, figures


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--steps",
        type=int,
        default=TINY_RUN["steps"],
        help="steps (max_iters: the warmdown ends there)",
    )
    p.add_argument("--record", type=int, default=5, choices=[5, 20], help="modded-nanogpt's record")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="the reference's init and the shards")
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="run seeds --seed.. --seed+N-1; bf16 is judged by their medians, fp32 by each",
    )
    p.add_argument(
        "--own",
        metavar="CHECKOUT",
        help="a modded-nanogpt checkout: the torch side is the record's own code from it (fp32)",
    )
    p.add_argument(
        "--record-init",
        action="store_true",
        help="with --own --record 20: from the record's own init (zero projections and head), "
        "beside its code in float64; steps 0-1 judged, the rest reported",
    )
    add_step_args(p)
    args = p.parse_args(argv)
    if args.own is not None and args.dtype != "float32":
        raise UsageError("--own runs the record's code in fp32: drop --dtype bfloat16")
    if args.record_init and (args.own is None or args.record != 20):
        raise UsageError(
            "--record-init is for --own --record 20 (record 5's check starts from its own init)"
        )
    args.devices = args.devices or args.fsdp * args.tensor_parallel
    if (
        args.steps <= TINY_RUN["warmdown_iters"]
        or min(args.accum, args.devices, args.fsdp, args.tensor_parallel, args.seeds) < 1
    ):
        raise UsageError(
            f"--steps must be > the warmdown's {TINY_RUN['warmdown_iters']}, and --accum, "
            f"--devices, --fsdp, --tensor_parallel, --seeds >= 1, got {args.steps}, {args.accum}, "
            f"{args.devices}, {args.fsdp}, {args.tensor_parallel}, {args.seeds}"
        )
    if args.devices % (args.fsdp * args.tensor_parallel):
        raise UsageError(
            f"--fsdp {args.fsdp} x --tensor_parallel {args.tensor_parallel} must divide --devices "
            f"{args.devices}"
        )
    rows = RUN20["rows"] if args.record == 20 else TINY_RUN["rows"]
    check_rows(rows, args.accum, args.devices, args.tensor_parallel)
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    require_extras("parity")
    import jax

    from compute import sharding

    sharding.start_backend()
    if args.devices > jax.device_count():
        return rerun_with_fake_devices(
            argv, args.devices, jax.device_count(), module="parity.check_speedrun"
        )
    from parity.record_code import RecordCode

    pin_numerics()
    own = None if args.own is None else RecordCode(args.own, args.record)
    results = {}
    for seed in range(args.seed, args.seed + args.seeds):
        one = argparse.Namespace(**{**vars(args), "seed": seed})
        if args.seeds > 1:
            print(f"\n--- seed {seed}")
        with tempfile.TemporaryDirectory() as tmp:
            if args.record == 20:
                run = speedrun20_check.make_run(one, tmp, own)
                results[seed] = speedrun20_check.check(run, args.dtype, own, args.record_init)
            else:
                results[seed] = check(*make_run(one, tmp, own), args.dtype, own)
    if args.seeds > 1 and args.dtype == "bfloat16" and all(f for _, f in results.values()):
        print()
        ok, _ = report_bf16_seeds({seed: figures for seed, (_, figures) in results.items()})
    else:
        ok = all(ok for ok, _ in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    exit_on_bad_input(main)
