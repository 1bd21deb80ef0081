"""
nanochat's Engine in PyTorch on a CPU (karpathy/nanochat, nanochat/engine.py: Engine.generate,
generate_batch, RowState, KVCache.prefill, sample_next_token), written by reading it, over
parity/nanochat_reference.py's GPT: the torch side of tests/test_chat_engine.py, for a CI that has
no nanochat checkout; run/chat_engine.py is ours. Float32.

- The prompt is prefilled once with one row into a cache as long as the prompt; a cache of
  num_samples rows, as long as the prompt + max_tokens (None: sequence_len), takes its keys, values,
  position and the smear's last embedding; every row starts from the prompt's last logits.
- Each step samples a token per row (argmax at temperature 0; else softmax(logits / temperature),
  over the top_k when top_k > 0, drawn by torch.multinomial from one torch.Generator seeded with
  `seed`), then each row takes its next forced token if it has one (mask 0) or the sampled one
  (mask 1). <|assistant_end|> or <|bos|> completes a row; <|python_start|> opens an expression,
  <|python_end|> closes it and gives its decoded text to the tool, whose result is queued as
  <|output_start|> + its tokens + <|output_end|>. Completed rows go on as the others do.
- It stops after max_tokens steps or when every row has completed; each step's column is fed back
  through the cache, after it is yielded.
- The tool: `tool(expression) -> text or None`. nanochat's use_calculator evaluates in the engine's
  own process; here the default is run/sandbox.py's calculator, whose equality to use_calculator
  tests/test_sandbox.py holds, so model-written text is never evaluated in the test's process.
"""

from collections import deque

import torch
import torch.nn.functional as F

from parity.nanochat_reference import KVCache
from run.sandbox import calculator


def sample_next_token(logits, generator, temperature, top_k):
    """(B, V) logits -> (B, 1) token ids, as nanochat's sample_next_token."""
    if temperature == 0.0:
        return logits.argmax(dim=-1, keepdim=True)
    if top_k is not None and top_k > 0:
        values, ids = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1)
        probs = F.softmax(values / temperature, dim=-1)
        return ids.gather(1, torch.multinomial(probs, 1, generator=generator))
    probs = F.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


class RowState:
    def __init__(self, tokens):
        self.tokens = list(tokens)
        self.forced = deque()
        self.in_python = False
        self.expression = []
        self.completed = False


def copied_cache(config, prefilled, rows, length):
    """A cache of `rows` rows and `length` positions holding the one-row cache's prompt (nanochat's
    KVCache.prefill)."""
    cache = KVCache(config, rows, length)
    n = prefilled.position
    for layer in range(config.n_layer):
        cache.k[layer][:, :n] = prefilled.k[layer][:, :n]
        cache.v[layer][:, :n] = prefilled.v[layer][:, :n]
    cache.position = n
    cache.last_embedding = prefilled.last_embedding.expand(rows, -1, -1).clone()
    return cache


class Engine:
    def __init__(self, model, tokenizer, tool=calculator):
        self.model, self.tokenizer, self.tool = model, tokenizer, tool

    @torch.no_grad()
    def generate(
        self, tokens, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seed=42
    ):
        special = self.tokenizer.encode_special
        python_start, python_end = special("<|python_start|>"), special("<|python_end|>")
        output_start, output_end = special("<|output_start|>"), special("<|output_end|>")
        ends = {special("<|assistant_end|>"), self.tokenizer.get_bos_token_id()}
        generator = torch.Generator().manual_seed(seed)
        config = self.model.config

        prefilled = KVCache(config, 1, len(tokens))
        logits = self.model(torch.tensor([tokens]), cache=prefilled)[:, -1]
        logits = logits.expand(num_samples, -1)  # (num_samples, V)
        length = len(tokens) + max_tokens if max_tokens is not None else config.sequence_len
        cache = copied_cache(config, prefilled, num_samples, length)

        rows = [RowState(tokens) for _ in range(num_samples)]
        generated = 0
        while True:
            if max_tokens is not None and generated >= max_tokens:
                break
            if all(row.completed for row in rows):
                break
            sampled = sample_next_token(logits, generator, temperature, top_k)[:, 0].tolist()
            column, masks = [], []
            for row, token in zip(rows, sampled):
                forced = len(row.forced) > 0
                masks.append(0 if forced else 1)
                token = row.forced.popleft() if forced else token
                column.append(token)
                row.tokens.append(token)
                if token in ends:
                    row.completed = True
                if token == python_start:
                    row.in_python, row.expression = True, []
                elif token == python_end and row.in_python:
                    row.in_python = False
                    if row.expression:
                        result = self.tool(self.tokenizer.decode(row.expression))
                        if result is not None:
                            row.forced.append(output_start)
                            row.forced.extend(self.tokenizer.encode(str(result)))
                            row.forced.append(output_end)
                    row.expression = []
                elif row.in_python:
                    row.expression.append(token)
            yield column, masks
            generated += 1
            logits = self.model(torch.tensor(column)[:, None], cache=cache)[:, -1]

    def generate_batch(self, tokens, num_samples=1, **settings):
        """(results, masks): each row's prompt and tokens without the terminal one, its masks."""
        special = self.tokenizer.encode_special
        ends = {special("<|assistant_end|>"), self.tokenizer.get_bos_token_id()}
        results = [list(tokens) for _ in range(num_samples)]
        masks = [[0] * len(tokens) for _ in range(num_samples)]
        completed = [False] * num_samples
        for column, column_masks in self.generate(tokens, num_samples, **settings):
            for i, (token, mask) in enumerate(zip(column, column_masks)):
                if not completed[i]:
                    if token in ends:
                        completed[i] = True
                    else:
                        results[i].append(token)
                        masks[i].append(mask)
            if all(completed):
                break
        return results, masks
