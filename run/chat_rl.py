"""
Reinforcement learning on GSM8K as nanochat's scripts/chat_rl.py does it: each step samples
num_samples answers to each of examples_per_step questions with the engine (the calculator in
play), rewards the right '####' answers, and takes one MuonAdamW step on the on-policy objective
(advantage = reward - the question's mean; docs/chat.md); pass@k on GSM8K's test split every
eval_every steps; the model saved as nanochat's chatrl checkpoint.

    python -m run.chat_rl --init_from=$HOME/.cache/nanochat/chatsft_checkpoints/d20 \\
        --dataset=$HOME/.cache/nanochat      # its tokenizer/ two folders up, its task_data/
    python -m run.chat_rl --init_from=out-sft-export --tokenizer=DIR --dataset=data/chat \\
        --examples_per_step=4 --num_samples=8 --eval_every=20 --out_dir=out-chat-rl

The checkpoints go to out_dir/chatrl_checkpoints/<model_tag, else d<depth>>/ (model_NNNNNN.pt and
meta_NNNNNN.json, nanochat's layout, as export.py --format=nanochat writes them) with the tokenizer
in out_dir/tokenizer/, so that chat_cli.py and chat_eval.py --init_from=that folder read it.
Settings as chat_eval.py's: --key=value; nanochat's flag names in snake_case.
"""

import itertools
import os
import sys
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from archs import nanochat_rl
from configurator import UsageError, configure, exit_on_bad_input
from dataio.conversations import render_for_completion
from dataio.hub_tasks import GSM8K
from dataio.nanochat_checkpoint import save_nanochat
from dataio.task_folder import dataset_folder
from run.chat_engine import ASSISTANT_END, Engine, start_chat_model
from run.settings import resolve_dtype

defaults = dict(
    # a nanochat checkpoint directory (chat_sft's: chatsft_checkpoints/dN; its model_*.pt, meta_*)
    init_from="",
    # nanochat's tokenizer directory (tokenizer.pkl); '': the checkpoint's (beside it or up to two
    # folders up, as in nanochat's base directory)
    tokenizer="",
    # the tasks folder holding GSM8K (openai/gsm8k's files, or nanochat's base directory with its
    # task_data/): python data/chat/prepare.py writes data/chat
    dataset="data/chat",
    out_dir="out-chat-rl",  # chatrl_checkpoints/<tag>/ and tokenizer/ are written here
    model_tag="",  # the checkpoint folder's name ('': d<depth>)
    num_epochs=1,  # epochs over GSM8K's train split
    device_batch_size=8,  # samples a forward at most (sampling and training)
    examples_per_step=16,  # questions a step
    num_samples=16,  # samples a question: a multiple of device_batch_size
    max_new_tokens=256,  # tokens a sample at most
    temperature=1.0,  # sampling temperature (0: greedy, and every sample the same)
    top_k=50,  # sample among the top_k most likely tokens (0: all)
    embedding_lr=0.2,  # the token and value embeddings' rate (AdamW)
    unembedding_lr=0.004,  # the head's rate (AdamW)
    matrix_lr=0.02,  # the blocks' matrices' rate (Muon)
    # Muon's weight decay (chat_rl's help says Adam's: its setup_optimizer gives it to Muon)
    weight_decay=0.0,
    init_lr_frac=0.05,  # every rate starts at this fraction of itself, then falls to 0 linearly
    eval_every=60,  # pass@k on GSM8K's test split every N steps (step 0 included)
    eval_examples=400,  # test questions for pass@k
    save_every=60,  # a checkpoint every N steps (not step 0), and after the last
    dtype="auto",  # 'float32' | 'bfloat16' | 'auto' (bfloat16 on GPU/TPU, float32 on CPU)
)
LENGTH_BUCKET = 64  # rows are padded to whole buckets: few lengths, few compilations
EVAL_MAX_TOKENS, EVAL_TEMPERATURE, EVAL_TOP_K = (
    256,
    1.0,
    50,
)  # run_gsm8k_eval's, as chat_rl calls it


def check_settings(cfg):
    """One line for the first bad setting."""
    if not cfg["init_from"]:
        raise UsageError(
            "give --init_from=DIR: a nanochat checkpoint directory (chat_sft's chatsft_checkpoints/"
            "dN, or our finetuning run exported with export.py --format=nanochat)"
        )
    for key in (
        "num_epochs",
        "device_batch_size",
        "examples_per_step",
        "num_samples",
        "max_new_tokens",
        "eval_every",
        "eval_examples",
        "save_every",
    ):
        if not (isinstance(cfg[key], int) and not isinstance(cfg[key], bool) and cfg[key] >= 1):
            raise UsageError(f"{key} must be an integer >= 1, got {cfg[key]!r}")
    if cfg["num_samples"] % cfg["device_batch_size"]:
        raise UsageError(
            f"num_samples ({cfg['num_samples']}) must be a multiple of device_batch_size "
            f"({cfg['device_batch_size']}): a question's samples are drawn and trained on in "
            "batches of that many"
        )
    for key in ("embedding_lr", "unembedding_lr", "matrix_lr", "weight_decay", "init_lr_frac"):
        if not (isinstance(cfg[key], (int, float)) and cfg[key] >= 0):
            raise UsageError(f"{key} must be a number >= 0, got {cfg[key]!r}")
    if not (isinstance(cfg["temperature"], (int, float)) and cfg["temperature"] >= 0):
        raise UsageError(f"temperature must be >= 0 (0: greedy), got {cfg['temperature']!r}")
    if not (isinstance(cfg["top_k"], int) and cfg["top_k"] >= 0):
        raise UsageError(f"top_k must be an integer >= 0 (0: all), got {cfg['top_k']!r}")
    resolve_dtype(cfg["dtype"], "cpu")


def gsm8k_splits(root):
    """(train, test): GSM8K's main subset under the tasks folder `root`, read before the model."""
    folder = dataset_folder(root, GSM8K)
    return GSM8K(folder, "main", "train"), GSM8K(folder, "main", "test")


def bucketed(longest, block_size):
    """The ids' length a question's rows are padded to: inputs of whole LENGTH_BUCKETs (at most
    the context), plus the last target."""
    return min(-(-(longest - 1) // LENGTH_BUCKET) * LENGTH_BUCKET, block_size) + 1


class RLRun:
    """chat_rl's loop over `model` (ours, arch='nanochat') and `tokenizer`, its settings `cfg`."""

    def __init__(self, model, tokenizer, train, test, cfg):
        self.model, self.tokenizer, self.train, self.test, self.cfg = (
            model,
            tokenizer,
            train,
            test,
            cfg,
        )
        self.num_steps = (len(train) // cfg["examples_per_step"]) * cfg["num_epochs"]
        if self.num_steps < 1:
            raise UsageError(
                f"GSM8K's train split has {len(train)} questions, fewer than examples_per_step "
                f"({cfg['examples_per_step']}): no step to take; lower --examples_per_step"
            )
        self.engine = Engine(model, tokenizer)
        rates = {k: cfg[k] for k in ("embedding_lr", "unembedding_lr", "matrix_lr")}
        polar = jnp.bfloat16 if model.config.compute_dtype == jnp.bfloat16 else None
        self.tx = nanochat_rl.optimizer(
            model.config.n_embd,
            self.num_steps,
            weight_decay=cfg["weight_decay"],
            init_lr_frac=cfg["init_lr_frac"],
            dtype=polar,
            **rates,
        )
        self.step_fns = nanochat_rl.RLStep(model, self.tx)
        self.params = nnx.state(model)
        self.opt_state = self.tx.init(self.params)
        self.pad = tokenizer.encode_special(ASSISTANT_END)  # only padding: never a target
        self.examples = itertools.cycle(range(len(train)))

    def rollouts(self, step, index):
        """One question's samples as chat_rl's get_batch draws them: num_samples in batches of
        device_batch_size, each batch's seed from (step, question, batch) -> (sequences, masks,
        rewards, prompt length)."""
        c, conversation = self.cfg, self.train[index]
        prompt = render_for_completion(self.tokenizer, conversation)
        sequences, masks = [], []
        for sampling_step in range(c["num_samples"] // c["device_batch_size"]):
            seed = hash((step, index, sampling_step)) & 0x7FFFFFFF  # chat_rl's: ints hash alike
            batch, batch_masks = self.engine.generate_batch(
                prompt,
                num_samples=c["device_batch_size"],
                max_tokens=c["max_new_tokens"],
                temperature=c["temperature"],
                top_k=c["top_k"],
                seed=seed,
            )
            sequences += batch
            masks += batch_masks
        texts = [self.tokenizer.decode(seq[len(prompt) :]) for seq in sequences]
        rewards = [self.train.reward(conversation, text) for text in texts]
        return sequences, masks, rewards

    def train_step(self, step):
        """Every question's samples, their gradients added up, one optimizer step -> (the mean
        reward, the mean sequence length)."""
        c, rows = self.cfg, self.cfg["device_batch_size"]
        passes = c["num_samples"] // rows
        grads = self.step_fns.zero_grads(self.params)
        mean_rewards, lengths = [], []
        for example_step in range(c["examples_per_step"]):
            sequences, masks, rewards = self.rollouts(step, next(self.examples))
            length = bucketed(max(map(len, sequences)), self.model.config.block_size)
            inputs, targets = nanochat_rl.rollout_batch(sequences, masks, self.pad, length)
            adv = np.asarray(nanochat_rl.advantages(rewards))
            for p in range(passes):
                b = slice(p * rows, (p + 1) * rows)
                loss, grads = self.step_fns.gradients(
                    self.params,
                    inputs[b],
                    targets[b],
                    adv[b],
                    passes * c["examples_per_step"],
                    grads,
                )
                print(
                    f"Step {step}/{self.num_steps} | Example step {example_step} | Pass {p} | "
                    f"loss: {float(loss):.6f} | Average reward: {np.mean(rewards[b])}",
                    flush=True,
                )
            mean_rewards.append(float(np.mean(rewards)))
            lengths += [len(seq) for seq in sequences]
        self.params, self.opt_state = self.step_fns.update(self.params, self.opt_state, grads)
        nnx.update(self.model, self.params)  # the engine samples from the new weights
        return sum(mean_rewards) / len(mean_rewards), sum(lengths) / len(lengths)

    def pass_at_k(self):
        """run_gsm8k_eval as chat_rl calls it: device_batch_size samples of each of the first
        eval_examples test questions (256 tokens, temperature 1, top_k 50) -> pass@k for k = 1..
        device_batch_size: the fraction of questions with a right answer among the first k."""
        k_max = self.cfg["device_batch_size"]
        passed = np.zeros(k_max)
        n = min(self.cfg["eval_examples"], len(self.test))
        for index in range(n):
            conversation = self.test[index]
            prompt = render_for_completion(self.tokenizer, conversation)
            sequences, _ = self.engine.generate_batch(
                prompt,
                num_samples=k_max,
                max_tokens=EVAL_MAX_TOKENS,
                temperature=EVAL_TEMPERATURE,
                top_k=EVAL_TOP_K,
            )
            right = [
                self.test.evaluate(conversation, self.tokenizer.decode(seq[len(prompt) :]))
                for seq in sequences
            ]
            passed += np.maximum.accumulate(np.array(right, bool)).astype(float)
        return passed / n

    def save(self, step):
        tag = self.cfg["model_tag"] or f"d{self.model.config.n_layer}"
        directory = os.path.join(self.cfg["out_dir"], "chatrl_checkpoints", tag)
        save_nanochat(self.model, directory, step, {"user_config": self.cfg})
        tokenizer_dir = os.path.join(self.cfg["out_dir"], "tokenizer")
        if not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.pkl")):
            self.tokenizer.save(tokenizer_dir)
        print(f"saved the model of step {step} to {directory}", flush=True)
        return directory

    def run(self):
        c = self.cfg
        print(
            f"{self.num_steps} steps of {c['examples_per_step']} questions x {c['num_samples']} "
            f"samples ({c['examples_per_step'] * c['num_samples']} sequences a step)",
            flush=True,
        )
        for step in range(self.num_steps):
            if step % c["eval_every"] == 0:
                passk = self.pass_at_k()
                shown = ", ".join(f"Pass@{k + 1}: {v:.4f}" for k, v in enumerate(passk))
                print(f"Step {step} | {shown}", flush=True)
            began = time.time()
            reward, length = self.train_step(step)
            print(
                f"Step {step}/{self.num_steps} | Average reward: {reward} | Average sequence "
                f"length: {length:.2f} | lrm {1 - step / self.num_steps:.4f} | "
                f"{time.time() - began:.1f}s",
                flush=True,
            )
            if (step > 0 and step % c["save_every"] == 0) or step == self.num_steps - 1:
                self.save(step)
        return self.num_steps


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    cfg = configure(defaults, argv)
    check_settings(cfg)
    train, test = gsm8k_splits(cfg["dataset"])  # bad task files fail before the model loads
    model, tokenizer = start_chat_model(
        cfg, also=f"; GSM8K {len(train)} train, {len(test)} test questions"
    )
    if model.config.arch != "nanochat":
        raise UsageError(
            f"{cfg['init_from']} holds arch={model.config.arch!r}: chat_rl trains nanochat's "
            "GPT (its optimizer's groups are nanochat's)"
        )
    RLRun(model, tokenizer, train, test, cfg).run()
    return 0


if __name__ == "__main__":
    exit_on_bad_input(main)
