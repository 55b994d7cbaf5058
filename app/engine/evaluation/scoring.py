"""Scoring multiple-choice tasks as llama.cpp's `llama-perplexity` does
(tools/perplexity/perplexity.cpp: `hellaswag_score`, `winogrande_score`,
`multiple_choice_score`).

Tokens: each choice's full text is tokenized with the vocabulary's BOS (`common_tokenize(ctx,
text, true)`: add_special, no special-token parsing). The task's common prefix P is the longest
run of tokens all its choices share (llama.cpp compares token by token, not the context's own
tokenization, so an ending's first word may join the prefix). Here P is kept below the
shortest choice's length, so every choice has at least one token of its own (llama.cpp reads
past the end of a choice there: undefined, never the case for real data).

One forward serves many tasks: the tokens of a pack of tasks go in once, each task's prefix
once and each choice's own tokens after it, at the positions they have in that choice's text.
A tree mask lets a choice's tokens see their task's prefix and earlier tokens of the same
choice only, which is what llama.cpp's sequence ids (the prefix in every choice's sequence,
each choice in its own) give its KV cache.

Scores (log-probabilities are natural logs, from float32 logits summed in float64):
* HellaSwag, multiple choice, JSONL: a choice's score is the mean log-prob of its tokens after
  the prefix (the first one from the prefix's last logits); the choice with the highest score
  is picked, the first on ties (llama.cpp's strict `>`). `raw` is the sum.
* WinoGrande: the partial score. With more than 3 tokens after the prefix in both choices
  (`k_min_trailing_ctx`), a choice's scored tokens start after its text up to the option
  (`n_base`: that text's own tokenization with BOS) and the last token is left out when more
  than one remains; else they start after the prefix. Choice 1 is picked when its score is
  strictly higher, else choice 2. Without the skip llama.cpp scores choice 2's first token
  with the logits of choice 1's last token (its "FIXME: this uses the wrong first logits");
  this does the same, so the two pick alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from app.engine.errors import DatasetError
from app.engine.evaluation.tasks import ChoiceTask
from app.engine.kernels.attention import attention_mask
from app.engine.model.context import ForwardContext
from app.engine.runtime.backend import to_host
from app.engine.text.chat_template import generation_prompt_ids

PACK_TOKENS = 512        # tokens of one forward (several tasks; a longer task goes alone)
HEAD_ROWS = 64           # rows of the output head at once (Gemma's vocabulary: 64 MB)
K_MIN_TRAILING_CTX = 3   # WinoGrande: llama.cpp's k_min_trailing_ctx


class TreeContext(ForwardContext):
    """A forward over packed tasks: token i belongs to task `groups[i]` and to its prefix
    (branch 0) or to choice `branches[i] - 1`. A query sees earlier positions of its own task's
    prefix and of its own branch."""

    def __init__(self, cfg, positions, groups, branches, xp=np):
        positions = np.asarray(positions)
        super().__init__(cfg, positions, positions, None, None, xp)
        self.groups, self.branches = np.asarray(groups), np.asarray(branches)

    def mask(self, swa: bool, dtype):
        key = (swa, np.dtype(dtype))
        if key not in self._masks:
            window = self.cfg.sliding_window if swa else 0
            mask = attention_mask(np, self.q_pos, self.k_pos, window)           # (T, T)
            g, b = self.groups, self.branches
            seen = (g[:, None] == g[None, :]) & ((b[None, :] == 0) | (b[:, None] == b[None, :]))
            self._masks[key] = self.xp.asarray(np.where(seen, mask, -np.inf).astype(dtype))
        return self._masks[key]


@dataclass
class Tokenized:
    """One task's choices as token ids: `seqs[s]` the full ids, `prefix` the shared length,
    `bases[s]` (WinoGrande) the length of the text up to the option."""
    seqs: list[list[int]]
    prefix: int
    bases: list[int]

    @property
    def n_tokens(self) -> int:
        return self.prefix + sum(len(s) - self.prefix for s in self.seqs)


def tokenize_task(tokenizer, task: ChoiceTask) -> Tokenized:
    if task.messages is not None:       # a chat prompt, each choice as the assistant's answer
        prompt = generation_prompt_ids(tokenizer, task.messages)
        seqs = [prompt + tokenizer.encode(t, add_special=False) for t in task.texts]
    else:
        seqs = [tokenizer.encode(t, add_special=True) for t in task.texts]
    shortest = min(len(s) for s in seqs)
    prefix = 0
    while prefix < shortest - 1 and len({s[prefix] for s in seqs}) == 1:
        prefix += 1
    bases = [len(tokenizer.encode(b, add_special=True)) for b in task.base]
    return Tokenized(seqs, prefix, bases)


def choice_logprobs(model, params, packed: Sequence[Tokenized],
                    last_rows: Sequence[Sequence[tuple[int, int]]] = ()) -> list[dict]:
    """One forward over `packed` tasks. Per task {"lp": [per choice: the log-probs (float64) of
    its tokens prefix .. end, each given everything before it in that choice], "last": [the
    log-prob of each (choice s, token) pair of last_rows[task] given the logits after choice
    s's LAST token]}."""
    tokens, positions, groups, branches = [], [], [], []
    plans = []        # per task: (row of the prefix's last token, per choice its rows)
    for g, t in enumerate(packed):
        start = len(tokens)
        tokens += t.seqs[0][:t.prefix]
        positions += range(t.prefix)
        groups += [g] * t.prefix
        branches += [0] * t.prefix
        rows = []
        for s, seq in enumerate(t.seqs):
            rows.append(range(len(tokens), len(tokens) + len(seq) - t.prefix))
            tokens += seq[t.prefix:]
            positions += range(t.prefix, len(seq))
            groups += [g] * (len(seq) - t.prefix)
            branches += [s + 1] * (len(seq) - t.prefix)
        plans.append((start + t.prefix - 1, rows))
    ids = model.check_tokens(tokens)
    ctx = TreeContext(model.config, positions, groups, branches, model.xp)
    x = model.hidden(ids, params, ctx)                                          # (T, C)

    wanted, targets = [], []     # rows of x whose logits score a target token
    for g, (t, (last_prefix, rows)) in enumerate(zip(packed, plans)):
        for s, seq in enumerate(t.seqs):
            wanted += [last_prefix, *rows[s][:-1]]
            targets += seq[t.prefix:]
        for s, token in (last_rows[g] if g < len(last_rows) else ()):
            wanted.append(rows[s][-1])
            targets.append(token)
    lp = _target_logprobs(model, params, x, wanted, targets)

    out, i = [], 0
    for g, t in enumerate(packed):
        per_choice = []
        for seq in t.seqs:
            n = len(seq) - t.prefix
            per_choice.append(lp[i:i + n])
            i += n
        n_last = len(last_rows[g]) if g < len(last_rows) else 0
        out.append({"lp": per_choice, "last": lp[i:i + n_last]})
        i += n_last
    return out


def _target_logprobs(model, params, x, rows: list[int], targets: list[int]) -> np.ndarray:
    """log softmax(head(x[row]))[target] per pair, the head run HEAD_ROWS rows at a time."""
    out = np.empty(len(rows), np.float64)
    xp = model.xp
    for a in range(0, len(rows), HEAD_ROWS):
        pick = xp.asarray(np.asarray(rows[a:a + HEAD_ROWS]))
        z = np.asarray(to_host(model.head_logits(x[pick], params)), np.float64)   # (n, V)
        top = z.max(axis=1, keepdims=True)
        lse = top[:, 0] + np.log(np.exp(z - top).sum(axis=1))
        out[a:a + len(z)] = z[np.arange(len(z)), targets[a:a + HEAD_ROWS]] - lse
    return out


@dataclass
class TaskScore:
    choice: int
    scores: list[float]        # what decides (mean log-prob per token; WinoGrande's partial)
    raw: list[float]           # summed log-probs of the same tokens


def pick_mean(t: Tokenized, lp: list[np.ndarray], last: np.ndarray) -> TaskScore:
    """HellaSwag, multiple choice, JSONL: the mean log-prob after the prefix."""
    raw = [float(v.sum()) for v in lp]
    scores = [r / len(v) for r, v in zip(raw, lp)]
    return TaskScore(int(np.argmax(scores)), scores, raw)     # argmax: the first on ties


def winogrande_extra(t: Tokenized) -> list[tuple[int, int]]:
    """The pair llama.cpp scores with choice 1's last logits (see the module's doc)."""
    return [] if _skip_choice(t) else [(0, t.seqs[1][t.prefix])]


def _skip_choice(t: Tokenized) -> bool:
    return all(len(s) - t.prefix > K_MIN_TRAILING_CTX for s in t.seqs)


def pick_winogrande(t: Tokenized, lp: list[np.ndarray], last: np.ndarray) -> TaskScore:
    skip = _skip_choice(t)
    scores, raw = [], []
    for s, seq in enumerate(t.seqs):
        base = t.bases[s] if skip else t.prefix
        drop_last = 1 if len(seq) - base > 1 else 0
        # tokens base .. len-1-drop_last; lp[s][k] is token prefix + k
        part = np.array(lp[s][base - t.prefix:len(seq) - drop_last - t.prefix])
        if s == 1 and not skip and len(part):
            part[0] = last[0]
        total = float(part.sum())
        raw.append(total)
        scores.append(total / len(part) if len(part) else -math.inf)
    return TaskScore(0 if scores[0] > scores[1] else 1, scores, raw)


def check_fits(model, tasks: Sequence[ChoiceTask], tokenized: Sequence[Tokenized]) -> None:
    limit = model.config.context_length
    for task, t in zip(tasks, tokenized):
        longest = max(len(s) for s in t.seqs)
        if longest > limit:
            raise DatasetError(f"The task at {task.where} is {longest} tokens long; the model's "
                               f"context is {limit}.", "Shorten the task or leave it out.")
        if t.bases and _skip_choice(t) and any(b < t.prefix or b >= len(s)
                                               for b, s in zip(t.bases, t.seqs)):
            raise DatasetError(f"The task at {task.where}: the text up to the option does not "
                               "tokenize as the start of the sentence.",
                               "Check the sentence and its options.")


def score_tasks(model, params, fmt: str, tasks: Sequence[ChoiceTask],
                progress: Callable[[int, int], None] | None = None) -> list[TaskScore]:
    """Each task's choice and scores, tasks packed PACK_TOKENS tokens a forward."""
    tokenized = [tokenize_task(model.tokenizer, t) for t in tasks]
    check_fits(model, tasks, tokenized)
    pick = pick_winogrande if fmt == "winogrande" else pick_mean
    out: list[TaskScore] = []
    i = 0
    while i < len(tokenized):
        j, size = i, 0
        while j < len(tokenized) and (j == i or size + tokenized[j].n_tokens <= PACK_TOKENS):
            size += tokenized[j].n_tokens
            j += 1
        pack = tokenized[i:j]
        extra = [winogrande_extra(t) for t in pack] if fmt == "winogrande" else []
        for t, r in zip(pack, choice_logprobs(model, params, pack, extra)):
            out.append(pick(t, r["lp"], r["last"]))
        i = j
        if progress is not None:
            progress(i, len(tokenized))
    return out


@dataclass
class Accuracy:
    n: int
    correct: int

    @property
    def acc(self) -> float:
        return self.correct / self.n if self.n else float("nan")

    @property
    def stderr(self) -> float:
        """llama.cpp's: sqrt(p (1 - p) / (n - 1))."""
        p = self.acc
        return math.sqrt(p * (1 - p) / (self.n - 1)) if self.n > 1 else float("nan")
