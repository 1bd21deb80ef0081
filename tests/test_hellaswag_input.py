"""python -m pytest tests/test_hellaswag_input.py -q

HellaSwag's input (hellaswag.py, parity/check_hellaswag.py): a bad line, a missing file, an --out
that cannot be written, each one clear error naming the place; the download cached, and failing
(offline, or cut off midway) in one line with its cause and the fix, nothing partial left."""

import dataclasses
import io
import json
import os
import re
from pathlib import Path

import jax
import pytest
from flax import nnx
from helpers import HELLASWAG_FIXTURE, python_in_c_locale

import hellaswag
from configurator import exit_on_bad_input
from dataio import hellaswag_data
from model import GPT, GPTConfig
from parity import check_hellaswag

FIXTURE = Path(HELLASWAG_FIXTURE)


def write_lines(tmp_path, lines):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


GOOD = FIXTURE.read_text().splitlines()[0]


@pytest.mark.parametrize(
    "line, message",
    [
        (
            '{"ctx": "A man", "endings": [',
            r"bad\.jsonl:3: not valid JSON \(Expecting value: column 1\)$",
        ),
        # one "at"
        (
            '{"ctx": "A man',
            r"bad\.jsonl:3: not valid JSON \(Invalid control character at: column 15\)$",
        ),
        (
            json.dumps(json.loads(GOOD) | {"endings": ["a", "b", "c"]}),
            r"bad\.jsonl:3: expected 4 endings, got 3",
        ),
        (
            json.dumps(json.loads(GOOD) | {"label": 4}),
            r"bad\.jsonl:3: label must be 0, 1, 2 or 3 .* got 4",
        ),
        (
            json.dumps(json.loads(GOOD) | {"label": "-1"}),
            r"bad\.jsonl:3: label must be 0, 1, 2 or 3 .* got '-1'",
        ),
        (
            json.dumps({k: v for k, v in json.loads(GOOD).items() if k != "label"}),
            r"bad\.jsonl:3: no label",
        ),
        (
            json.dumps(json.loads(GOOD) | {"label": ""}),
            r"bad\.jsonl:3: no label \(HellaSwag's test split is unlabeled\)$",
        ),
        (
            json.dumps(json.loads(GOOD) | {"endings": "one ending"}),
            r"bad\.jsonl:3: 'endings' must be a list",
        ),
        ("[1, 2]", r"bad\.jsonl:3: expected a JSON object, got list$"),
        (json.dumps(json.loads(GOOD) | {"ctx": 5}), r"bad\.jsonl:3: 'ctx' must be a string$"),
    ],
)
def test_bad_lines_name_their_line(tmp_path, line, message):
    path = write_lines(tmp_path, [GOOD, GOOD, line, GOOD])
    with pytest.raises(ValueError, match=message):
        hellaswag_data.read_examples(path)


def test_blank_lines_are_skipped_and_the_file_is_read_as_utf8_in_any_locale(tmp_path):
    """Line numbers count the blank lines; a C locale without Python's UTF-8 mode (a python of its
    own) reads the same examples; a file of blank lines is one line."""
    accented = json.dumps(json.loads(GOOD) | {"ctx": "Un café — naïve"}, ensure_ascii=False)
    path = write_lines(tmp_path, [GOOD, "", accented])
    read = hellaswag_data.read_examples(path)
    assert [ex["_line"] for ex in read] == [1, 3] and read[1]["ctx"] == "Un café — naïve"
    script = (
        "from dataio import hellaswag_data; "
        f"print(ascii(hellaswag_data.read_examples({ascii(path)})))"
    )
    r = python_in_c_locale(script)
    assert r.returncode == 0 and r.stdout.strip() == ascii(read), r.stderr[-2000:]
    path = write_lines(tmp_path, ["", " "])
    with pytest.raises(ValueError, match=f"^{re.escape(path)}: no examples$"):
        hellaswag_data.read_examples(path)


def test_missing_file():
    with pytest.raises(FileNotFoundError, match="no such HellaSwag file: nowhere.jsonl"):
        hellaswag_data.read_examples("nowhere.jsonl")


def bad_input(capsys, main, args):
    """What `python SCRIPT ARGS` does with bad input, in process: (exit code, stderr)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        exit_on_bad_input(lambda: main(args))
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    "main", [hellaswag.main, check_hellaswag.main], ids=["hellaswag", "check_hellaswag"]
)
def test_cli_bad_input_is_one_line_and_exit_code_2(main, tmp_path, capsys):
    bad = write_lines(tmp_path, [GOOD, '{"ctx": "A man", "endings": ['])
    for args, message in [
        (["--path", bad], f"error: {bad}:2: not valid JSON"),
        (["--path", str(tmp_path / "missing.jsonl")], "error: no such HellaSwag file"),
        (["--path", str(FIXTURE), "--limit", "0"], "error: --limit must be >= 1"),
    ]:
        code, err = bad_input(capsys, main, args)
        assert code == 2, err
        assert err.startswith(message) and len(err.strip().splitlines()) == 1, err


def test_with_no_options_the_scripts_score_gpt2_on_the_validation_split(monkeypatch):
    args = hellaswag.cli_parser(hellaswag.__doc__).parse_args([])
    assert (args.init_from, args.out_dir, args.split, args.path, args.limit) == (
        "gpt2",
        "out",
        "val",
        None,
        None,
    )
    assert args.cache_dir == hellaswag_data.CACHE_DIR
    parse = hellaswag.cli_parser(hellaswag.__doc__).parse_args
    assert [parse(["--split", split]).split for split in ("train", "val", "test")] == [
        "train",
        "val",
        "test",
    ]
    with pytest.raises(SystemExit):
        parse(["--split", "dev"])
    # without --path, the split asked for is the one downloaded
    asked = []
    monkeypatch.setattr(
        hellaswag_data, "download", lambda *args: asked.append(args) or str(FIXTURE)
    )
    # the least
    args = hellaswag.cli_parser(hellaswag.__doc__).parse_args(["--split", "train", "--limit", "1"])
    path, raw = hellaswag.cli_examples(args)
    assert path == str(FIXTURE) and len(raw) == 1 and asked == [("train", args.cache_dir)]


@pytest.mark.parametrize(
    "script", [hellaswag, check_hellaswag], ids=["hellaswag", "check_hellaswag"]
)
def test_help_says_what_the_script_does_and_each_option(script, capsys):
    with pytest.raises(SystemExit):
        script.main(["--help"])
    # the doc's first paragraph, its lines as written, then the options
    assert (
        f"\n\n{script.__doc__.split(chr(10) * 2)[0].strip()}\n\noptions:\n"
        in capsys.readouterr().out
    )
    assert all(action.help for action in hellaswag.cli_parser(script.__doc__)._actions)


def test_the_scorer_gets_the_examples_cut_to_the_models_window_and_the_batch_size(
    capsys, monkeypatch
):
    """main renders for the loaded model's block_size (the longest example cut by exactly 1 token
    here) and hands the scorer --batch_size (8 unless given; 1 taken), float32 at full matmul
    precision (a GPU's or TPU's default is less: on this CPU it is the same, so read off the
    config); its first line says what it loaded and how many were cut, its last the time and the
    rate. --dtype is float32 or bfloat16: float16 is argparse's line, exit 2."""
    full = hellaswag_data.load_examples(str(FIXTURE))
    block_size = max(len(r.ctx) + max(map(len, r.endings)) for r in full) - 1
    expected = hellaswag_data.load_examples(str(FIXTURE), max_len=block_size)
    cut = sum(r.truncated > 0 for r in expected)
    assert min(r.truncated for r in expected if r.truncated) == 1 and 0 < cut < len(expected)
    model = GPT(
        GPTConfig(block_size=block_size, vocab_size=50304, n_layer=1, n_head=1, n_embd=16),
        nnx.Rngs(0),
    )
    loaded, scored = [], []
    monkeypatch.setattr(
        hellaswag, "load_model", lambda init_from, out_dir, dtype: loaded.append(dtype) or model
    )

    def evaluate(model, examples, batch_size, progress):
        scored.append((examples, batch_size, jax.config.jax_default_matmul_precision))
        return hellaswag.Score(acc=0.5, acc_norm=0.25, count=len(examples), results=[])

    monkeypatch.setattr(hellaswag, "evaluate", evaluate)
    runs = [
        ([], "float32", 8, "highest"),
        (["--batch_size", "1", "--dtype", "float32"], "float32", 1, "highest"),
        (["--dtype", "bfloat16"], "bfloat16", 8, None),
    ]
    for args, dtype, batch_size, precision in runs:
        assert hellaswag.main(["--path", str(FIXTURE), *args]) == 0
        printed = capsys.readouterr().out.splitlines()
        assert re.fullmatch(
            rf"model gpt2: {model.num_params() / 1e6:.2f}M params, block_size {block_size}, loaded "
            rf"in 0\.\ds; 20 examples from {re.escape(str(FIXTURE))}, {cut} with context cut to "
            rf"fit; jax {dtype} on 1 cpu device\(s\)",
            printed[0],
        ), printed[0]
        assert loaded.pop() == dtype and scored.pop() == (expected, batch_size, precision)
        took = re.fullmatch(
            r"hellaswag: acc 0\.5000 acc_norm 0\.2500 count 20 \((\S+)s, (\S+) examples/s\)",
            printed[-1],
        )
        # 20 examples in under a second
        assert took and float(took[1]) < 1 and float(took[2]) > 20, printed[-1]
    # none cut: not said
    model = GPT(dataclasses.replace(model.config, block_size=block_size + 1), nnx.Rngs(0))
    hellaswag.main(["--path", str(FIXTURE)])
    assert f"20 examples from {FIXTURE}; jax float32" in capsys.readouterr().out
    # no room: the line is named
    model = GPT(dataclasses.replace(model.config, block_size=4), nnx.Rngs(0))
    with pytest.raises(
        ValueError, match=f"^{re.escape(str(FIXTURE))}:1: an ending of .* model's 4-token window$"
    ):
        hellaswag.main(["--path", str(FIXTURE)])
    with pytest.raises(SystemExit) as e:
        hellaswag.main(["--path", str(FIXTURE), "--dtype", "float16"])
    assert e.value.code == 2 and "--dtype: invalid choice: 'float16'" in capsys.readouterr().err


def test_a_batch_size_below_1_and_results_that_cannot_be_written_are_one_line(
    tmp_path, capsys, monkeypatch
):
    """--batch_size 0 before anything is read; an --out whose directory is gone by the time the
    scores are written: one line naming --out, after the scores were printed."""
    code, err = bad_input(capsys, hellaswag.main, ["--path", str(FIXTURE), "--batch_size", "0"])
    assert code == 2 and err == "error: --batch_size must be >= 1, got 0\n", err
    out = tmp_path / "gone" / "p.jsonl"
    out.parent.mkdir()
    monkeypatch.setattr(
        hellaswag,
        "load_model",
        lambda *a: GPT(
            GPTConfig(block_size=64, vocab_size=50257, n_layer=1, n_head=1, n_embd=8), nnx.Rngs(0)
        ),
    )
    monkeypatch.setattr(
        hellaswag,
        "evaluate",
        lambda *a, **k: out.parent.rmdir() or hellaswag.Score(0.5, 0.5, 2, []),
    )
    code, err = bad_input(
        capsys, hellaswag.main, ["--path", str(FIXTURE), "--limit", "2", "--out", str(out)]
    )
    assert code == 2 and err.startswith(
        f"error: --out={out} could not be written (No such file or directory)"
    ), err


def test_out_that_cannot_be_written_is_refused_before_the_model_loads(
    tmp_path, capsys, monkeypatch
):
    """hellaswag.py --out into a directory that does not exist: one line before any model is loaded
    (issue 33)."""
    monkeypatch.setattr(hellaswag, "load_model", lambda *a: pytest.fail("the model was loaded"))
    code, err = bad_input(
        capsys, hellaswag.main, ["--path", str(FIXTURE), "--out", str(tmp_path / "no" / "p.jsonl")]
    )
    assert code == 2 and err.startswith(
        f"error: --out={tmp_path / 'no' / 'p.jsonl'}: its directory "
    ), err


def test_download_caches_and_fails_clearly_offline(tmp_path, monkeypatch):
    # urllib drops the #fragment
    monkeypatch.setattr(hellaswag_data, "URL", FIXTURE.as_uri() + "#{split}")
    path = hellaswag_data.download("val", str(tmp_path / "cache"))
    assert path == str(tmp_path / "cache" / "hellaswag_val.jsonl")
    assert Path(path).read_bytes() == FIXTURE.read_bytes() and os.listdir(tmp_path / "cache") == [
        "hellaswag_val.jsonl"
    ]
    # nothing listens there
    monkeypatch.setattr(hellaswag_data, "URL", "http://127.0.0.1:9/hellaswag_{split}.jsonl")
    # cached: no network needed
    assert hellaswag_data.download("val", str(tmp_path / "cache")) == path
    offline = (
        r"^could not download http://127\.0\.0\.1:9/hellaswag_train\.jsonl \(\[Errno \d+\] "
        r"[^<]*\); "
        # the reason, not urllib's wrapper
        r"offline\? pass a local copy with --path FILE\.jsonl$"
    )
    with pytest.raises(OSError, match=offline):
        hellaswag_data.download("train", str(tmp_path / "cache"))
    assert os.listdir(tmp_path / "cache") == ["hellaswag_val.jsonl"]  # no partial file left behind

    # the connection lost mid-download: the same line with its cause, the part written removed; and
    # never a read without a timeout (a network gone silent would hang the command)
    timeouts = []

    class Dropped(io.BytesIO):  # 10 bytes, then the connection is gone
        headers = {"content-length": "100"}

        def read(self, n=-1):
            if self.tell():
                raise ConnectionResetError("connection reset by peer")
            return super().read(10)

    monkeypatch.setattr(
        hellaswag_data.urllib.request,
        "urlopen",
        lambda url, timeout=None: timeouts.append(timeout) or Dropped(b"{" * 100),
    )
    with pytest.raises(OSError) as e:
        hellaswag_data.download("test", str(tmp_path / "cache"))
    assert str(e.value) == (
        "could not download http://127.0.0.1:9/hellaswag_test.jsonl (connection reset by peer); "
        "offline? pass a local copy with --path FILE.jsonl"
    )
    assert os.listdir(tmp_path / "cache") == ["hellaswag_val.jsonl"] and 0 < timeouts[0] <= 300
