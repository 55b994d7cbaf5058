"""Micro-batches: token streams with labels, packed sequences, weights and positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass
class Batch:
    """One micro-batch: a token stream (several sequences may be packed in it).

    tokens, labels (T,) with label -1 = not trained; token_weights (T,) reward weights or None;
    positions (T,) RoPE positions and segments (T,) sequence ids when sequences are packed.
    """

    tokens: np.ndarray
    labels: np.ndarray
    token_weights: np.ndarray | None = None
    positions: np.ndarray | None = None
    segments: np.ndarray | None = None


def pack(sequences: Sequence[tuple[Sequence[int], Sequence[int]]], weights=None) -> Batch:
    """Pack (tokens, labels) sequences into one stream; attention never crosses sequences."""
    tokens = np.concatenate([np.asarray(t, np.int64) for t, _ in sequences])
    labels = np.concatenate([np.asarray(l, np.int64) for _, l in sequences])
    positions = np.concatenate([np.arange(len(t)) for t, _ in sequences])
    segments = np.concatenate([np.full(len(t), i) for i, (t, _) in enumerate(sequences)])
    token_weights = None
    if weights is not None:
        token_weights = np.concatenate([np.full(len(t), w, np.float32)
                                        for (t, _), w in zip(sequences, weights)])
    return Batch(tokens, labels, token_weights, positions, segments)
