"""python -m pytest tests/test_chat_rl.py -q

nanochat's RL on GSM8K (scripts/chat_rl.py): our step (archs/nanochat_rl.py) against the torch
reference written from reading it (parity/chat_rl_reference.py) on a tiny nanochat GPT of random
weights (3 layers, width 32, 200 ids) and fixed samples (sequences, masks, rewards: the sampling is
out of it), float32: 2 steps of 2 questions x 4 samples in micro-batches of 2 (the second step at
half the rate), every micro-batch's loss, the advantages and every tensor after the steps; the
slips parity/check_chat_rl.py offers caught; the batch's padding, targets and advantages worked by
hand; the command's settings refused in one line. Slow: a schedule slip the weights alone catch;
run.chat_rl as a user runs it on a tiny checkpoint (its engine sampling, pass@k, its chatrl
checkpoint), and its steps equal to the check's on the samples it drew. With
NANOCHAT_CHECKOUT=/path/to/nanochat (slow): python -m parity.check_chat_rl --own against
nanochat's own scripts/chat_rl.py."""

import json
import os

import numpy as np
import pytest
from helpers import exit_line, one_torch_thread

from archs import nanochat_rl
from parity import check_chat_rl as check
from parity.common import pin_numerics
from run import chat_rl


@pytest.fixture(scope="module", autouse=True)
def numerics():
    pin_numerics()
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def tiny():
    """(nanochat's state dict of a random tiny GPT, 2 steps of fixed samples, both sides' results
    and the figures of ours against the reference)."""
    state, plan = check.random_state(0), check.random_questions(1)
    length = check.TINY["sequence_len"]
    ours = check.our_steps(check.TINY, state, plan, check.PAD, length=length)
    theirs = check.reference_steps(check.TINY, state, plan, check.PAD)
    start = {k: v.astype(np.float64) for k, v in state.items()}
    return state, plan, ours, theirs, check.compare(ours, theirs, start)


def test_step_equals_reference(tiny):
    _, plan, ours, theirs, figures = tiny
    n = sum(len(s) // check.ROWS for questions in plan for s, _, _ in questions)
    assert len(ours[0]) == len(theirs[0]) == n == 8
    # the loss: 1e-6 relative (check.LOSS_RTOL: ~1e-7 of rounding on each side); a question of
    # all-equal rewards has advantages 0 and a loss of exactly 0 on both sides
    assert figures["loss_rel"] <= check.LOSS_RTOL, figures["loss_rel"]
    assert [loss == 0 for loss in ours[0]] == [loss == 0 for loss in theirs[0]]
    assert any(loss == 0 for loss in ours[0]) and any(loss != 0 for loss in ours[0])
    assert figures["same_advantages"]  # bitwise: rewards - their float32 mean on both sides
    assert len(figures["tensors"]) == len(theirs[2])
    for name, (diff, tol, moved, _, _) in figures["tensors"].items():
        assert moved > 0, f"{name} did not move: the test would not see a slip in its update"
        assert diff <= tol, f"{name}: {diff:.3g} > {tol:.3g} (moved {moved:.3g})"


@pytest.mark.parametrize("slip", sorted(check.SLIPS))
def test_slip_caught(tiny, slip):
    """Ours with a slip against the same reference: the check fails (it compiles nothing new)."""
    state, plan, _, theirs, _ = tiny
    length = check.TINY["sequence_len"]
    slipped = check.our_steps(check.TINY, state, plan, check.PAD, slip=slip, length=length)
    start = {k: v.astype(np.float64) for k, v in state.items()}
    figures = check.compare(slipped, theirs, start)
    assert not check.within(figures, len(slipped[0]), len(theirs[0]))
    assert figures["loss_rel"] > 0.1  # the loss itself shows it, not only the weights


@pytest.mark.slow  # a second optimizer: a compilation of its own
def test_schedule_slip_caught_by_the_weights(tiny):
    """The rate's schedule over 4 steps where the run has 2 (step 1 at 3/4 of the rate, not 1/2):
    the losses cannot see it (step 1's are taken before its update), the tensors do."""
    state, plan, _, theirs, _ = tiny
    length = check.TINY["sequence_len"]
    slipped = check.our_steps(check.TINY, state, plan, check.PAD, num_steps=4, length=length)
    start = {k: v.astype(np.float64) for k, v in state.items()}
    figures = check.compare(slipped, theirs, start)
    assert figures["loss_rel"] <= check.LOSS_RTOL
    beyond = [name for name, t in figures["tensors"].items() if t[0] > t[1]]
    assert len(beyond) == len(figures["tensors"]), sorted(set(figures["tensors"]) - set(beyond))


def test_rollout_batch_by_hand():
    """get_batch's padding (with <|assistant_end|>, mask 0), inputs, targets (-1 on the prompt,
    the forced tokens and the padding) and advantages, worked by hand."""
    pad = 9
    sequences = [[1, 2, 3, 4, 5], [1, 2, 6]]
    masks = [[0, 0, 1, 0, 1], [0, 0, 1]]
    inputs, targets = nanochat_rl.rollout_batch(sequences, masks, pad)
    np.testing.assert_array_equal(inputs, [[1, 2, 3, 4], [1, 2, 6, 9]])
    np.testing.assert_array_equal(targets, [[-1, 3, -1, 5], [-1, 6, -1, -1]])
    inputs, targets = nanochat_rl.rollout_batch(sequences, masks, pad, length=7)  # a bucket
    np.testing.assert_array_equal(inputs[1], [1, 2, 6, 9, 9, 9])
    np.testing.assert_array_equal(targets[0], [-1, 3, -1, 5, -1, -1])
    np.testing.assert_array_equal(
        nanochat_rl.advantages([1.0, 0.0, 0.0, 1.0]), [0.5, -0.5, -0.5, 0.5]
    )
    np.testing.assert_array_equal(nanochat_rl.advantages([1.0, 1.0]), [0.0, 0.0])
    with pytest.raises(ValueError, match="shorter than a sample"):
        nanochat_rl.rollout_batch(sequences, masks, pad, length=4)
    # the schedule: 1 - step / num_steps
    assert [float(nanochat_rl.lr_multiplier(i, 4)) for i in range(4)] == [1.0, 0.75, 0.5, 0.25]


@pytest.mark.parametrize(
    "argv, words",
    [
        ([], "give --init_from=DIR"),
        (["--init_from=x", "--num_samples=12"], "must be a multiple of device_batch_size"),
        (["--init_from=x", "--examples_per_step=0"], "examples_per_step must be an integer >= 1"),
        (["--init_from=x", "--temperature=-1"], "temperature must be >= 0"),
        (["--init_from=x", "--dtype=float16"], "dtype must be"),
        (["--init_from=x", "--dataset=/nonexistent"], "has no folder gsm8k"),
    ],
)
def test_bad_settings_are_one_line(argv, words, capsys):
    code, line = exit_line(lambda: chat_rl.main(argv), capsys)
    assert code == 2 and line.startswith("error: ") and words in line


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        from configurator import exit_on_bad_input

        exit_on_bad_input(lambda: chat_rl.main(["--help"]))
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--examples_per_step=16" in out and "--init_lr_frac=0.05" in out


# --- the command, as a user runs it


@pytest.fixture(scope="module")
def command_setup(tmp_path_factory):
    """A tiny nanochat checkpoint (our random tiny GPT saved as nanochat's), a tokenizer and GSM8K
    rows (dataio/toy_tasks.py: 4 train questions)."""
    from archs.nanochat import NanochatGPT
    from dataio import toy_tasks
    from dataio.chat_tokenizer import ChatTokenizer
    from dataio.nanochat_checkpoint import save_nanochat

    folder = tmp_path_factory.mktemp("rl")
    base = folder / "base"
    toy_tasks.write_task_cache(str(base), {"smoltalk": 1, "mmlu": 1, "gsm8k": 4})
    texts = [f"{a} boxes of {b} apples #### {a * b}" for a in range(2, 10) for b in range(2, 10)]
    tokenizer = ChatTokenizer.train(iter(texts), 300)
    tokenizer.save(str(base / "tokenizer"))
    config = {**check.TINY, "sequence_len": 128, "vocab_size": tokenizer.n_vocab}
    state = check.random_state(0, config)
    start = base / "chatsft_checkpoints" / "d3"
    save_nanochat(NanochatGPT.from_nanochat(config, state), str(start), 0, {})
    return folder, base, start, config, state


@pytest.mark.slow
def test_command(command_setup, capsys, monkeypatch):
    """run.chat_rl on the tiny checkpoint with its engine's samples recorded: 2 steps, pass@k at
    step 0, its chatrl checkpoint; the weights it saves equal the check's steps on the same
    samples (the loop's order of questions, micro-batches, normaliser and schedule)."""
    import torch

    from dataio.chat_tokenizer import ChatTokenizer
    from dataio.conversations import render_for_completion
    from dataio.hub_tasks import GSM8K
    from dataio.task_folder import dataset_folder
    from run.chat_engine import Engine

    folder, base, start, config, state = command_setup
    drawn, own_generate = [], Engine.generate_batch

    def recorded(self, tokens, num_samples=1, **settings):
        sequences, masks = own_generate(self, tokens, num_samples, **settings)
        if settings.get("max_tokens") == 16:  # training's (pass@k's take 256)
            drawn.append((sequences, masks))
        return sequences, masks

    monkeypatch.setattr(Engine, "generate_batch", recorded)
    # a random model never writes '#### N': a reward of its completion's length's parity gives
    # the samples advantages of both signs (GSM8K's own reward is held to nanochat's elsewhere)
    monkeypatch.setattr(GSM8K, "reward", lambda task, conversation, text: float(len(text) % 2))
    out_dir = folder / "out"
    argv = [f"--init_from={start}", f"--dataset={base}", f"--out_dir={out_dir}"]
    argv += ["--examples_per_step=2", "--num_samples=4", "--device_batch_size=2"]
    argv += ["--max_new_tokens=16", "--eval_examples=1", "--dtype=float32", "--init_lr_frac=1.0"]
    assert chat_rl.main(argv) == 0
    out = capsys.readouterr().out
    assert "2 steps of 2 questions x 4 samples" in out
    assert "Step 0 | Pass@1: " in out and "Pass@2: " in out
    assert out.count("| loss: ") == 8 and "Step 1/2 | Average reward: " in out
    losses = [
        float(line.split("| loss: ")[1].split()[0])
        for line in out.splitlines()
        if "| loss: " in line
    ]
    assert any(loss != 0 for loss in losses)
    saved = out_dir / "chatrl_checkpoints" / "d3"
    assert (saved / "model_000001.pt").is_file() and (
        out_dir / "tokenizer" / "tokenizer.pkl"
    ).is_file()
    with open(saved / "meta_000001.json") as f:
        assert json.load(f)["model_config"]["n_layer"] == 3
    # the same samples through the check's steps: the same weights, to the check's tolerances
    # (the command pads its rows to 64-token buckets, the check to the longest: rounding apart)
    tokenizer = ChatTokenizer.from_directory(str(base / "tokenizer"))
    task = GSM8K(dataset_folder(str(base), GSM8K), "main", "train")
    questions = []
    for i in range(4):  # the questions in order, each drawn in 2 batches of 2
        (s1, m1), (s2, m2) = drawn[2 * i], drawn[2 * i + 1]
        prompt = render_for_completion(tokenizer, task[i])
        texts = [tokenizer.decode(s[len(prompt) :]) for s in s1 + s2]
        questions.append((s1 + s2, m1 + m2, [float(len(t) % 2) for t in texts]))
    pad = tokenizer.encode_special("<|assistant_end|>")
    plan = [questions[:2], questions[2:]]
    expected = check.our_steps(config, state, plan, pad, rates={"init_lr_frac": 1.0})
    got = {k: v.numpy() for k, v in torch.load(saved / "model_000001.pt").items()}
    start = {k: v.astype(np.float64) for k, v in state.items()}
    figures = check.compare(expected, (expected[0], expected[1], got), start)
    for name, (diff, tol, _, _, _) in figures["tensors"].items():
        assert diff <= tol, f"{name}: {diff:.3g} > {tol:.3g}"


@pytest.mark.slow
def test_against_nanochat_own_code(tmp_path, capsys):
    checkout = os.environ.get("NANOCHAT_CHECKOUT")
    if not checkout:
        pytest.skip("set NANOCHAT_CHECKOUT=/path/to/nanochat to run nanochat's own chat_rl.py")
    assert check.main(["--own", checkout, "--work", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rewards: equal" in out and "nanochat's RL step: OK" in out
