"""python -m pytest tests/test_auto_settings.py -q

remat and loss_chunk 'auto' (auto_settings): the candidates in their order, an explicit setting
kept, the first candidate whose compiled step fits the device's usable memory with the margin to
spare, the TPU compiler's refusals recorded so that a second start compiles none of them again, and
train.py's start-up line saying what each 'auto' became and why. The real GPUs' and TPUs' choices:
tests/test_gpu.py and tests/test_tpu.py."""

import re

import jax
import pytest
from flax import nnx
from helpers import read_log, run, settings, tiny_config

from compute import accelerators, sharding
from configurator import UsageError
from run import auto_settings, train_step
from run.settings import validate

# a model whose loss chunks (block_size 256 > 128) and whose logits weigh something beside its
# activations
CONFIG = dict(block_size=256, vocab_size=4096, n_layer=2, n_head=2, n_embd=64)
BATCH = (1, 8, 256)


def test_candidates_in_order_and_an_explicit_setting_kept():
    assert auto_settings.candidates("auto", "auto") == list(auto_settings.CANDIDATES)
    assert auto_settings.candidates("auto", "auto")[:3] == [("none", 0), ("dots", 0), ("none", 128)]
    assert auto_settings.candidates("dots", "auto") == [("dots", 0), ("dots", 128)]
    assert auto_settings.candidates("auto", 64) == [
        ("none", 64),
        ("dots", 64),
        ("qkv_proj", 64),
        ("block", 64),
    ]
    assert auto_settings.candidates("block", 0) == [("block", 0)]
    assert auto_settings.first_candidate({"remat": "auto", "loss_chunk": "auto"}) == {
        "remat": "none",
        "loss_chunk": 0,
    }


@pytest.mark.parametrize(
    "remat, loss_chunk, message",
    [
        (
            "fast",
            "auto",
            r"^remat must be 'auto' or one of 'none', 'block', 'dots', 'qkv_proj', got 'fast'$",
        ),
        ("auto", -1, r"^loss_chunk must be 'auto' or an integer >= 0 \(0: no chunks\), got -1$"),
        (
            "auto",
            "big",
            r"^loss_chunk must be 'auto' or an integer >= 0 \(0: no chunks\), got 'big'$",
        ),
        (
            "auto",
            True,
            r"^loss_chunk must be 'auto' or an integer >= 0 \(0: no chunks\), got True$",
        ),
    ],
)
def test_a_bad_setting_is_one_line(remat, loss_chunk, message, dataset, tmp_path):
    c = settings(dataset, tmp_path)
    c.update(remat=remat, loss_chunk=loss_chunk)
    with pytest.raises(UsageError, match=message):
        validate(c)


def state(mesh):
    """(graphdef, abstract params, abstract optimizer state, tx, make_step) of CONFIG's model on
    `mesh`."""
    tx = train_step.make_optimizer({**settings("unused", "unused"), "optimizer": "adamw"})
    graphdef, *abstract = jax.eval_shape(
        lambda: train_step.init_state(tiny_config(**CONFIG), mesh, tx)
    )
    params, opt_state = (sharding.abstract(t, sharding.shardings_for(t, mesh)) for t in abstract)
    make_step = lambda g: train_step.make_train_step(g, tx, grad_clip=1.0)  # noqa: E731
    return graphdef, params, opt_state, make_step


def fitting(mesh, remat="auto", loss_chunk="auto"):
    graphdef, params, opt_state, make_step = state(mesh)
    return auto_settings.compile_fitting(
        make_step,
        graphdef,
        params,
        opt_state,
        BATCH,
        sharding.batch_sharding(mesh),
        remat,
        loss_chunk,
    )


@pytest.mark.slow
def test_the_first_candidate_that_fits_with_the_margin_is_compiled(monkeypatch):
    """Each candidate's peak compiled alone; with a limit that the first's peak (plus the 25%
    margin) exceeds, the chosen one is the first in CANDIDATES' order that fits, and those before it
    are named with their peaks."""
    mesh = sharding.make_mesh()
    first = fitting(mesh)
    # the RAM holds it
    assert (first.config.remat, first.config.loss_chunk) == ("none", 0) and first.tried == []
    peaks = {
        ("none", 0): first.peak,
        **{pair: fitting(mesh, *pair).peak for pair in auto_settings.CANDIDATES[1:3]},
    }
    margin = auto_settings.MARGIN["cpu"]
    assert min(peaks.values()) < peaks["none", 0], peaks
    # what the smallest of the first three needs, and no more
    limit = min(peaks.values()) * (1 + margin)
    fits = [pair for pair in peaks if peaks[pair] * (1 + margin) <= limit]
    monkeypatch.setattr(accelerators, "usable_bytes", lambda device: limit)
    fit = fitting(mesh)
    assert (fit.config.remat, fit.config.loss_chunk) == fits[0]
    assert fit.peak == peaks[fits[0]] and fit.limit == limit and fit.step is not None
    passed = auto_settings.CANDIDATES[: auto_settings.CANDIDATES.index(fits[0])]
    assert fit.tried == [(*pair, peaks[pair]) for pair in passed]
    # nothing fits: the last candidate, whose peak the caller refuses
    monkeypatch.setattr(accelerators, "usable_bytes", lambda device: 1)
    fit = fitting(mesh, remat="block")
    assert (fit.config.remat, fit.config.loss_chunk) == ("block", 128) and fit.peak > fit.limit
    assert [pair[:2] for pair in fit.tried] == [("block", 0)]


@pytest.mark.slow
def test_a_refusal_is_recorded_and_not_compiled_again(tmp_path, monkeypatch):
    """The TPU compiler refuses a step that does not fit, and JAX caches no failed compile: the
    refusal goes into a record, and a second start skips that candidate without compiling it (here
    the first candidate refused as a TPU's compiler would, on the CPU)."""
    record = auto_settings.RefusalRecord(
        str(tmp_path / "cache" / auto_settings.REFUSALS), "a TPU 1234"
    )
    monkeypatch.setattr(auto_settings, "refusal_record", lambda device: record)
    compiled, lower = [], auto_settings.lower_step

    class Refusing:
        def __init__(self, lowered, refuse):
            self.lowered, self.refuse = lowered, refuse

        def as_text(self):
            return self.lowered.as_text()

        def compile(self, options=None):
            compiled.append(self.refuse)
            if self.refuse:
                raise jax.errors.JaxRuntimeError(
                    "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of "
                    "memory in memory space hbm. Used 20.00G of 15.75G hbm."
                )
            return self.lowered.compile(options)

    def lower_step(step, *args):
        lowerings.append(step)
        # each start's first candidate
        return Refusing(lower(step, *args), refuse=len(lowerings) == 1)

    monkeypatch.setattr(auto_settings, "lower_step", lower_step)
    mesh, lowerings, G = sharding.make_mesh(), [], 2**30
    for start in (1, 2):
        lowerings.clear()
        compiled.clear()
        fit = fitting(mesh)
        assert (fit.config.remat, fit.config.loss_chunk) == auto_settings.CANDIDATES[1]
        assert fit.tried == [("none", 0, 20 * G)] and fit.limit == 15.75 * G
        # the second: no refused compile
        assert compiled == ([True, False] if start == 1 else [False]), start


@pytest.mark.slow
def test_train_says_what_each_auto_became(dataset, tmp_path, capsys):
    """train.py's start-up line, on the CPU: what every 'auto' setting became and why; an explicit
    setting is kept and not named. The log's start record holds the same line."""
    trainer = run(dataset, tmp_path / "auto", "--attention=auto", "--max_iters=1")
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("auto settings:"))
    assert re.fullmatch(
        r"auto settings: attention=xla, scan_layers=off, remat=none, loss_chunk=0 \(step peak "
        r"\d+\.\d\d of \d+\.\d\d GiB usable on cpu, \+25% margin\)",
        line,
    ), line
    assert (trainer.model_config.remat, trainer.model_config.loss_chunk) == ("none", 0)
    # the run's settings as compiled, not 'auto': what the log and the checkpoint's meta record
    assert (trainer.c["remat"], trainer.c["loss_chunk"]) == ("none", 0)
    [(_, config)] = read_log(tmp_path / "auto", "config")
    assert (config["remat"], config["loss_chunk"], config["max_iters"]) == ("none", 0, 1)
    trainer = run(
        dataset,
        tmp_path / "explicit",
        "--remat=block",
        "--loss_chunk=8",
        "--scan_layers=False",
        "--max_iters=1",
    )
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("auto settings:"))
    assert re.fullmatch(r"auto settings: attention=xla \(step peak .*\)", line), line
    assert (trainer.model_config.remat, trainer.model_config.loss_chunk) == ("block", 8)
    assert (
        trainer.c["remat"] == "block"
        and nnx.merge(trainer.graphdef, trainer.params).config.remat == "block"
    )
