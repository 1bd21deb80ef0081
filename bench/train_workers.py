"""
The measurements `python -m bench.train` makes, each in a worker process of its own (run_worker), so
that a peak memory is that run's alone: our jitted train step timed (bench_jax) and its memory per
device, compiled only (bench_memory); nanoGPT's and transformers' models with torch's AdamW
(bench_torch); nanoGPT's training loop on the main command's settings (nanogpt_run). Not a
benchmark to run: `python -m bench.train` runs them and prints their tables.
"""

import os
import resource
import time

import numpy as np

from dataio.dataloader import data_meta

# jax, and our modules on it, are imported in the functions that use them: a torch worker's peak RSS
# must be torch's own

# a preset's settings that choose its optimizer (PRESETS' speedrun: Muon + Adam)
OPTIMIZER_KEYS = (
    "optimizer",
    "muon_learning_rate",
    "lr_schedule",
    "warmdown_iters",
    "max_iters",
    "beta1",
    "weight_decay",
    # nanochat's muonadamw (bench/presets.py): its groups' rates from the width, on its schedule
    "n_embd",
    "dtype",
    "learning_rate",
    "embed_learning_rate",
    "scalar_learning_rate",
    "warmup_iters",
    "cooldown_frac",
    "final_lr_frac",
)


def bench_jax(s):
    import jax
    from flax import nnx

    from compute import sharding
    from run import auto_settings, step_clock, train_step

    sharding.start_backend()
    sharding.keep_freed_memory()  # as train.py's main does
    c = optimizer_settings(s, learning_rate=1e-3, warmup_iters=10, lr_decay_iters=1000, min_lr=1e-4)
    mesh = sharding.make_mesh()  # data parallel over every device, as train.py's defaults
    tx = train_step.make_optimizer(c)
    graphdef, params, opt_state = train_step.init_state(
        model_config(s, sharding.platform_of(mesh)), mesh, tx
    )
    flops_per_token = nnx.merge(graphdef, params).flops_per_token()
    rows = s["batch_size"] * sharding.batch_shards(mesh)
    batch_sharding = sharding.batch_sharding(mesh)
    t_compile = time.perf_counter()
    fit, auto_line = auto_settings.compile_train_step(
        graphdef, params, opt_state, tx, (s["accum"], rows, s["block_size"]), batch_sharding, s, 1.0
    )
    step = fit.step
    compile_s = time.perf_counter() - t_compile
    # XLA's own account of the step's scratch memory (activations, grads in flight): exact, on any
    # backend
    temp = step.memory_analysis().temp_size_in_bytes
    # as train.py's loop holds them
    params, opt_state = jax.tree.leaves(params), jax.tree.leaves(opt_state)
    rng = np.random.default_rng(0)
    batch = rng.integers(0, s["vocab_size"], (s["accum"], rows, s["block_size"] + 1)).astype(
        np.int32
    )
    x, y = (
        jax.device_put(batch[..., :-1], batch_sharding),
        jax.device_put(batch[..., 1:], batch_sharding),
    )
    key = jax.random.key(0)
    times = []
    for i in range(s["warmup"] + s["steps"]):
        t0 = time.perf_counter()
        params, opt_state, metrics = step(params, opt_state, x, y, key)
        float(metrics["loss"])  # sync, to time each step
        times.append(time.perf_counter() - t0)
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    dt = float(np.median(times[s["warmup"] :]))
    tokens = s["accum"] * rows * s["block_size"]
    return {
        "ms": dt * 1000,
        "compile_s": compile_s,
        "peak_mb": (peak or rss_bytes()) / 2**20,
        "memory": "device" if peak else "RSS",
        "mfu": step_clock.mfu(flops_per_token * tokens, dt, jax.devices()),
        "device": jax.devices()[0].device_kind,
        "temp_mb": temp / 2**20,
        "tokens": tokens,
        "auto": auto_line,
    }


def model_config(s, platform):
    """The GPTConfig of the preset's shape and our settings, scan_layers resolved for `platform` as
    train.py does."""
    from model import GPTConfig
    from run import auto_settings
    from run.settings import resolve_scan_layers

    fields = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "dtype", "attention")
    # record 20's, nanochat's
    fields += tuple(k for k in ("fp8_head", "embed_dtype", "n_kv_head", "window_pattern") if k in s)
    arch = s.get("arch", "gpt2")
    scan_layers = resolve_scan_layers(s["scan_layers"], platform, arch)
    return GPTConfig(
        **{k: s[k] for k in fields},
        arch=arch,
        bias=arch == "gpt2",
        scan_layers=scan_layers,
        # remat, loss_chunk: compile_fitting picks where 'auto'
        **auto_settings.first_candidate(s),
    )


def optimizer_settings(s, **c):
    """train.py's settings for the preset's optimizer: AdamW, the speedrun's Muon + Adam, or
    nanochat's MuonAdamW; the preset's own over `c`."""
    from run.settings import DEFAULTS

    return dict(DEFAULTS, **c) | {k: s[k] for k in OPTIMIZER_KEYS if k in s}


def bench_memory(s):
    """The memory per device of a train step on a mesh, from abstract state: train_step.init_state
    traced only (jax.eval_shape), XLA compiles the step for ShapeDtypeStructs, nothing is
    materialized, so a laptop can size a pod's run. With a topology, libtpu's compiler compiles it
    for that TPU; a step that does not fit its HBM comes back as the compiler's refusal. With a GPU,
    XLA:GPU compiles it for that GPU's spec (accelerators.GPUS)."""
    import jax

    from compute import accelerators, sharding
    from run import auto_settings, train_step

    if s["topology"] or s["gpu"]:  # compile-only devices
        devices = (
            accelerators.topology_devices(s["topology"])
            if s["topology"]
            else accelerators.gpu_devices(s["gpu"], s["devices"])
        )[: s["devices"]]
    elif jax.device_count() < s["devices"]:
        return {"too_few_devices": jax.device_count()}
    else:
        devices = jax.devices()[: s["devices"]]
    mesh = sharding.make_mesh(s["fsdp"], s["tensor_parallel"], devices)
    platform = sharding.platform_of(mesh)
    config = model_config(s, platform)
    sharding.check_model_fits_mesh(config, mesh)
    tx = train_step.make_optimizer(optimizer_settings(s))
    graphdef, *state = jax.eval_shape(lambda: train_step.init_state(config, mesh, tx))
    # eval_shape returns no shardings: each array placed by the table again
    params, opt_state = (sharding.abstract(t, sharding.shardings_for(t, mesh)) for t in state)
    shape = (1, s["batch_size"] * sharding.batch_shards(mesh), s["block_size"])
    t0 = time.perf_counter()
    fit, auto = auto_settings.compile_train_step(
        graphdef, params, opt_state, tx, shape, sharding.batch_sharding(mesh), s, 1.0
    )
    return {
        "state": fit.state_bytes,
        "backend": platform,
        "mesh": dict(mesh.shape),
        "scan_layers": config.scan_layers,
        "device_kind": devices[0].device_kind,
        "hbm": accelerators.usable_bytes(devices[0]),
        "auto": auto,
        "peak": fit.peak,
        "refused": fit.step is None,
        "available": fit.limit,
        "remat": fit.config.remat,
        "loss_chunk": fit.config.loss_chunk,
        "attention": auto_settings.kernel(fit.config, devices[0]),
        "compile_s": time.perf_counter() - t0,
    }


def torch_model(s, device):
    """(model, loss_fn) for s["framework"]: nanoGPT's GPT (parity/nanogpt_reference.py: its
    model.py's modules, init, weight tying, loss; bias on, dropout 0) or transformers'
    GPT2LMHeadModel."""
    import torch

    if s["framework"] == "nanogpt":
        from parity.nanogpt_reference import GPT, GPTConfig

        model = GPT(
            GPTConfig(
                **{k: s[k] for k in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd")},
                dropout=0.0,
                bias=True,
            )
        )
        return model.to(device).train(), lambda x, y: model(x, y)[1]
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_positions=s["block_size"],
        vocab_size=s["vocab_size"],
        n_layer=s["n_layer"],
        n_head=s["n_head"],
        n_embd=s["n_embd"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = GPT2LMHeadModel(config).to(device).train()

    def loss_fn(x, y):
        logits = model(x).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    return model, loss_fn


def torch_mfu(model, s, dt, device_name):
    """nanoGPT's estimate_mfu for a torch model over the device's bf16 peak
    (step_clock.PEAK_BF16_FLOPS); None where the peak is unknown (CPU)."""
    from model import flops_per_token
    from run.step_clock import peak_flops_of

    if (peak := peak_flops_of(device_name)) is None:
        return None
    # N without position embeddings
    n = sum(p.numel() for name, p in model.named_parameters() if "wpe" not in name)
    flops = flops_per_token(n, s["n_layer"], s["n_head"], s["n_embd"], s["block_size"])
    return flops * s["block_size"] * s["accum"] * s["batch_size"] / dt / peak


def bench_torch(s):
    import torch

    from parity.common import pin_numerics
    from parity.torch_reference import configure_optimizers

    pin_numerics()
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, loss_fn = torch_model(s, device)
    opt = configure_optimizers(
        model, dict(learning_rate=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95)
    )
    # as nanoGPT's train.py on a GPU
    if (device == "cuda" or s["as_on_gpu"]) and s["framework"] == "nanogpt":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        opt = torch.optim.AdamW(opt.param_groups, lr=1e-3, betas=(0.9, 0.95), fused=True)
        loss_fn = torch.compile(loss_fn)
    rng = np.random.default_rng(0)
    batch = torch.from_numpy(
        rng.integers(0, s["vocab_size"], (s["accum"], s["batch_size"], s["block_size"] + 1))
    )
    x, y = batch[..., :-1].contiguous().to(device), batch[..., 1:].contiguous().to(device)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=s["dtype"] == "bfloat16")
    times = []
    for i in range(s["warmup"] + s["steps"]):
        t0 = time.perf_counter()
        for k in range(s["accum"]):
            with autocast:
                loss = loss_fn(x[k], y[k])
            (loss / s["accum"]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    dt = float(np.median(times[s["warmup"] :]))
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    # peak_mb before mfu: torch_mfu imports jax, which the RSS must not count
    return {
        "ms": dt * 1000,
        "compile_s": None,
        "peak_mb": (peak or rss_bytes()) / 2**20,
        "memory": "device" if peak else "RSS",
        "mfu": torch_mfu(model, s, dt, name),
        "temp_mb": None,
        "device": name,
        "tokens": s["accum"] * s["batch_size"] * s["block_size"],
    }


# the main command (Makefile: shakespeare), and nanoGPT's README command for the same run on CPU
MAIN_RUN = dict(
    block_size=64,
    batch_size=12,
    n_layer=4,
    n_head=4,
    n_embd=128,
    max_iters=2000,
    lr_decay_iters=2000,
    dropout=0.0,
    eval_iters=20,
    eval_interval=250,
    learning_rate=1e-3,
    min_lr=1e-4,
    warmup_iters=100,
    decay_lr=True,
    beta1=0.9,
    beta2=0.99,
    weight_decay=0.1,
    grad_clip=1.0,
)


def nanogpt_run(s):
    """nanoGPT's train.py loop, single process, CPU, compile=False, with MAIN_RUN's settings: the
    random windows of get_batch, get_lr, clip_grad_norm_, an eval of eval_iters batches per split
    every eval_interval iterations, a checkpoint (torch.save) when val improves, loss.item() every
    iteration (log_interval=1)."""
    import torch

    from parity.torch_reference import nanogpt_train_loop

    r = MAIN_RUN
    t_start = time.time()
    torch.manual_seed(1337)
    torch.set_num_threads(os.cpu_count())
    data_dir = os.path.join("data", "shakespeare_char")
    # dropout 0 too
    model, _ = torch_model(dict(r, vocab_size=data_meta(data_dir)[0], framework="nanogpt"), "cpu")
    losses = nanogpt_train_loop(model, r, data_dir)
    return {"wall_s": time.time() - t_start, "val_loss": losses["val"]}


def rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
