"""python -m pytest tests/test_eval_checks.py -q

What eval.py, hellaswag.py and parity.check_hellaswag check before their slow or networked steps: a
character-level model (our run, its vocabulary from its dataset's meta.pkl; an HF export with its
meta.json; a nanoGPT ckpt.pt) is refused before HellaSwag is downloaded, before lm-eval is imported
or indexes its tasks, and before any weights load; a hub model out of reach (offline) is one line
before lm-eval too."""

import os
import subprocess
import sys

import pytest
from flax import nnx
from helpers import REPO, save_ours, tiny_config

import eval as lm_eval_py
import hellaswag
from configurator import UsageError
from dataio import hellaswag_data
from dataio.tokenizer import read_vocab, save_vocab
from dataio.weights import save_hf
from model import GPT
from parity import check_hellaswag
from parity import nanogpt_reference as nanogpt


@pytest.fixture(scope="module")
def char_level(dataset, tmp_path_factory):
    """{source: its --init_from / --out_dir arguments} of a 64-character model in each format."""
    tmp = tmp_path_factory.mktemp("char")
    model = GPT(tiny_config(vocab_size=64), nnx.Rngs(0))
    save_ours(tmp / "run", model, {"dataset": str(dataset)})  # no vocab in its meta: the meta.pkl
    save_hf(model, str(tmp / "hf"))
    save_vocab(str(tmp / "hf"), read_vocab(os.path.join(dataset, "meta.pkl"))[1])
    config = nanogpt.GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32)
    nanogpt.save_ckpt(nanogpt.GPT(config), tmp / "ckpt.pt", config={"dataset": str(dataset)})
    return {
        "resume": ["--init_from=resume", f"--out_dir={tmp / 'run'}"],
        "hf": [f"--init_from={tmp / 'hf'}"],
        "nanogpt": [f"--init_from={tmp / 'ckpt.pt'}"],
    }


def fails_loudly(what):
    def fail(*args, **kwargs):
        pytest.fail(f"{what} before the character-level model was refused")

    return fail


@pytest.mark.parametrize("source", ["resume", "hf", "nanogpt"])
def test_a_character_level_model_is_refused_before_any_download_lm_eval_or_load(
    char_level, source, monkeypatch
):
    monkeypatch.setattr(hellaswag_data, "download", fails_loudly("HellaSwag was downloaded"))
    monkeypatch.setattr(hellaswag, "load_model", fails_loudly("the model was loaded"))
    monkeypatch.setattr(lm_eval_py, "task_manager", fails_loudly("lm-eval indexed its tasks"))
    monkeypatch.setattr(lm_eval_py, "load_with_codec", fails_loudly("the model was loaded"))
    refusal = r" is a character-level model \(a vocabulary of 64 characters\): "
    with pytest.raises(UsageError, match=refusal + "HellaSwag is scored in GPT-2's BPE, give a"):
        hellaswag.main(char_level[source])
    with pytest.raises(UsageError, match=refusal + "lm-eval's tasks are text in GPT-2's BPE, give"):
        lm_eval_py.main([*char_level[source], "--tasks=arc_easy"])
    monkeypatch.setattr(check_hellaswag, "load_models", fails_loudly("the models were loaded"))
    with pytest.raises(UsageError, match=refusal + "HellaSwag is scored in GPT-2's BPE, give a"):
        check_hellaswag.main(char_level[source])


# eval.py's main in a fresh process: which of lm-eval and its dependencies are imported at each
# refusal
REFUSALS = """
import sys

import eval
from configurator import UsageError

for argv in (sys.argv[1:2], sys.argv[2:]):
    try:
        eval.main([*argv, "--tasks=arc_easy"])
    except UsageError as e:
        print(e)
    print(sorted(m for m in ("lm_eval", "torch", "transformers") if m in sys.modules))
"""


@pytest.mark.slow
def test_offline_and_character_level_refusals_come_before_lm_eval_is_imported(char_level, tmp_path):
    """The issue's `eval.py --init_from=gpt2` offline: 24 s (lm-eval's import and its task index)
    before its one line; now that line comes first."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    out = subprocess.run(
        [sys.executable, "-c", REFUSALS, "--init_from=gpt2", *char_level["resume"]],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.splitlines()
    assert out[0].startswith("could not load 'gpt2' from the HF hub or the local HF cache"), out
    assert out[2].endswith("lm-eval's tasks are text in GPT-2's BPE, give a GPT-2 model"), out
    assert out[1] == out[3] == "[]", out
