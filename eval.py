"""
Any lm-evaluation-harness task on our model: lm-eval does the tasks, prompts, few-shot and metrics;
run/eval_lm.py is the model side (loglikelihood, loglikelihood_rolling, generate_until), batched on
the mesh; this file is the command.

    # hub tasks: online
    python eval.py --init_from=gpt2 --tasks=hellaswag,arc_easy,piqa,lambada_openai
    python eval.py --init_from=resume --out_dir=out --tasks=hellaswag_local \
        --include_path=eval_tasks --limit=10
    python eval.py --init_from=DIR --tasks=shakespeare_rolling --include_path=eval_tasks \
        --output=results.json
    # nanochat's CORE metric on its eval bundle (run/core_eval.py; no lm-eval)
    python eval.py --init_from=gpt2 --tasks=core --core_bundle=eval_bundle --max_per_task=500

Settings as nanoGPT (configurator.py): --key=value. init_from as sample.py's: resume (from out_dir),
gpt2*, an HF GPT-2 directory, a nanoGPT ckpt.pt. Prints lm-eval's results table; --output writes its
JSON with the model's settings and checkpoint step. The PyTorch reference (lm-eval's own hf model)
is parity/check_eval.py. --tasks=core prints nanochat's CORE table instead (its per-task lines,
accuracies, centred results and the CORE metric; --output writes them as JSON), checked against
nanochat's own core_eval by tests/test_core_eval.py. Exit code: 0 evaluated, 2 bad input.
"""

import difflib
import json
import os
import sys
import time

import jax

from compute import sharding
from configurator import UsageError, configure, exit_on_bad_input, require_extras
from dataio.chat_tokenizer import ChatTokenizer
from dataio.weights import HF_NAMES, hf_directory
from hellaswag import check_bpe
from run import core_eval
from run.checkpoint import load_with_codec, refuse_char_level
from run.runlog import check_results_file, write_results
from run.settings import resolve_dtype

defaults = dict(
    # 'resume' (from out_dir), gpt2 | gpt2-medium | gpt2-large | gpt2-xl, an HF directory, a ckpt.pt
    init_from="gpt2",
    out_dir="out",  # for init_from='resume'
    # lm-eval task (or group) names, comma-separated: hellaswag,arc_easy,piqa,lambada_openai; or
    # core: nanochat's CORE metric (--core_bundle)
    tasks="",
    include_path="",  # a directory of local task YAMLs (eval_tasks/ has offline ones)
    num_fewshot=None,  # None: each task's own
    limit=None,  # an int: the first N documents of each task; a float < 1: that fraction
    batch_size=8,  # requests (CORE: a row per choice) per batch shard (data x fsdp) per batch
    dtype="float32",  # 'float32' | 'bfloat16' | 'auto' (bfloat16 on GPU/TPU, float32 on CPU)
    fsdp=1,  # the mesh, as train.py's: rows split over data x fsdp, parameters over fsdp and tensor
    tensor_parallel=1,
    output="",  # write the results JSON here (lm-eval's, or CORE's)
    log_samples=False,  # keep every request's inputs and outputs in the JSON
    seed=1234,  # lm-eval's seeds (few-shot choice, ...) and sampled generation's
    bootstrap_iters=100000,  # lm-eval's resamples for the stderr of metrics without a formula
    # --tasks=core: nanochat's eval_bundle folder (core.yaml, eval_meta_data.csv, eval_data/)
    core_bundle="",
    core_tasks="",  # some of core.yaml's labels, comma-separated ('': all)
    max_per_task=-1,  # CORE: the first N items of each task after nanochat's shuffle (-1: all)
)

CORE = "core"  # the --tasks name of nanochat's CORE metric

# ------------------------------------------------------------------------------------------------
# the command line


def check_settings(cfg):
    """Every bad setting fails here, in one line, before a model is loaded."""
    if not cfg["tasks"]:
        raise UsageError(
            "--tasks is required: lm-eval task names, comma-separated (e.g. "
            "--tasks=hellaswag,arc_easy)"
        )
    is_core = CORE in cfg["tasks"].split(",")
    if is_core and cfg["tasks"] != CORE:
        raise UsageError(f"--tasks={CORE} runs alone (nanochat's CORE is not an lm-eval task)")
    if is_core and not cfg["core_bundle"]:
        raise UsageError(
            f"--tasks={CORE} needs --core_bundle=DIR: nanochat's eval_bundle folder (core.yaml, "
            "eval_meta_data.csv, eval_data/)"
        )
    for key in ("core_bundle", "core_tasks"):
        if cfg[key] and not is_core:
            raise UsageError(f"--{key} is for --tasks={CORE}")
    for key in ("limit", "num_fewshot", "include_path", "log_samples"):
        if is_core and cfg[key] not in (None, "", False):
            raise UsageError(f"--{key} is for lm-eval's tasks: CORE's are its bundle's")
    if not (
        type(cfg["max_per_task"]) is int and (cfg["max_per_task"] >= 1 or cfg["max_per_task"] == -1)
    ):
        raise UsageError(
            f"--max_per_task must be an integer >= 1, or -1 (all), got {cfg['max_per_task']!r}"
        )
    if cfg["max_per_task"] != -1 and not is_core:
        raise UsageError(f"--max_per_task is for --tasks={CORE}; lm-eval's tasks take --limit")
    for key in ("batch_size", "fsdp", "tensor_parallel"):
        if not (type(cfg[key]) is int and cfg[key] >= 1):
            raise UsageError(f"--{key} must be an integer >= 1, got {cfg[key]!r}")
    limit = cfg["limit"]
    if limit is not None and not (
        (type(limit) is int and limit >= 1) or (type(limit) is float and 0 < limit < 1)
    ):
        raise UsageError(
            f"--limit must be an integer >= 1 (documents) or a fraction in (0, 1), got {limit!r}"
        )
    if cfg["num_fewshot"] is not None and not (
        type(cfg["num_fewshot"]) is int and cfg["num_fewshot"] >= 0
    ):
        raise UsageError(f"--num_fewshot must be an integer >= 0, got {cfg['num_fewshot']!r}")
    if cfg["include_path"] and not os.path.isdir(cfg["include_path"]):
        raise UsageError(f"--include_path {cfg['include_path']} is not a directory of task YAMLs")
    if cfg["output"]:
        check_results_file(cfg["output"], "--output")
    resolve_dtype(cfg["dtype"], "cpu")


def task_manager(tasks, include_path):
    """lm-eval's TaskManager for `tasks`: the local YAMLs alone when they hold them all (indexing
    lm-eval's own ~15k takes seconds); an unknown name is one line naming the closest."""
    from lm_eval.tasks import TaskManager

    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
    manager = TaskManager(include_path=include_path or None)
    for t in tasks:
        if t not in manager.all_tasks:
            close = difflib.get_close_matches(t, manager.all_tasks, n=3)
            raise UsageError(
                f"unknown task {t!r}"
                + (f" (did you mean {', '.join(close)}?)" if close else "")
                + " (lm-eval's tasks: python -m lm_eval ls tasks; local YAMLs: --include_path=DIR)"
            )
    return manager


NOT_BPE = "lm-eval's tasks are text in GPT-2's BPE"
NOT_BPE_CORE = "CORE's prompts are read in GPT-2's BPE"


def evaluate(lm, cfg, manager):
    """lm-eval's simple_evaluate on `lm` with cfg's task settings -> its results dict."""
    import lm_eval

    seed = cfg["seed"]
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=cfg["tasks"].split(","),
        num_fewshot=cfg["num_fewshot"],
        limit=cfg["limit"],
        log_samples=cfg["log_samples"],
        task_manager=manager,
        bootstrap_iters=cfg["bootstrap_iters"],
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )


def load(cfg, why):
    """The model of cfg (a character-level one is one line saying `why` not), what encodes its
    text, its checkpoint step and the mesh it is on, said on stderr. lm-eval's text is GPT-2's BPE:
    a model of nanochat's tokenizer is scored by CORE alone."""
    cfg["dtype"] = resolve_dtype(cfg["dtype"], jax.default_backend())
    t0 = time.time()
    model, codec, step = load_with_codec(cfg["init_from"], cfg["out_dir"], cfg["dtype"])
    where = cfg["out_dir"] if cfg["init_from"] == "resume" else cfg["init_from"]
    refuse_char_level(codec, where, why)
    if isinstance(codec, ChatTokenizer) and cfg["tasks"] != CORE:
        raise UsageError(
            f"{where} speaks nanochat's tokenizer, and lm-eval's tasks are scored in GPT-2's BPE: "
            "score it with --tasks=core"
        )
    mesh = sharding.make_mesh(cfg["fsdp"], cfg["tensor_parallel"])
    sharding.check_model_fits_mesh(model.config, mesh)
    print(
        f"model {cfg['init_from']}"
        + (f" (step {step})" if step is not None else "")
        + f": {model.num_params() / 1e6:.2f}M params, block_size {model.config.block_size}, "
        f"loaded in {time.time() - t0:.1f}s; jax {cfg['dtype']} on {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s), mesh {dict(mesh.shape)}",
        file=sys.stderr,
    )
    return model, codec, step, mesh


def core(cfg):
    """nanochat's CORE metric (run/core_eval.py): a line per task, the table, the metric."""
    labels = [t for t in cfg["core_tasks"].split(",") if t] or None
    tasks = core_eval.read_tasks(cfg["core_bundle"], labels)  # a bad bundle is one line, now
    for task in tasks:
        core_eval.bundle_file(cfg["core_bundle"], "eval_data", task.dataset_uri)
    check_bpe(cfg["init_from"], cfg["out_dir"], NOT_BPE_CORE)
    model, codec, step, mesh = load(cfg, NOT_BPE_CORE)
    scorer = core_eval.Scorer(model, mesh, cfg["batch_size"])
    t0 = time.time()
    # nanochat's tokenizer as nanochat's CORE runs it, or GPT-2's BPE behind its interface
    tokens = (
        ChatTokenizer(codec.enc) if isinstance(codec, ChatTokenizer) else core_eval.GPT2Tokens()
    )
    report = core_eval.evaluate_core(
        scorer, tokens, cfg["core_bundle"], cfg["max_per_task"], labels
    )
    if jax.process_index() != 0:
        return 0
    print(core_eval.results_table(report))
    print(f"CORE metric: {report['core_metric']:.4f}")
    print(
        f"evaluated in {time.time() - t0:.1f}s, {len(scorer.shapes)} compiled shapes",
        file=sys.stderr,
    )
    if cfg["output"]:
        report["config"] = {**cfg, "step": step, "model_config": vars(model.config)}
        write_results(cfg["output"], json.dumps(report, indent=2, default=str), "--output")
        print(f"wrote {cfg['output']}", file=sys.stderr)
    return 0


def main(argv=None):
    cfg = configure(defaults, sys.argv[1:] if argv is None else argv)
    if cfg["tasks"] != CORE:  # CORE needs no lm-eval
        require_extras("eval")
    check_settings(cfg)
    sharding.use_compilation_cache()
    sharding.start_backend()
    if cfg["tasks"] == CORE:
        return core(cfg)
    # what needs neither lm-eval nor the network, then the network, then lm-eval: importing it and
    # indexing its tasks take seconds, which a character-level model or a hub model out of reach
    # (offline) would wait for before its one line
    check_bpe(cfg["init_from"], cfg["out_dir"], NOT_BPE)
    if cfg["init_from"] in HF_NAMES:
        hf_directory(cfg["init_from"])  # downloaded now, read from the cache below
    from lm_eval.utils import handle_non_serializable, make_table

    from run.eval_lm import JaxLM

    manager = task_manager(cfg["tasks"].split(","), cfg["include_path"])
    model, _, step, mesh = load(cfg, NOT_BPE)
    lm = JaxLM(model, mesh, cfg["batch_size"], cfg["seed"])
    t0 = time.time()
    results = evaluate(lm, cfg, manager)
    if jax.process_index() != 0:
        return 0
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    print(
        f"evaluated in {time.time() - t0:.1f}s, {len(lm.shapes)} compiled shapes", file=sys.stderr
    )
    if cfg["output"]:
        results["config"]["model"] = "nanogpt-jax"
        results["config"]["model_args"] = {**cfg, "step": step, "model_config": vars(model.config)}
        write_results(
            cfg["output"],
            json.dumps(results, indent=2, default=handle_non_serializable),
            "--output",
        )
        print(f"wrote {cfg['output']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    exit_on_bad_input(main)
