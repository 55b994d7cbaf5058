"""Tokenized sequences -> training windows -> `Batch`es: context overflow, packing, padding, order.

Labels. A sequence of n tokens trains n - 1 positions: the window's inputs are ``ids[:-1]`` and
its labels ``ids[1:]``, with -1 where the target token is not trained (see `app.engine.data.loss_masks`).
So the last token of a sequence is only ever a target (nothing is predicted after it), and a
sequence fits a context of C positions when it has at most C + 1 tokens. No label is wasted on
a window edge.

Overflow (sequences longer than C + 1 tokens):

* ``truncate`` keeps the first C + 1 tokens;
* ``split`` cuts the sequence into pieces of C + 1 tokens that overlap by one token, so every
  target is trained exactly once; the later pieces start without BOS and with positions from 0;
* ``drop`` leaves the row out.

A piece with no trained target (e.g. a prompt longer than the context) is left out; a row with
no piece left counts as dropped.

Packing (how pieces fill windows of at most C positions):

* ``pack``: several pieces share a window, one after the other; positions restart at 0 for each
  piece and each piece is its own segment, so attention never crosses a piece boundary (as if
  they were separate sequences). Pieces are placed first-fit into a few open windows, in the
  (shuffled) order given, so windows are well filled (about 98% on chat data) and still mixed.
* ``pad``: one piece per window, padded to exactly C positions with the pad token (the EOS id,
  else 0) in a segment of its own, label -1 and weight 0: it changes nothing but the shape.
* ``none``: one piece per window, unpadded.

Token weights are the piece's row weight on every position (None when every weight is 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from app.engine.data.batches import Batch, pack

OVERFLOW = ("truncate", "split", "drop")
PACKING = ("pack", "pad", "none")
OPEN_WINDOWS = 8  # windows kept open while packing first-fit


@dataclass
class Sequences:
    """Many token sequences in flat arrays: tokens (total,) int32, trained (total,) bool,
    starts (N + 1,) int64 (sequence i is tokens[starts[i]:starts[i + 1]])."""

    tokens: np.ndarray
    trained: np.ndarray
    starts: np.ndarray

    def __len__(self) -> int:
        return len(self.starts) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)

    def ids(self, i: int) -> np.ndarray:
        return self.tokens[self.starts[i]:self.starts[i + 1]]

    def mask(self, i: int) -> np.ndarray:
        return self.trained[self.starts[i]:self.starts[i + 1]]

    @classmethod
    def concat(cls, ids: Sequence[np.ndarray], masks: Sequence[np.ndarray]) -> Sequences:
        starts = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum([len(i) for i in ids], out=starts[1:])
        tokens = np.concatenate(ids).astype(np.int32) if ids else np.zeros(0, np.int32)
        trained = np.concatenate(masks).astype(bool) if masks else np.zeros(0, bool)
        return cls(tokens, trained, starts)


FITS, TRUNCATED, SPLIT, DROPPED = "fits", "truncated", "split", "dropped"


def cut(trained: np.ndarray, context: int, overflow: str) -> tuple[list[tuple[int, int]], str]:
    """Token ranges [a, b) of one sequence that become window pieces (b - a <= context + 1),
    keeping only pieces with at least one trained target; and what happened to the row
    (FITS, TRUNCATED, SPLIT or DROPPED: nothing trainable is left)."""
    n = len(trained)
    if n - 1 <= context:
        pieces, status = [(0, n)], FITS
    elif overflow == "truncate":
        pieces, status = [(0, context + 1)], TRUNCATED
    elif overflow == "split":
        pieces, status = [(a, min(a + context + 1, n)) for a in range(0, n - 1, context)], SPLIT
    else:
        pieces, status = [], DROPPED
    pieces = [(a, b) for a, b in pieces if trained[a + 1:b].any()]
    return pieces, status if pieces else DROPPED


STATUSES = (FITS, TRUNCATED, SPLIT, DROPPED)


@dataclass(frozen=True)
class Fit:
    """What the context does to one sequence: its pieces, status (one of STATUSES), its trained
    targets in all, and the positions and targets that reach windows."""

    pieces: list[tuple[int, int]]
    status: str
    targets: int
    kept_positions: int
    kept_targets: int


def fit(trained: np.ndarray, context: int, overflow: str) -> Fit:
    pieces, status = cut(trained, context, overflow)
    return Fit(pieces, status, int(trained[1:].sum()), sum(b - a - 1 for a, b in pieces),
               sum(int(trained[a + 1:b].sum()) for a, b in pieces))


def plan_windows(lengths: np.ndarray, order: Sequence[int], context: int,
                 packing: str) -> list[list[int]]:
    """Group pieces (by index, with `lengths` positions each, all <= context) into windows."""
    if packing != "pack":
        return [[int(i)] for i in order]
    done: list[list[int]] = []
    open_: list[list] = []   # [free positions, [piece indices]]
    for i in order:
        size = int(lengths[i])
        for w in open_:
            if w[0] >= size:
                w[0] -= size
                w[1].append(int(i))
                break
        else:
            if len(open_) == OPEN_WINDOWS:
                fullest = min(range(len(open_)), key=lambda k: open_[k][0])
                done.append(open_.pop(fullest)[1])
            open_.append([context - size, [int(i)]])
        if open_ and open_[-1][0] == 0:
            done.append(open_.pop()[1])
    done.extend(w[1] for w in open_)
    return done


def piece_arrays(seqs: Sequences, seq: int, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs (b-a-1,), labels (b-a-1,)) of one piece; labels -1 where not trained."""
    base = int(seqs.starts[seq])
    t = seqs.tokens[base + a:base + b].astype(np.int64)
    m = seqs.trained[base + a + 1:base + b]
    return t[:-1], np.where(m, t[1:], -1)


def build_batch(seqs: Sequences, pieces: Sequence[tuple[int, int, int]],
                weights: Sequence[float] | None, pad_to: int = 0, pad_id: int = 0) -> Batch:
    """One window: its pieces (sequence, a, b) packed with `pack`, then padded to `pad_to`."""
    parts = [piece_arrays(seqs, s, a, b) for s, a, b in pieces]
    w = list(weights) if weights is not None else None
    short = pad_to - sum(len(t) for t, _ in parts)
    if short > 0:
        parts.append((np.full(short, pad_id, np.int64), np.full(short, -1, np.int64)))
        if w is not None:
            w.append(0.0)
    return pack(parts, w)
