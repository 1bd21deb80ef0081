"""
train.py's settings: their defaults (nanoGPT's names and values, build-nanogpt's additions) and the
checks every one of them passes before a run reads or writes anything, each a one-line UsageError
naming the fix.
"""

import importlib.util
import os

from archs import models
from compute.layers import REMAT
from configurator import UsageError
from model import DTYPES, GPTConfig
from run import runlog

# -----------------------------------------------------------------------------
# default config values designed to train a gpt2 (124M) on OpenWebText (nanoGPT's)
DEFAULTS = dict(
    # I/O
    out_dir="out",  # a folder, or gs://bucket/run (docs/pods.md)
    eval_interval=2000,  # train and val loss (and a checkpoint) every N iterations
    log_interval=1,  # a log line every N iterations
    eval_iters=200,  # batches per split in each eval
    eval_only=False,  # if True, script exits right after the first eval
    always_save_checkpoint=True,  # if True, always save a checkpoint after each eval
    checkpoint_interval=0,  # also save every N iterations (0: only at evals)
    hellaswag_interval=0,  # HellaSwag (val, all devices) every N iterations and at the end; 0 = off
    hellaswag_path="",  # a local hellaswag_val.jsonl; "" = download it once (online)
    keep_checkpoints=3,  # the last K checkpoints are kept
    # 'scratch' | 'resume' | 'gpt2*' | an HF GPT-2 directory | a nanoGPT ckpt.pt (or its out_dir)
    init_from="scratch",
    # a new run into an out_dir holding checkpoints: move them to out_dir/previous-<time>/ first
    start_over=False,
    # wandb logging
    wandb_log=False,  # send the log's records to wandb too (needs pip install wandb)
    wandb_project="owt",
    wandb_run_name="gpt2",
    # data
    dataset="openwebtext",  # a folder under data/, a path, or gs://bucket/folder
    shuffle_shards=False,  # .npy shard datasets: visit the shards in a seeded order each epoch
    # val loss over this many tokens from the val split's start (modded-nanogpt); 0: eval_iters
    # batches
    val_tokens=0,
    gradient_accumulation_steps=5 * 8,  # total micro-batches per step, over all devices
    total_batch_size=0,  # tokens per step; when > 0, gradient_accumulation_steps is derived from it
    # micro-batch size per batch shard (a device, or a group of tensor_parallel devices)
    batch_size=12,
    block_size=1024,  # tokens of context: each training window's length
    # model
    # 'gpt2' | 'speedrun': modded-nanogpt's record 5 (rotary, QK-norm, RMSNorm, ReLU^2; needs
    # bias=False) | 'speedrun20': its record 20 (windows, value embeddings, U-net; docs/speedrun.md)
    arch="gpt2",
    n_layer=12,  # transformer blocks
    n_head=12,  # attention heads per block
    n_embd=768,  # the residual stream's width
    vocab_size=0,  # 0: from data/<dataset>/meta.pkl, else GPT-2's 50257 padded to 50304
    dropout=0.0,  # for pretraining 0 is good, for finetuning try 0.1+
    bias=False,  # do we use bias inside LayerNorm and Linear layers?
    # 'tanh': GPT-2's GELU | 'exact': nanoGPT's (erf; what export.py --format=nanogpt needs)
    gelu="tanh",
    # adamw optimizer
    # 'adamw' | 'muon': Muon on the blocks' matrices, AdamW on the rest (record 5; arch='speedrun')
    # | 'muon20': Muon on the blocks' matrices, Adam on the head, embeddings and scalars (record 20;
    # arch='speedrun20', lr_schedule='cooldown')
    optimizer="adamw",
    # max learning rate (AdamW's; with optimizer='muon', the embedding's; 'muon20', the head's)
    learning_rate=6e-4,
    max_iters=600000,  # total number of training iterations
    weight_decay=1e-1,  # AdamW's, on the >= 2-D params only (nanoGPT's groups)
    beta1=0.9,
    beta2=0.95,
    grad_clip=1.0,  # clip gradients at this value, or disable if == 0.0
    # muon optimizer (optimizer='muon' or 'muon20')
    # Muon's max learning rate, > 0 with optimizer='muon' (record 5: 0.1 x learning_rate) or
    # 'muon20' (record 20: 0.05)
    muon_learning_rate=0.0,
    muon_momentum=0.95,  # Muon's SGD momentum, Nesterov (with 'muon20': once warmed up)
    # optimizer='muon20': Muon's momentum at iteration 0, linearly to muon_momentum over
    # muon_momentum_warmup iterations (record 20: 0.85)
    muon_momentum_start=0.85,
    muon_momentum_warmup=300,  # optimizer='muon20': that warmup's iterations (0: none)
    # Newton-Schulz's dtype: 'bfloat16' (the record's) | 'float32' (parity checks)
    muon_ns_dtype="bfloat16",
    # optimizer='muon20': Adam's max rate on the embeddings, wte and the value embeddings (record
    # 20: 0.6; learning_rate is the head's, 0.008)
    embed_learning_rate=0.6,
    # optimizer='muon20': Adam's max rate on the params of fewer than 2 dims, the lambdas and skip
    # weights (record 20: 0.04)
    scalar_learning_rate=0.04,
    # learning rate decay settings
    decay_lr=True,  # whether to decay the learning rate
    # 'cosine': nanoGPT's, to min_lr at lr_decay_iters | 'trapezoid': modded-nanogpt's record 5's
    # (below) | 'cooldown': its record 20's (below)
    lr_schedule="cosine",
    warmup_iters=2000,  # how many steps to warm up for
    lr_decay_iters=600000,  # should be ~= max_iters per Chinchilla
    min_lr=6e-5,  # minimum learning rate, should be ~= learning_rate/10 per Chinchilla
    # trapezoid: warmup, constant, then linearly to 0 over the last warmdown_iters iterations
    warmdown_iters=0,
    # cooldown: constant, then linearly to 0.1x over the last cooldown_frac of max_iters (record 20:
    # 0.4)
    cooldown_frac=0.4,
    # parallelism: the mesh is (data, fsdp, tensor), data = devices / (fsdp * tensor_parallel)
    fsdp=1,  # split params, grads and optimizer state over this many devices (the batch too)
    tensor_parallel=1,  # split each layer's heads and MLP units over this many devices (same rows)
    # system
    dtype="auto",  # 'float32' | 'bfloat16' | 'auto' (bfloat16 on GPU/TPU, float32 on CPU)
    # 'xla' | 'cudnn' (NVIDIA Ampere+, bf16) | 'splash' (TPU) | 'auto': the fused one where it runs;
    # arch='speedrun20': 'auto' | 'xla' | 'splash' | 'flash' (its windowed kernel for NVIDIA GPUs)
    attention="auto",
    # what the backward recomputes to save memory: 'none' | 'dots' | 'qkv_proj' | 'block'
    # (layers.REMAT); 'auto': the least recompute whose compiled step fits the device
    # (auto_settings; said at start-up)
    remat="auto",
    # the loss's logits this many positions at a time (memory B x loss_chunk x vocab); 0: all
    loss_chunk="auto",
    # True: the blocks under one lax.scan (one compiled block) | False | 'auto' (on TPU)
    scan_layers="auto",
    # arch='speedrun20': its head in FP8 in training, as record 20's (e4m3 x and weight, e5m2
    # gradient; the same rounding on every device, docs/speedrun.md)
    fp8_head=False,
    # arch='speedrun20': its long window grows over training to this many tokens, rounded up to
    # whole 128-token blocks, the short one half (the record's 1728: 14 blocks, 1792 tokens)
    window_size=1728,
    # arch='speedrun20': its embedding tables (and their Adam state) stored in 'float32' or
    # 'bfloat16', as record 20's (docs/speedrun.md)
    embed_dtype="float32",
    # arch='nanochat' (config/train_nanochat.py, docs/nanochat.md): its key/value heads (GQA; 0:
    # n_head) and its windows tiled over the layers, L the whole block, S a quarter (the last L)
    n_kv_head=0,
    window_pattern="SSSL",
    # a nanochat tokenizer directory (tokenizer.pkl: data/nanochat/prepare.py, or nanochat's own
    # ~/.cache/nanochat/tokenizer); "": the dataset folder's tokenizer/
    tokenizer="",
    # nanochat's one dial: depth > 0 sets n_layer = depth, n_embd = depth x aspect_ratio rounded up
    # to heads of head_dim, n_head; max_iters=0 from target_param_data_ratio (tokens per scaling
    # param) or target_flops; total_batch_size=0 from its batch rule; the four rates and
    # weight_decay scaled as its base_train scales them (archs/nanochat_recipe.py)
    depth=0,
    aspect_ratio=64,
    head_dim=128,
    target_param_data_ratio=12.0,
    target_flops=0.0,
    # lr_schedule='warmdown' (nanochat's): warmup_iters up, constant, then linearly to final_lr_frac
    # x the rate over the last cooldown_frac of max_iters
    final_lr_frac=0.05,
    # lr_schedule='sft' (nanochat's chat_sft, docs/chat.md): each rate starts at init_lr_frac of
    # itself, then moves with the fraction of the conversations consumed: up over warmup_frac,
    # constant, linearly to final_lr_frac over the last cooldown_frac; max_iters=0: one epoch
    init_lr_frac=1.0,
    warmup_frac=0.0,
    load_optimizer=True,  # its optimizer warm-started from the base's optim_*.pt (--load-optimizer)
    # ... and its mixture (dataio/task_folder.py): MMLU's and GSM8K's epochs; the identity epochs
    # and the spelling tasks' sizes, which its history mixed in (2, 200000, 80000), its checkout not
    mmlu_epochs=3,
    gsm8k_epochs=4,
    identity_epochs=0,
    simple_spelling=0,
    spelling_bee=0,
    profile="",  # 'START:STOP': a jax.profiler trace of iterations START..STOP-1 to out_dir/profile
    seed=1337,  # the init's, the data order's and dropout's
)


POSITIVE = (
    "batch_size",
    "block_size",
    "n_layer",
    "n_head",
    "n_embd",
    "gradient_accumulation_steps",
    "eval_iters",
    "eval_interval",
    "log_interval",
    "keep_checkpoints",
)
NOT_NEGATIVE = (
    "max_iters",
    "total_batch_size",
    "vocab_size",
    "checkpoint_interval",
    "hellaswag_interval",
    "warmup_iters",
    "lr_decay_iters",
    "learning_rate",
    "min_lr",
    "weight_decay",
    "grad_clip",
    "muon_learning_rate",
    "muon_momentum_warmup",
    "embed_learning_rate",
    "scalar_learning_rate",
    "warmdown_iters",
    "val_tokens",
    "depth",
    "aspect_ratio",
    "head_dim",
    "target_param_data_ratio",
    "target_flops",
    "final_lr_frac",
    "init_lr_frac",
    "warmup_frac",
    "mmlu_epochs",
    "gsm8k_epochs",
    "identity_epochs",
    "simple_spelling",
    "spelling_bee",
)
OPTIMIZERS = ("adamw", "muon", "muon20", "muonadamw")
LR_SCHEDULES = ("cosine", "trapezoid", "cooldown", "warmdown", "sft")


def validate(c):
    """Every setting's range, before anything is read or written: one UsageError naming the fix."""
    for key in POSITIVE:
        if c[key] < 1:
            raise UsageError(f"{key} must be >= 1, got {c[key]}")
    for key in NOT_NEGATIVE:
        if c[key] < 0:
            raise UsageError(
                f"{key} must be >= 0{' (0: off)' if key.endswith('_interval') else ''}, got "
                f"{c[key]}"
            )
    if not 0.0 <= c["dropout"] < 1.0:
        raise UsageError(f"dropout must be in [0, 1), got {c['dropout']}")
    for key in ("beta1", "beta2", "muon_momentum", "muon_momentum_start"):
        if not 0.0 <= c[key] < 1.0:
            raise UsageError(f"{key} must be in [0, 1), got {c[key]}")
    resolve_dtype(c["dtype"], "cpu")
    resolve_scan_layers(c["scan_layers"], "cpu")
    # a resume's model is its checkpoint's, checked once read (fixed_by_checkpoint)
    if c["init_from"] != "resume":
        check_model(c)
    profile_range(c["profile"])
    if not 0 <= c["seed"] < 2**32:
        raise UsageError(f"seed must be in [0, 2**32), got {c['seed']}")
    if c["wandb_log"] and importlib.util.find_spec("wandb") is None:
        raise UsageError("wandb_log=True needs wandb: pip install wandb, or set --wandb_log=False")
    if c["start_over"] and c["init_from"] == "resume":
        raise UsageError(
            "start_over=True moves the checkpoints that init_from='resume' would continue: choose "
            "one"
        )
    runlog.check_out_dir(c["out_dir"])
    if os.path.isfile(c["dataset"]):
        raise UsageError(
            f"--dataset={c['dataset']} is a file: give the folder holding train.bin and val.bin "
            "(or the .npy shards), or a name under data/"
        )


def check_model(c):
    """The model's own checks: arch (and its bias), n_embd % n_head, gelu, attention; remat,
    loss_chunk; then the optimizer's, which depend on the arch."""
    try:
        check_memory_settings(c["remat"], c["loss_chunk"])
        shape = ("arch", "bias", "n_layer", "n_head", "n_embd", "block_size", "gelu", "attention")
        owned = ("fp8_head", "window_size", "embed_dtype", "n_kv_head", "window_pattern")
        config = {k: c[k] for k in (*shape, *owned)}
        models.check_config(GPTConfig(**config))
    except ValueError as e:
        raise UsageError(str(e)) from None
    # a logit's gradient is at most 1 / the tokens of the loss's mean; times the record's 2^29 it
    # must stay below e5m2's largest, 57344, or the FP8 backward's overflows to inf
    tokens = c["batch_size"] * c["block_size"]
    if c["fp8_head"] and tokens * 57344 < 2**29:
        raise UsageError(
            f"fp8_head scales the logits' gradient by 2^29 (the record's, for its 65,536-token "
            f"micro-batches): a micro-batch of {tokens} tokens would overflow FP8; it needs "
            "batch_size x block_size >= 9363, or fp8_head=False"
        )
    check_optimizer(c)


def check_memory_settings(remat, loss_chunk):
    """ValueError naming the values remat and loss_chunk take ('auto': auto_settings picks), for
    anything else."""
    if remat != "auto" and remat not in REMAT:
        raise ValueError(
            f"remat must be 'auto' or one of {', '.join(map(repr, REMAT))}, got {remat!r}"
        )
    if loss_chunk != "auto" and not (type(loss_chunk) is int and loss_chunk >= 0):
        raise ValueError(
            f"loss_chunk must be 'auto' or an integer >= 0 (0: no chunks), got {loss_chunk!r}"
        )


def check_optimizer(c):
    """The optimizer's and the schedule's settings."""
    if c["optimizer"] not in OPTIMIZERS:
        raise UsageError(
            "optimizer must be 'adamw' or 'muon' (record 5), 'muon20' (record 20) or 'muonadamw' "
            f"(nanochat), got {c['optimizer']!r}"
        )
    if c["lr_schedule"] not in LR_SCHEDULES:
        raise UsageError(
            "lr_schedule must be 'cosine' or 'trapezoid' (record 5), 'cooldown' (record 20), "
            f"'warmdown' (nanochat) or 'sft' (nanochat's finetuning), got {c['lr_schedule']!r}"
        )
    if not 0 <= c["final_lr_frac"] <= 1:
        raise UsageError(f"final_lr_frac must be in [0, 1], got {c['final_lr_frac']}")
    if not 0 < c["cooldown_frac"] <= 1:
        raise UsageError(
            f"cooldown_frac must be in (0, 1], the fraction of max_iters the cooldown takes, got "
            f"{c['cooldown_frac']}"
        )
    if c["muon_ns_dtype"] not in ("bfloat16", "float32"):
        raise UsageError(
            f"muon_ns_dtype must be 'bfloat16' or 'float32', got {c['muon_ns_dtype']!r}"
        )
    if c["optimizer"] == "muon20":
        check_muon20(c)
    if c["optimizer"] == "muonadamw" and c["lr_schedule"] not in ("warmdown", "sft"):
        raise UsageError(
            "optimizer='muonadamw' takes nanochat's schedule: set --lr_schedule=warmdown "
            f"(pretraining) or sft (finetuning) (got {c['lr_schedule']!r})"
        )
    if c["lr_schedule"] == "sft" and c["optimizer"] != "muonadamw":
        raise UsageError(
            "lr_schedule='sft' is nanochat's finetuning, with its optimizer: set "
            f"--optimizer=muonadamw (got {c['optimizer']!r})"
        )
    if not 0 < c["init_lr_frac"] <= 1 or c["warmup_frac"] + c["cooldown_frac"] > 1:
        raise UsageError(
            f"init_lr_frac must be in (0, 1] and warmup_frac + cooldown_frac at most 1, got "
            f"{c['init_lr_frac']}, {c['warmup_frac']} + {c['cooldown_frac']}"
        )
    if c["lr_schedule"] == "trapezoid" and c["decay_lr"]:
        if c["warmdown_iters"] > c["max_iters"]:
            raise UsageError(
                f"warmdown_iters={c['warmdown_iters']} exceeds max_iters={c['max_iters']}: the "
                "trapezoid's warmdown is the last warmdown_iters iterations; lower --warmdown_iters"
            )
        if c["warmup_iters"] + c["warmdown_iters"] > c["max_iters"]:
            raise UsageError(
                f"warmup_iters={c['warmup_iters']} + warmdown_iters={c['warmdown_iters']} exceed "
                f"max_iters={c['max_iters']}: the trapezoid's ramps overlap; lower one of them"
            )
    models.check_settings(c)  # an optimizer its architecture refuses
    if c["optimizer"] != "muon":
        return
    if c["muon_learning_rate"] <= 0:
        raise UsageError(
            "optimizer='muon' needs --muon_learning_rate > 0 (record 5: 0.1 x learning_rate, "
            "0.00036)"
        )
    if c["lr_schedule"] == "cosine" and c["learning_rate"] <= 0:
        raise UsageError(
            "optimizer='muon' with lr_schedule='cosine' scales Muon's rate as learning_rate's "
            "(muon_learning_rate x get_lr / learning_rate): learning_rate must be > 0"
        )


def check_muon20(c):
    """optimizer='muon20' (record 20's optimizers): its schedule, its rates."""
    if c["lr_schedule"] != "cooldown":
        raise UsageError(
            f"optimizer='muon20' takes record 20's schedule: set --lr_schedule=cooldown (got "
            f"{c['lr_schedule']!r})"
        )
    if c["muon_learning_rate"] <= 0:
        raise UsageError("optimizer='muon20' needs --muon_learning_rate > 0 (record 20: 0.05)")
    if c["weight_decay"]:
        raise UsageError(
            "optimizer='muon20' is record 20's Adam, which has no weight decay: set "
            "--weight_decay=0"
        )


def profile_range(profile):
    """--profile=START:STOP -> (START, STOP), or None for ''."""
    if not profile:
        return None
    try:
        start, stop = (int(part) for part in str(profile).split(":"))
    except ValueError:
        start = stop = -1
    if not 0 <= start < stop:
        raise UsageError(
            "profile must be START:STOP, the iterations to trace (0 <= START < STOP), got "
            f"{profile!r}"
        )
    return start, stop


def resolve_dtype(dtype, platform):
    """A dtype setting ('auto' or one of DTYPES) -> the compute dtype on `platform`
    (sharding.platform_of a mesh): 'auto' is bfloat16 on GPU/TPU, float32 on CPU."""
    if dtype == "auto":
        return "float32" if platform == "cpu" else "bfloat16"
    if dtype not in DTYPES:
        raise UsageError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {dtype!r}")
    return dtype


def resolve_scan_layers(scan_layers, platform, arch="gpt2"):
    """'auto': the blocks under one scan on a TPU, where it compiles one block instead of n_layer
    (gpt2-xl's step for a TPU: docs/benchmarks.md); a Python loop on a GPU, where the 124M step ran
    faster and no larger without the scan (docs/benchmarks.md#on-an-nvidia-h200), and on CPU, whose
    results it keeps bit for bit; and for record 20, whose layers differ."""
    if scan_layers == "auto":
        return platform == "tpu" and models.arch_of(arch).scans
    if not isinstance(scan_layers, bool):
        raise UsageError(f"scan_layers must be True, False or 'auto', got {scan_layers!r}")
    return scan_layers


def fixed_by_checkpoint(c, model_args, typed=()):
    """On resume the checkpoint fixes the model's shape, as nanoGPT's resume does: `c` takes its
    arch, n_layer, n_head, n_embd, vocab_size, bias and gelu, and its block_size unless a shorter
    one is typed. Returns the values `typed` on the command line that asked otherwise (one line
    names them); a config file's values, written for a new run, pass without a word. A longer
    block_size typed cannot be honoured (the position embedding has the checkpoint's rows)."""
    ignored = {}
    model_args = {"arch": "gpt2", **model_args}  # a checkpoint from before arch: GPT-2
    for key in ("arch", "n_layer", "n_head", "n_embd", "vocab_size", "bias", "gelu"):
        asked = c[key] != model_args[key] and not (key == "vocab_size" and c[key] == 0)
        if asked and key in typed:
            ignored[key] = c[key]
        c[key] = model_args[key]
    if "block_size" not in typed:
        c["block_size"] = model_args["block_size"]
    elif c["block_size"] > model_args["block_size"]:
        raise UsageError(
            f"--block_size={c['block_size']} exceeds the checkpoint's {model_args['block_size']} "
            f"(its position embedding's rows): give --block_size={model_args['block_size']} or "
            "less, or leave it out"
        )
    check_model(c)
    return ignored


def accumulation_steps(c, shards):
    """Micro-batches per step on each of the mesh's `shards` batch shards (data x fsdp). With
    total_batch_size (build-nanogpt: fixed tokens per step, whatever the mesh),
    gradient_accumulation_steps is set from it."""
    if c["total_batch_size"] > 0:
        per_step = c["batch_size"] * c["block_size"] * shards
        if c["total_batch_size"] % per_step:
            raise UsageError(
                f"total_batch_size={c['total_batch_size']} is not a multiple of batch_size x "
                f"block_size x batch shards (data x fsdp) = {per_step}: change batch_size"
            )
        c["gradient_accumulation_steps"] = c["total_batch_size"] // per_step * shards
    if c["gradient_accumulation_steps"] % shards:
        raise UsageError(
            f"gradient_accumulation_steps={c['gradient_accumulation_steps']} must be divisible by "
            f"the number of batch shards, data x fsdp = {shards}"
        )
    return c["gradient_accumulation_steps"] // shards
