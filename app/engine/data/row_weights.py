"""Reward weights: where each row's weight comes from, and how the weights are normalised.

Reward-weighted SFT scales each sequence's cross-entropy by a per-row weight (every trained
token of the row carries it). Sources, in order:

* a separate weights file, when given: either one number per line, the k-th number for the k-th
  non-blank line of the dataset (rejected rows count, so nothing shifts; blank lines are
  skipped in both files), or JSONL ``{"id": ..., "reward": ...}`` (or ``"weight"``) matched to
  rows by their ``"id"`` field (ids compare as strings, so 7 and "7" match). With a file, the
  rows' own weight fields are ignored; a row without a matching id is rejected.
* the row's ``"weight"`` field, else its ``"reward"`` field (or the field named in the config);
* 1.0 for rows that have none.

Normalisations (computed over the accepted rows of the training file and applied unchanged to
a separate validation file):

* ``none``:     the raw numbers;
* ``mean-std``: (r - mean) / std: below-average rows get negative weights (pushing their
  likelihood down), so it needs negative weights allowed; constant rewards give 1.0;
* ``min-max``:  (r - min) / (max - min), in [0, 1]; constant rewards give 1.0;
* ``clip``:     r clipped to [lo, hi].

A negative final weight is refused unless allowed: the configuration is refused up front for
``mean-std`` and for a clip range below 0, and with ``none`` each row with a negative weight is
rejected. Rows whose final weight is 0 are kept in the counts but never put into a window:
their loss would be zero, and they would only dilute the per-token average.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np

from app.engine.errors import ConfigError, DatasetError
from app.engine.data.formats import NEGATIVE_WEIGHT, NO_WEIGHT, Rejection, as_float, iter_lines
from app.engine.runtime.inputs import StopCheck
from app.engine.runtime.files import loads_json

NORMALIZATIONS = ("none", "mean-std", "min-max", "clip")


def check_normalization(method: str, clip_range, allow_negative: bool) -> None:
    """Raise ConfigError for an unknown method or one that would give refused negative weights."""
    if method not in NORMALIZATIONS:
        raise ConfigError(f"Unknown weight normalisation {method!r}.",
                          "Use one of: " + ", ".join(NORMALIZATIONS) + ".")
    if method == "clip":
        if clip_range is None or len(clip_range) != 2 or not all(
                isinstance(v, (int, float)) and math.isfinite(v) for v in clip_range) \
                or clip_range[0] > clip_range[1]:
            raise ConfigError("Clipping weights needs a range (lo, hi) with lo <= hi.",
                              "For example clip_range=(0, 1).")
        if clip_range[0] < 0 and not allow_negative:
            raise ConfigError(f"The clip range {tuple(clip_range)} allows negative weights.",
                              "Allow negative weights, or clip to a range starting at 0 or above.")
    if method == "mean-std" and not allow_negative:
        raise ConfigError("Mean/std normalisation gives below-average rows negative weights.",
                          "Allow negative weights to train away from them, or use min-max "
                          "normalisation (weights in [0, 1]).")


# ---- the weights file -------------------------------------------------------------------------

@dataclass(frozen=True)
class WeightsFile:
    """by_row: one weight per dataset row (plain numbers); by_id: id -> weight (JSONL)."""

    path: str
    by_row: np.ndarray | None = None
    by_id: dict[str, float] | None = None


def _number(value, where: str) -> float:
    number = math.nan if isinstance(value, bool) or not isinstance(value, (int, float)) \
        else as_float(value)
    if not math.isfinite(number):
        raise DatasetError(f"{where}: the weight must be a finite number, got {value!r:.40}.",
                           "Fix that line of the weights file.")
    return number


def read_weights_file(path, should_stop=None) -> WeightsFile:
    """Read a weights file (streaming; `should_stop`: see `StopCheck`). Raises DatasetError
    with the line number of a bad line, or when the file is not a regular file."""
    name = os.path.basename(os.fspath(path))
    numbers: list[float] = []
    by_id: dict[str, float] = {}
    mode = None
    stop = StopCheck(should_stop, f"reading {name}")
    for line, raw in iter_lines(path, what="weights file", stop=stop):
        where = f"{name} line {line}"
        try:
            text = raw.decode("utf-8").strip() if raw is not None else ""
        except UnicodeDecodeError:
            raise DatasetError(f"{where} is not valid UTF-8.", "Fix that line of the weights file.")
        if mode is None:
            mode = "id" if text.startswith("{") else "row"
        if mode == "row":
            try:
                numbers.append(_number(float(text), where))
            except ValueError:
                raise DatasetError(f"{where}: expected a number, got {text[:40]!r}.",
                                   "Write one number per line, or JSONL {\"id\": ..., "
                                   "\"reward\": ...} rows.") from None
            continue
        try:
            obj = loads_json(text)
        except ValueError as exc:
            raise DatasetError(f"{where}: invalid JSON ({getattr(exc, 'msg', exc)}).",
                               "Fix that line of the weights file.") from None
        if not isinstance(obj, dict) or "id" not in obj or not ("reward" in obj or "weight" in obj):
            raise DatasetError(f'{where}: expected {{"id": ..., "reward": ...}}.',
                               'Give every line an "id" and a "reward" (or "weight").')
        key = str(obj["id"])
        if key in by_id:
            raise DatasetError(f"{where}: the id {key!r} appears twice.",
                               "Give each id one weight.")
        by_id[key] = _number(obj.get("weight", obj.get("reward")), where)
    if mode is None:
        raise DatasetError(f"The weights file {name} is empty.", "Write one weight per row.")
    if mode == "row":
        return WeightsFile(os.fspath(path), by_row=np.asarray(numbers, dtype=np.float64))
    return WeightsFile(os.fspath(path), by_id=by_id)


# ---- normalisation ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Normalizer:
    """A fitted normalisation: final = scale * (raw - shift), then clipped to [lo, hi]."""

    method: str = "none"
    shift: float = 0.0
    scale: float = 1.0
    lo: float = -math.inf
    hi: float = math.inf
    constant: bool = False          # mean-std / min-max over equal rewards: every weight is 1

    def __call__(self, raw: np.ndarray) -> np.ndarray:
        if self.constant:
            return np.ones_like(raw)
        return np.clip(self.scale * (raw - self.shift), self.lo, self.hi)

    def to_dict(self) -> dict:
        out = {"method": self.method}
        if self.method == "mean-std":
            out.update(mean=self.shift, std=1.0 / self.scale if not self.constant else 0.0)
        elif self.method == "min-max":
            out.update(min=self.shift, max=self.shift + (1.0 / self.scale if not self.constant else 0.0))
        elif self.method == "clip":
            out.update(lo=self.lo, hi=self.hi)
        return out


def fit_normalizer(raw: np.ndarray, method: str, clip_range=None) -> Normalizer:
    if method == "clip":
        return Normalizer("clip", lo=float(clip_range[0]), hi=float(clip_range[1]))
    if method == "none" or raw.size == 0:
        return Normalizer(method)
    if method == "mean-std":
        mean, std = float(raw.mean()), float(raw.std())
        return Normalizer(method, mean, 1.0 / std if std > 0 else 1.0, constant=std == 0)
    lo, hi = float(raw.min()), float(raw.max())
    return Normalizer(method, lo, 1.0 / (hi - lo) if hi > lo else 1.0, constant=hi == lo)


def summary_stats(values: np.ndarray) -> dict | None:
    if values.size == 0:
        return None
    return {"min": float(values.min()), "max": float(values.max()),
            "mean": float(values.mean()), "std": float(values.std())}


# ---- resolving every row's weight -------------------------------------------------------------

@dataclass
class Weights:
    """Final weights of the accepted rows (NaN where a row is rejected), the rejections, and a
    summary for the report."""

    final: np.ndarray
    rejected: dict[int, Rejection] = field(default_factory=dict)   # row index -> why
    summary: dict = field(default_factory=dict)
    normalizer: Normalizer = field(default_factory=Normalizer)

    @property
    def uniform(self) -> bool:
        ok = self.final[~np.isnan(self.final)]
        return bool(np.all(ok == 1.0))


def resolve_weights(raw: np.ndarray, rows: np.ndarray, lines: np.ndarray, ids: list[str | None], *,
                    n_rows: int, weights_file: WeightsFile | None = None,
                    field_name: str | None = None, method: str = "none", clip_range=None,
                    allow_negative: bool = False,
                    normalizer: Normalizer | None = None) -> Weights:
    """Weights of the accepted rows of one file.

    raw (N,) the rows' own weights (NaN: none); rows (N,) their ordinals among the file's
    n_rows non-blank lines; lines (N,) line numbers; ids their "id" fields. `normalizer`: reuse
    one fitted on the training file (for a validation file); otherwise it is fitted here.
    """
    n = len(raw)
    rejected: dict[int, Rejection] = {}
    source = "none"
    if weights_file is not None:
        source = "file"
        if weights_file.by_row is not None:
            if len(weights_file.by_row) != n_rows:
                raise DatasetError(
                    f"The weights file {os.path.basename(weights_file.path)} has "
                    f"{len(weights_file.by_row)} numbers for {n_rows} dataset rows.",
                    "Write exactly one number per non-blank line of the dataset, in order.")
            values = weights_file.by_row[rows] if n else np.zeros(0)
        else:
            values = np.full(n, np.nan)
            for i, key in enumerate(ids):
                if key is None or key not in weights_file.by_id:
                    rejected[i] = Rejection(int(lines[i]), NO_WEIGHT, (
                        'no "id" to match the weights file' if key is None
                        else f"the weights file has no weight for id {key!r}"))
                else:
                    values[i] = weights_file.by_id[key]
        missing = 0
    else:
        values = raw.astype(np.float64, copy=True)
        missing = int(np.isnan(values).sum())
        if missing < n:
            source = "row"
        values[np.isnan(values)] = 1.0
    ok = np.array([i not in rejected for i in range(n)], dtype=bool)
    if normalizer is None:
        normalizer = fit_normalizer(values[ok], method, clip_range)
    final = np.full(n, np.nan)
    final[ok] = normalizer(values[ok])
    if not allow_negative:
        for i in np.flatnonzero(ok & (final < 0)).tolist():
            rejected[i] = Rejection(int(lines[i]), NEGATIVE_WEIGHT,
                                    f"negative weight {values[i]:g} (allow negative weights, or "
                                    "normalise with min-max)")
            final[i] = np.nan
    kept = final[~np.isnan(final)]
    summary = {
        "source": source,
        "field": field_name or ("weight/reward" if source == "row" else None),
        "file": os.fspath(weights_file.path) if weights_file else None,
        "normalization": normalizer.to_dict(),
        "rows_without_weight": missing,
        "raw": summary_stats(values[~np.isnan(final)]) if source != "none" else None,
        "final": summary_stats(kept),
        "zero": int((kept == 0).sum()),
        "negative": int((kept < 0).sum()),
    }
    return Weights(final, rejected, summary, normalizer)
