"""
Training parity for modded-nanogpt's record 20 (`python -m parity.check_speedrun --record 20`): the
record in PyTorch (parity/speedrun20_reference.py's GPT, parity/speedrun20_training.py's Muon, Adam
groups, schedules, train_step and loader) against train.py's own jitted step with
arch='speedrun20', optimizer='muon20', lr_schedule='cooldown' (train_step's make_optimizer,
init_state and make_train_step with record 20's step inputs, on compute/sharding.py's mesh), from
the same weights (a state_step.pt the reference writes, read by ours as --init_from reads it) on the
same llm.c shards, each side reading them with its own loader. fp32 (Newton-Schulz in fp32), or
--dtype bfloat16 (ours and the record's own bf16, each against fp32); the FP8 head off on both
sides. 12 steps of 4 sequences of 512 tokens (4 blocks, documents split at <|endoftext|>) cross the
windows' growth (the long one reaches the sequence at step 4, the short one at 7), the momentum's
warmup (6 steps, the record's 300 scaled) and the cooldown (the last 40%). Not a module to run:
check_speedrun runs it.

The weights are the record's init but for its zero-initialised projections and head, drawn as its
other matrices: with them at zero every block adds nothing, and the final RMSNorm is blind to the
scale of what reaches it, so the gradients of the lambdas and skip weights are exactly zero in
exact arithmetic and rounding noise (~1e-11) in float32 on each side, which Adam's eps of 1e-10
turns into full-size steps of either sign: two correct ports part there at step 2.
"""

import os

import numpy as np

# 8 layers: the record's layer 7, without attention, is among them; vocab_size 50257 holds
# <|endoftext|>
TINY20 = dict(vocab_size=50257, num_layers=8, num_heads=2, model_dim=32)
RUN20 = dict(rows=4, seq_len=512, steps=12, warmup=6, cooldown_frac=0.4)
# --own: the record's own code fixes 12 layers (its value-embedding and window lists) and its
# momentum warmup's 300 steps
OWN20 = dict(TINY20, num_layers=12)
OWN_WARMUP = 300
SHARD_TOKENS = 16_000  # a dozen steps of 4 x 512 cross a shard end
EOT = 50256
# the token ids the shards hold, besides <|endoftext|>: each embedding row a step sees takes many
# tokens' gradients. Where a row saw one token, an entry whose gradient cancels to ~1e-11 is
# rounding noise that Adam (eps 1e-10, lr 0.6) turns into a step of either sign on each side.
VOCAB_USED = 1000


def write_shards(data_dir, n_shards=2, seed=0):
    """llm.c .bin shards with something to learn (each token the previous one plus 1, 2 or 3, below
    VOCAB_USED) and a document boundary every ~300 tokens."""
    from parity.common import write_datafile

    rng = np.random.default_rng(seed)
    for i in range(n_shards):
        tokens = np.cumsum(rng.integers(1, 4, SHARD_TOKENS)) % VOCAB_USED
        tokens[rng.random(SHARD_TOKENS) < 1 / 300] = EOT
        write_datafile(os.path.join(data_dir, f"tiny_train_{i:06d}.bin"), tokens)


def make_batches(run):
    """run.steps batches (x, y), each (accum, rows / accum, T), from train.py's record-20 loader,
    asserted equal to the record's distributed_data_generator's steps on the same shards."""
    from dataio.dataloader import make_loader
    from parity.speedrun20_training import data_generator

    ours = make_loader(
        run.data_dir,
        "train",
        run.seq_len,
        run.rows // run.accum,
        run.c["seed"],
        vocab_size=TINY20["vocab_size"],
        record20=True,
    )
    theirs = data_generator(
        os.path.join(run.data_dir, "tiny_train_*.bin"), run.rows * run.seq_len, 0, 1
    )
    batches = [ours.next(run.accum) for _ in range(run.steps)]
    for (x, y), (inputs, targets) in zip(batches, theirs):
        if not (np.array_equal(x.reshape(-1), inputs) and np.array_equal(y.reshape(-1), targets)):
            raise AssertionError("our record-20 loader's steps differ from the record's")
    return batches


class TorchSide:
    """The record's GPT and loop body (parity/speedrun20_training.train_step) from the
    state_step.pt, fp32 (or with bf16: the record's own dtypes, its embedding tables and with them
    every activation in bf16, Newton-Schulz in bf16); one process standing for the record's `world`
    ranks."""

    def __init__(self, path, run, world, bf16=False):
        import torch

        from parity.speedrun20_reference import GPT
        from parity.speedrun20_training import gpt_sizes, make_optimizers

        dtype = torch.bfloat16 if bf16 else torch.float32
        self.model = GPT(**gpt_sizes(run.c), embed_dtype=dtype)
        state = torch.load(path, map_location="cpu", weights_only=True)["model"]
        state = {k.removeprefix("_orig_mod."): v for k, v in state.items()}
        self.model.load_state_dict(state)  # the tables' values cast to their dtype
        self.optimizers = make_optimizers(self.model, ns_dtype=dtype)
        self.run, self.world, self.it = run, world, 0

    def step(self, x, y):
        import torch

        from parity.speedrun20_training import train_step

        norms = []
        losses = train_step(
            self.model,
            self.optimizers,
            torch.from_numpy(x.reshape(-1).astype(np.int64)),
            torch.from_numpy(y.reshape(-1).astype(np.int64)),
            self.it,
            self.run.steps,
            self.run.seq_len,
            world_size=self.world,
            cooldown_frac=RUN20["cooldown_frac"],
            warmup_steps=self.run.c["muon_momentum_warmup"],
            grad_norms=norms,
        )
        self.it += 1
        lr = self.optimizers[0].param_groups[0]["lr"]  # the head's, as train.py logs it
        return {"loss": losses.mean().item(), "grad_norm": norms[0], "lr": lr}

    def state_dict(self):
        # copies: the params train in place
        return {k: v.detach().float().numpy().copy() for k, v in self.model.state_dict().items()}


def jax_side(run, dtype="float32"):
    """train.py's step (parity.train_sides.JaxTrainer) in `dtype` (bf16: Newton-Schulz and the
    embedding tables in bf16 too), its params named as the record's state dict."""
    from flax import nnx

    from dataio.pretrained import to_record20_state
    from parity.train_sides import JaxTrainer

    class JaxSide(JaxTrainer):
        def state_dict(self):
            model = nnx.merge(self.graphdef, self.defs[0].unflatten(self.state[0]))
            return {k: np.asarray(v, np.float32) for k, v in to_record20_state(model).items()}

    ns = "bfloat16" if dtype == "bfloat16" else "float32"
    # bf16: the record's bf16 embedding tables too
    return JaxSide(run._replace(c=dict(run.c, muon_ns_dtype=ns, embed_dtype=dtype)), dtype)


def settings(steps, seq_len, seed, attention="auto", sizes=TINY20, warmup=RUN20["warmup"]):
    """train.py's settings for the tiny record-20 run: the record's rates, warmup scaled."""
    from run.settings import DEFAULTS

    return dict(
        DEFAULTS,
        arch="speedrun20",
        n_layer=sizes["num_layers"],
        n_head=sizes["num_heads"],
        n_embd=sizes["model_dim"],
        vocab_size=sizes["vocab_size"],
        block_size=seq_len,
        bias=False,
        dropout=0.0,
        optimizer="muon20",
        lr_schedule="cooldown",
        cooldown_frac=RUN20["cooldown_frac"],
        learning_rate=0.008,
        embed_learning_rate=0.6,
        scalar_learning_rate=0.04,
        muon_learning_rate=0.05,
        muon_momentum=0.95,
        muon_momentum_start=0.85,
        muon_momentum_warmup=warmup,
        muon_ns_dtype="float32",
        beta1=0.8,
        beta2=0.95,
        weight_decay=0.0,
        grad_clip=0.0,
        max_iters=steps,
        seed=seed,
        attention=attention,
        remat="none",
        loss_chunk=0,
        scan_layers=False,
        fp8_head=False,
    )


def make_run(args, tmp, own=None):
    """The tiny record-20 model as the record inits it (by the reference's GPT, or by the record's
    own code `own`, a parity.record_code.RecordCode), saved as a state_step.pt; the shards; the
    Run. The zero-initialised matrices are drawn as the others (see the docstring) unless
    args.record_init."""
    import torch

    from parity.speedrun20_reference import GPT
    from parity.train_sides import Run

    torch.manual_seed(args.seed)
    model_path = os.path.join(tmp, "state_step000000.pt")
    sizes, warmup = (TINY20, RUN20["warmup"]) if own is None else (OWN20, OWN_WARMUP)
    if own is None:
        model = GPT(**sizes, embed_dtype=torch.float32)
    else:  # the record's tables are float32 until its main section's .bfloat16()
        model = own.run_definitions()["GPT"](**sizes)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("c_proj.weight", "lm_head.weight")) and not args.record_init:
                p.uniform_(-1, 1).mul_(3**0.5 * 0.5 * p.size(1) ** -0.5)
    state = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}  # as torch.compile's
    torch.save(dict(step=0, model=state), model_path)
    data_dir = os.path.join(tmp, "data")
    os.makedirs(data_dir)
    write_shards(data_dir, seed=args.seed)
    seq_len = args.seq_len or RUN20["seq_len"]
    c = settings(args.steps, seq_len, args.seed, args.attention, sizes, warmup)
    return Run(
        c,
        model_path,
        data_dir,
        args.steps,
        RUN20["rows"],
        seq_len,
        args.accum,
        args.devices,
        args.fsdp,
        args.tensor_parallel,
    )


def check(run, dtype="float32", own=None, record_init=False):
    """Train both sides on the same steps; print the report; return (ok, figures). bf16: ours and
    the record's own bf16 (TorchSide(bf16=True)), each against torch fp32. own (a
    parity.record_code.RecordCode): the record's own code is the torch side (fp32), its loader
    checked beside ours; with record_init, its float64 run too, and the report of the record's own
    start."""
    import jax
    import torch

    from parity import own_sides
    from parity.common import pin_numerics
    from parity.train_report import report
    from parity.train_sides import train_side

    pin_numerics()
    batches = make_batches(run)
    world = run.devices // run.tensor_parallel  # the record's ranks: our batch shards
    if own is not None:
        own_sides.print_changes(own)
        own_sides.check_record20_loader(own, run.data_dir, batches)
    print(
        f"record 20: {run.steps} steps of {run.rows} x {run.seq_len} tokens ({run.accum} "
        f"micro-batch(es)), {dtype}, the FP8 head off; torch on cpu as {world} rank(s), ours on "
        f"{run.devices} {jax.devices()[0].platform} device(s) (fsdp {run.fsdp}, tensor "
        f"{run.tensor_parallel}; attention {run.c['attention']}); the two loaders' steps equal"
    )
    start = "the record's own init" if record_init else "its zero matrices drawn"
    print(
        "Adam (head 0.008, embeddings 0.6, scalars 0.04; betas 0.8, 0.95, eps 1e-10), Muon 0.05 "
        f"(momentum 0.85 -> 0.95 over {run.c['muon_momentum_warmup']} steps, Newton-Schulz in "
        f"{dtype} but the fp32 reference's), cooldown over the last {RUN20['cooldown_frac']:.0%}, "
        f"windows growing 1728 * step / {run.steps}; {run.c['n_layer']} layers from {start}"
    )
    sides = {"torch": lambda: TorchSide(run.model_dir, run, world)}
    if own is not None:
        sides["torch"] = lambda: own_sides.Record20Own(own, run.model_dir, run, world)
    sides["jax"] = lambda: jax_side(run, dtype)
    if dtype == "bfloat16":
        sides["torch_bf16"] = lambda: TorchSide(run.model_dir, run, world, bf16=True)
    if record_init:
        sides["torch_fp64"] = lambda: own_sides.Record20Own(
            own, run.model_dir, run, world, torch.float64
        )
    results = {side: train_side(make(), batches) for side, make in sides.items()}
    if record_init:
        return own_sides.report_record_start(results), {}
    return report(run, results, dtype)
