"""python -m pytest tests/test_architectures.py -q

An architecture answers its own questions (archs/arch.py, docs/model.md): a stand-in architecture,
registered in one line, trains a step through train.py's own code path, and what it answers
(its step's and eval's inputs, its kernel, the settings it refuses, its export formats) is what the
run and the export take.
"""

import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import read_log, run, settings

from archs import models
from archs.arch import Arch
from compute.layers import mean_of
from configurator import UsageError
from dataio import weights
from model import GPT, GPTConfig
from run.settings import validate

ASKED = []  # what the stand-in was asked, in order, as its answers record it


class StandInGPT(GPT):
    """GPT-2 whose loss takes an input of its own: a factor on its logits, a different one at
    each step."""

    arch = "standin"
    title = "a stand-in"
    exports = ("hf",)

    def loss(self, idx, targets, *, key=None, logit_scale=None):
        ASKED.append(("loss", logit_scale is not None))
        _, x = self.hidden_states(idx, key)
        return mean_of(*self.loss_terms(x * logit_scale, targets))


class StandIn(Arch):
    model = StandInGPT
    own_optimizers = {"standin_sgd": "the stand-in's"}

    @classmethod
    def check_settings(cls, c):
        if c["grad_clip"] == 0.0:
            raise UsageError("the stand-in clips its gradients: set --grad_clip > 0")

    @classmethod
    def kernel(cls, config, device):
        ASKED.append(("kernel", device.platform))
        return "xla"

    @classmethod
    def step_inputs(cls, c, sequences):
        return dict(inputs=lambda count: {"logit_scale": 1.0 + count / 8}, grad_scale=1.0)

    @classmethod
    def eval_inputs(cls, it, c):
        return {"logit_scale": jnp.float32(1.0 + it / 8)}


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setitem(models.ARCHS, "standin", StandIn)  # the one registry line
    ASKED.clear()


def test_a_stand_in_architecture_trains_a_step_through_train_py(stand_in, dataset, tmp_path):
    out = tmp_path / "out"
    run(dataset, out, "--arch=standin", "--max_iters=1", "--eval_interval=1")
    [(it, loss)] = read_log(out, "loss")
    assert it == 0 and 0 < loss < 10
    # its loss took its inputs (traced for the step and the eval; never without them), and its
    # kernel is the one the start-up line names
    assert ("loss", True) in ASKED and ("loss", False) not in ASKED
    assert ("kernel", "cpu") in ASKED
    assert read_log(out, "val_loss")


def test_a_stand_in_refuses_its_own_settings_and_others_refuse_its_optimizer(
    stand_in, dataset, tmp_path
):
    with pytest.raises(UsageError, match="the stand-in clips its gradients: set --grad_clip > 0"):
        validate(settings(dataset, tmp_path, "--arch=standin", "--grad_clip=0.0"))
    with pytest.raises(
        ValueError, match="arch must be 'gpt2', 'speedrun', 'speedrun20', 'nanochat' or "
    ):
        models.arch_of("llama")
    # another architecture's own setting, here and for the stand-in
    with pytest.raises(UsageError, match="^window_size is record 20's attention window: it needs"):
        validate(settings(dataset, tmp_path, "--arch=standin", "--window_size=256"))
    c = dict(settings(dataset, tmp_path), optimizer="standin_sgd")
    with pytest.raises(UsageError, match="^optimizer='standin_sgd' is the stand-in's: use it with"):
        models.check_settings(c)


def test_a_models_export_formats_are_its_own(stand_in):
    config = GPTConfig(arch="standin", n_layer=1, n_embd=32, n_head=2, block_size=8, vocab_size=64)
    model = models.build(config, nnx.Rngs(0))
    weights.check_export(model, "hf")
    with pytest.raises(UsageError, match=r"^--format=nanogpt cannot hold this model, arch='st"):
        weights.check_export(model, "nanogpt")
    names = [hf for hf, _, _ in model.weight_rows()]
    assert names[:2] == ["transformer.wte.weight", "transformer.wpe.weight"]


def test_gpt2s_kernel_is_the_one_attention_picks_for_the_device_compiled_for():
    """Arch.kernel, the start-up line's attention: on a TPU v5e (libtpu's compile-only device),
    splash where the head fits its kernel, xla where the head is wider than 256."""
    from archs.arch import GPT2
    from compute import accelerators

    v5e = accelerators.topology_devices("v5e:2x2")[0]
    fits = GPTConfig(block_size=512, n_embd=256, n_head=2)  # a head of 128
    wide = GPTConfig(block_size=512, n_embd=1024, n_head=2)  # a head of 512
    assert GPT2.kernel(fits, v5e) == "splash" and GPT2.kernel(wide, v5e) == "xla"
