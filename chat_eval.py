"""
Score a chat model as nanochat's chat_eval scores it: ARC-Easy/Challenge and MMLU by the logits of
their answer letters, GSM8K (with the calculator) and HumanEval (in the sandbox) by sampled answers;
each task's accuracy, then ChatCORE when all five were scored (docs/chat.md).

    # nanochat's finetuned checkpoint (its tokenizer/ two folders up, as in its base directory)
    python chat_eval.py --init_from=$HOME/.cache/nanochat/chatsft_checkpoints/d20
    # our finetuning run, two tasks, the first 100 problems of each
    python chat_eval.py --init_from=resume --out_dir=out-chat-sft --tasks=ARC-Easy,GSM8K \\
        --max_problems=100
    # pass@8 on HumanEval
    python chat_eval.py --init_from=DIR --tasks=HumanEval --num_samples=8 --temperature=0.8

Settings as sample.py's: an optional config file, then --key=value (configurator.py). The task
files are read from --tasks_dir (python data/chat/prepare.py writes them, in nanochat's cache
layout, to data/chat; nanochat's own base directory serves as it is).
"""

import sys

from configurator import configure, exit_on_bad_input
from run.chat_engine import start_chat_model
from run.chat_scoring import ChatScorer, Settings, load_tasks, task_names
from run.settings import resolve_dtype

defaults = dict(
    # 'resume' (our run in out_dir) or a nanochat checkpoint directory (its model_*.pt, meta_*.json)
    init_from="resume",
    out_dir="out",  # ignored unless init_from is 'resume'
    # nanochat's tokenizer directory (tokenizer.pkl); '': the checkpoint's (beside it or up to two
    # folders up; our run's dataset's)
    tokenizer="",
    tasks_dir="data/chat",  # the task files: each dataset's folder, or nanochat's task_data/
    # comma-separated: ARC-Easy,ARC-Challenge,MMLU,GSM8K,HumanEval,SpellingBee; '': the first five
    tasks="",
    max_problems=None,  # the first N problems of each task (None: all)
    batch_size=8,  # problems a forward (the categorical tasks)
    num_samples=1,  # completions a problem (the generative tasks): any one right passes it
    max_new_tokens=512,  # tokens a completion at most
    temperature=0.0,  # 0: greedy (argmax)
    top_k=50,  # sample among the top_k most likely tokens (0: all)
    dtype="auto",  # 'float32' | 'bfloat16' | 'auto' (bfloat16 on GPU/TPU, float32 on CPU)
)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    cfg = configure(defaults, argv)
    settings = Settings(
        **{k: cfg[k] for k in ("batch_size", "num_samples", "max_new_tokens", "top_k")},
        temperature=cfg["temperature"],
        max_problems=cfg["max_problems"],
    ).check()
    resolve_dtype(cfg["dtype"], "cpu")
    tasks = load_tasks(
        task_names(cfg["tasks"]), cfg["tasks_dir"]
    )  # bad files fail before the model
    model, tokenizer = start_chat_model(cfg, also=f"; tasks {', '.join(tasks)}")
    ChatScorer(model, tokenizer).score(tasks, settings)
    return 0


if __name__ == "__main__":
    exit_on_bad_input(main)
