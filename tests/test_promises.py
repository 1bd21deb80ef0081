"""python -m pytest tests/test_promises.py -q

What the README and docs promise of train.py, each with a test that fails without it: a finetune
starts from the weights it names (an HF directory, a nanoGPT ckpt.pt: its first logged loss is the
source model's, computed by transformers or nanoGPT's torch model on the same batch); a step that
needs more device memory than the device has is refused before step 0, in one line; and `make
shakespeare`'s val loss (slow: a golden run of 2000 steps)."""

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import XLA_FLAGS_OUTSIDE
from helpers import REPO, random_nanogpt, read_log, settings

import train
from compute import accelerators
from configurator import UsageError
from dataio.weights import load_hf_model
from parity import nanogpt_reference as nanogpt
from parity.common import save_random_hf_model
from parity.train_report import LOSS_TOL


def first_step(dataset, out_dir, *extra):
    """A one-step run: (the trainer, the first batch its step took (x, y), each (accum, B, T), the
    first logged loss). The batch is recorded as the run's own loader hands it over."""
    t = train.Trainer(settings(dataset, out_dir, "--max_iters=1", *extra))
    batches, read = [], t.train_loader.next
    t.train_loader.next = lambda accum: batches.append(read(accum)) or batches[-1]
    t.run()
    [(it, loss)] = read_log(out_dir, "loss")
    assert it == 0
    return t, batches[0], loss


def torch_batch(batch):
    x, y = batch
    assert x.shape[0] == 1  # one micro-batch: the logged loss is this batch's mean
    return torch.from_numpy(x[0].astype(np.int64)), torch.from_numpy(y[0].astype(np.int64))


def test_finetune_from_an_hf_directory_starts_from_its_weights(dataset, tmp_path):
    """init_from=DIR: the model cropped to the run's block_size, and step 0's loss is the loss
    transformers' own GPT2LMHeadModel, loaded from the directory by transformers, gives the same
    batch (fp32 both: check_train's loss tolerance). A run that started from random weights of the
    same shape (train.py passing weights=None to init_state) fails it by orders of magnitude."""
    path = save_random_hf_model(
        tmp_path / "hf", n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=64
    )
    t, batch, loss = first_step(dataset, tmp_path / "out", f"--init_from={path}")
    # cropped to the run's block_size
    assert t.model_config.block_size == 16 and t.model_config.n_embd == 32
    x, y = torch_batch(batch)
    with torch.no_grad():
        logits = load_hf_model(str(path))(x).logits  # (B, T, vocab), positions 0..15 of its 32
    reference = F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    assert abs(loss - reference) <= LOSS_TOL * reference, (loss, reference)


# make test-slow (CI runs it): the same claim from a second source. make test holds a finetune from
# an HF folder starting from its weights (above), and a nanoGPT ckpt.pt read as nanoGPT's own model
# reads it (test_hellaswag.py's parity check, which fails when our reader's layout is wrong)
@pytest.mark.slow
def test_finetune_from_a_nanogpt_ckpt_starts_from_its_weights(dataset, tmp_path):
    """init_from=.../ckpt.pt, as nanoGPT's train.py writes it: step 0's loss is the one nanoGPT's
    own model (torch, parity/nanogpt_reference.py) computes on the same batch."""
    ref = random_nanogpt(seed=5)
    nanogpt.save_ckpt(ref, tmp_path / "ckpt.pt")
    t, batch, loss = first_step(dataset, tmp_path / "out", f"--init_from={tmp_path / 'ckpt.pt'}")
    assert t.model_config.gelu == "exact" and t.model_config.n_embd == 48
    with torch.no_grad():
        reference = ref(*torch_batch(batch))[1].item()  # nanoGPT's forward: (logits, cross-entropy)
    assert abs(loss - reference) <= LOSS_TOL * reference, (loss, reference)


@pytest.mark.slow
def test_a_step_larger_than_the_device_is_refused_before_step_0(dataset, tmp_path, monkeypatch):
    """train.py compiles its step before step 0 and compares XLA's peak for it with the device's
    memory (accelerators.usable_bytes: a GPU's or TPU's bytes_limit, a CPU device's share of the
    RAM; the test sets one). One byte short of the peak of the settings asked for: refused in one
    line naming the fixes, and nothing of the run written (the out_dir holds only the lock, taken
    before the model is built so that a second run is refused at once, and let go of when the start
    fails). With loss_chunk 'auto', a device too small for every candidate is refused alike."""
    explicit = ("--remat=block", "--loss_chunk=8")
    fits = train.Trainer(settings(dataset, tmp_path / "fits", *explicit))
    fits.lock.close()
    peak = fits.step_peak_bytes
    assert peak > 0
    # loss_chunk 'auto'
    for limit, out, extra in ((peak - 1, "out", explicit), (1, "auto", ("--remat=block",))):
        monkeypatch.setattr(accelerators, "usable_bytes", lambda device: limit)
        with pytest.raises(UsageError) as refused:
            train.Trainer(settings(dataset, tmp_path / out, *extra))
        message = str(refused.value)
        assert re.fullmatch(
            r"the train step needs \d+\.\d\d GiB per device, the device has \d+\.\d\d GiB: lower "
            r"--batch_size .* or raise --fsdp / --tensor_parallel",
            message,
        ), message
        assert os.listdir(tmp_path / out) == ["run.lock"]
    # the failed start let go of out_dir's lock (its exception, still held, keeps the Trainer
    # alive): a second start in the same process, on a device that holds the step, runs there
    monkeypatch.setattr(accelerators, "usable_bytes", lambda device: None)
    train.Trainer(settings(dataset, tmp_path / "auto")).lock.close()
    assert refused.value.__traceback__ is not None


# README.md's `make shakespeare` output, the last eval of the Makefile's run (docs/benchmarks.md:
# the same in every run, fresh clones included)
SHAKESPEARE_LAST_EVAL = "step 2000: train loss 1.7774, val loss 1.9152"


@pytest.mark.slow
def test_make_shakespeare_reaches_its_documented_val_loss(tmp_path):
    """The Makefile's shakespeare target (prepare, then train.py with its overrides; about 75 s on 2
    cores), on a copy of the bundled corpus, compiled at XLA's defaults as users run it (the suite's
    quick compilation differs in the last bits, which 2000 steps amplify): its last eval line, to
    the 4 decimals printed, is the README's."""
    data = tmp_path / "shakespeare_char"
    data.mkdir()
    for f in ("prepare.py", "input.txt"):
        shutil.copy(os.path.join(REPO, "data", "shakespeare_char", f), data / f)
    env = {**os.environ, "XLA_FLAGS": XLA_FLAGS_OUTSIDE}
    subprocess.run(
        [sys.executable, str(data / "prepare.py")], check=True, capture_output=True, env=env
    )
    makefile = open(os.path.join(REPO, "Makefile")).read()
    # the target's train.py arguments, from the Makefile itself: a changed recipe is a changed
    # golden value
    recipe = re.search(
        r"shakespeare: venv\n.*\n\t\$\(BIN\)/python train\.py (.*?)\n\t\$\(BIN\)/python sample",
        makefile,
        re.S,
    )[1]
    args = recipe.replace("\\\n", " ").split()
    r = subprocess.run(
        [sys.executable, "train.py", *args, f"--dataset={data}", f"--out_dir={tmp_path / 'out'}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert SHAKESPEARE_LAST_EVAL in r.stdout.splitlines(), r.stdout[-3000:]
