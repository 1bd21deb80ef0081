"""
python -m pytest -q tests/test_resume.py

--init_from=resume as nanoGPT's: the checkpoint gives the model's shape and its block_size. A config
file's values (written for a new run) pass without a word; a value typed on the command line that
differs is named in one line and ignored; a longer block_size typed is refused before anything is
written, a shorter one honoured.
"""

import shutil

import pytest
from helpers import TINY, snapshot

import train
from configurator import UsageError, command_line_keys, configure
from run.settings import DEFAULTS

CONFIG = "config/train_shakespeare_char.py"  # nanoGPT's baby GPT: 6 x 6 x 384, block 256


@pytest.fixture(scope="module")
def shaped_run(dataset, tmp_path_factory):
    """The config file's run with its shape overridden on the command line: 2 x 2 x 32, block 32."""
    out = tmp_path_factory.mktemp("shaped") / "out"
    trainer([CONFIG, *TINY, "--block_size=32", *where(dataset, out), "--eval_interval=4"]).run()
    return out


@pytest.fixture
def run_dir(shaped_run, tmp_path):
    """A copy of shaped_run's out_dir, for one test to resume."""
    return shutil.copytree(shaped_run, tmp_path / "out")


def where(dataset, out):
    return [f"--dataset={dataset}", f"--out_dir={out}"]


def trainer(argv):
    """train.main's Trainer, without its process set-up."""
    return train.Trainer(configure(DEFAULTS, argv), typed=command_line_keys(argv))


# what a resume types besides the config file: small batches, short evals
RESUME = ["--init_from=resume", "--batch_size=4", "--eval_iters=2", "--max_iters=6"]


@pytest.mark.slow
def test_resume_with_the_config_file_takes_the_checkpoints_shape(dataset, run_dir, capsys):
    capsys.readouterr()
    t = trainer([CONFIG, *RESUME, *where(dataset, run_dir)])
    shape = {k: getattr(t.model_config, k) for k in ("n_layer", "n_head", "n_embd", "block_size")}
    assert shape == {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}
    assert t.c["block_size"] == 32 and t.tokens_per_iter == 4 * 32
    t.run()
    assert t.iter_num == 6
    # the config file's 6 x 6 x 384 and block 256 were never typed: no word of them
    assert not [x for x in capsys.readouterr().out.splitlines() if x.startswith("resume")]


@pytest.mark.slow
def test_resume_names_only_what_was_typed(dataset, run_dir, capsys):
    """Through train.main: --n_layer=6 differs from the checkpoint's 2 and is named; --n_embd=32
    agrees with it; the config file's n_head=6 and block_size=256 pass without a word."""
    capsys.readouterr()
    train.main([CONFIG, *RESUME, *where(dataset, run_dir), "--n_layer=6", "--n_embd=32"])
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("resume")]
    assert lines == ["resume: the checkpoint fixes n_layer=2; ignored --n_layer=6"]


@pytest.mark.slow
def test_a_longer_block_size_typed_is_refused_before_anything_is_written(dataset, run_dir):
    before = snapshot(run_dir)
    with pytest.raises(UsageError) as e:
        trainer([CONFIG, *RESUME, *where(dataset, run_dir), "--block_size=64"])
    assert str(e.value) == (
        "--block_size=64 exceeds the checkpoint's 32 (its position embedding's rows): "
        "give --block_size=32 or less, or leave it out"
    )
    assert snapshot(run_dir) == before


@pytest.mark.slow
def test_a_shorter_block_size_typed_trains_on_shorter_windows(dataset, run_dir):
    t = trainer([CONFIG, *RESUME, *where(dataset, run_dir), "--block_size=16"])
    assert t.c["block_size"] == 16 and t.tokens_per_iter == 4 * 16
    assert t.model_config.block_size == 32  # the position embedding keeps its rows
    t.run()
    assert t.iter_num == 6
