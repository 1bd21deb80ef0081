"""
The runs bench/train.py measures a step of, by name (--preset): each a model's shape, the settings
that choose its optimizer and, in PRESET_CONFIGS, the config file whose remat, loss_chunk and
scan_layers it takes unless given. nanochat's presets are its config files themselves, their shape
and rates from its depth dial as train.py resolves them (nanochat_settings).
"""

from configurator import configure

PRESETS = {
    "baby": dict(block_size=64, batch_size=12, n_layer=4, n_head=4, n_embd=128, vocab_size=65),
    "gpt2": dict(
        block_size=1024, batch_size=16, n_layer=12, n_head=12, n_embd=768, vocab_size=50304
    ),
    # finetuning HF's gpt2-xl (its vocabulary, unpadded)
    "gpt2-xl": dict(
        block_size=1024, batch_size=1, n_layer=48, n_head=25, n_embd=1600, vocab_size=50257
    ),
    # the tests' (tests/test_tpu.py): block 128, as a TPU attention kernel's blocks take
    "tiny": dict(block_size=128, batch_size=2, n_layer=2, n_head=2, n_embd=64, vocab_size=128),
    # modded-nanogpt's record 5 (config/speedrun_gpt2.py): its architecture, Muon on the blocks,
    # Adam on the rest
    "speedrun": dict(
        block_size=1024,
        batch_size=64,
        n_layer=12,
        n_head=6,
        n_embd=768,
        vocab_size=50304,
        arch="speedrun",
        optimizer="muon",
        muon_learning_rate=0.00036,
        lr_schedule="trapezoid",
        warmdown_iters=1450,
        max_iters=5100,
    ),
    # record 20 (config/speedrun20_gpt2.py): one 64K-token sequence per device
    "speedrun20": dict(
        block_size=65536,
        batch_size=1,
        n_layer=12,
        n_head=6,
        n_embd=768,
        vocab_size=50257,
        arch="speedrun20",
        fp8_head=True,
        embed_dtype="bfloat16",
        optimizer="muon20",
        muon_learning_rate=0.05,
        lr_schedule="cooldown",
        max_iters=1393,
        beta1=0.8,
        weight_decay=0.0,
    ),
    # nanochat's base_train at its defaults (config/nanochat.py: d20) and the leaderboard's
    # GPT-2-grade d24 (with config/nanochat_gpt2.py), at base_train's device batch of 32 x 2048 and
    # its tokenizer's 32,768 ids: the rest is the configs' (nanochat_settings)
    "nanochat": dict(batch_size=32, vocab_size=32768),
    "nanochat-gpt2": dict(batch_size=32, vocab_size=32768),
}
# remat, loss_chunk and scan_layers unless given: the run each preset stands for (nanochat's: its
# whole run, NANOCHAT)
PRESET_CONFIGS = {
    "baby": "config/train_shakespeare_char.py",
    "gpt2": "config/train_gpt2.py",
    "gpt2-xl": "config/finetune_shakespeare.py",
    "tiny": "config/train_shakespeare_char.py",
    "speedrun": "config/speedrun_gpt2.py",
    "speedrun20": "config/speedrun20_gpt2.py",
    "nanochat": "config/nanochat.py",
    "nanochat-gpt2": "config/nanochat.py config/nanochat_gpt2.py",
}
NANOCHAT = ("nanochat", "nanochat-gpt2")
# the settings of a nanochat run a step's model (GPTConfig) and optimizer (muonadamw) read
NANOCHAT_KEYS = (
    "arch",
    "block_size",
    "n_layer",
    "n_head",
    "n_embd",
    "n_kv_head",
    "window_pattern",
    "optimizer",
    "learning_rate",
    "embed_learning_rate",
    "scalar_learning_rate",
    "muon_learning_rate",
    "weight_decay",
    "lr_schedule",
    "max_iters",
    "warmup_iters",
    "cooldown_frac",
    "final_lr_frac",
)


def config_files(preset):
    return PRESET_CONFIGS[preset].split()


def nanochat_settings(preset):
    """A nanochat preset's shape and optimizer settings: its config files' run, dialed by depth as
    train.py dials it (Arch.dial: width, heads, horizon, batch, rates, weight decay) for its
    tokenizer's vocabulary. Dialed at one row a device, which divides any batch the rule gives: a
    step here is one micro-batch (base_train's accumulation up to its total batch holds nothing more
    in memory), and the rates and horizon do not depend on the rows."""
    from archs import models
    from run.settings import DEFAULTS

    c = configure(DEFAULTS, config_files(preset))
    vocab_size = PRESETS[preset]["vocab_size"]
    dialed = dict(c, batch_size=1)
    models.arch_of(c["arch"]).dial(dialed, vocab_size, 1)
    return {k: dialed[k] for k in NANOCHAT_KEYS}
