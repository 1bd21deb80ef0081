"""
What the rest of the project asks an architecture, answered by the architecture (docs/model.md):
`Arch` is the interface with the answers most architectures share, `GPT2` GPT-2's (model.py); each
other architecture's module subclasses Arch with its own (archs/record5.py, archs/record20.py).
archs/models.py registers each by its GPTConfig.arch; train.py, the train step, settings, auto
settings and the parity checks ask the registered Arch and never compare arch names. What a file
format asks of a model's weights the model itself answers (model.py's GPT: title, exports,
weight_rows), since dataio/ sits below this room.
"""

from compute import attention
from configurator import UsageError
from model import GPT


class Arch:
    """The questions, with the answers most architectures share; a subclass overrides those that
    differ and names its `model`."""

    model: type  # its nnx module: build, from_state, loss, decode, flops (docs/model.md)
    # GPTConfig fields only this architecture takes, {field: what it is ("record 20's FP8
    # head")}: another arch given one off its default is refused in one line (models.check_config)
    own_settings = {}
    # the optimizers only this architecture trains with, {optimizer: whose it is and what it
    # steps}: refused for the others (models.check_settings)
    own_optimizers = {}
    # train.py's settings only this architecture reads, {setting: (its value when off, what it
    # is)}: refused for the others when on (models.check_settings)
    own_run_settings = {}
    scans = True  # its blocks can run under one lax.scan: scan_layers='auto' scans on a TPU
    loader = {}  # make_loader's keywords for its training data (record 20: its own batches)

    @classmethod
    def dial(cls, c, vocab_size, shards):
        """The settings of a run (train.py's `c`) this architecture derives from others, set in `c`
        before its model is built (nanochat's depth: its shape, horizon, batch and rates), given
        the model's vocab_size and the mesh's batch shards; lines saying what they became, or
        None. Most: none."""
        return None

    @classmethod
    def check_settings(cls, c):
        """A one-line UsageError for a setting of a run (train.py's `c`) that this architecture
        refuses beyond its GPTConfig's (model.check_config) and the settings others own."""

    @classmethod
    def check_run(cls, config, device):
        """A one-line UsageError if config.attention cannot run on `device`'s kind, before
        anything is written."""
        attention.check_run(config, device)

    @classmethod
    def kernel(cls, config, device):
        """The attention kernel the training step runs at block_size on `device` (the start-up
        line's name for it)."""
        return attention.choose(
            config.attention,
            platform=device.platform,
            dtype=config.dtype,
            seq_len=config.block_size,
            head_size=config.n_embd // config.n_head,
            capability=attention.cuda_capability(device),
            device_kind=device.device_kind,
        )

    @classmethod
    def step_inputs(cls, c, sequences):
        """make_train_step's arguments for a run of `c` beyond the generic ones: `inputs`, the
        loss's keywords at each step's count (a function of it, traced), and `grad_scale`, what
        the mean gradient is multiplied by. `sequences`: a device's sequences a step. GPT-2:
        none."""
        return {}

    @classmethod
    def eval_inputs(cls, it, c):
        """The loss's keywords for an eval at iteration `it` of a run of `c`. GPT-2: none."""
        return {}


class GPT2(Arch):
    model = GPT

    @classmethod
    def dial(cls, c, vocab_size, shards):
        """The settings of a run (train.py's `c`) this architecture derives from others, set in `c`
        before its model is built (nanochat's depth: its shape, horizon, batch and rates), given
        the model's vocab_size and the mesh's batch shards; lines saying what they became, or
        None. Most: none."""
        return None

    @classmethod
    def check_settings(cls, c):
        if c["optimizer"] == "muon":
            raise UsageError(
                "optimizer='muon' steps the blocks' matrices only, and GPT-2's blocks also hold "
                "biases and LayerNorm weights: use it with --arch=speedrun (or --optimizer=adamw)"
            )
