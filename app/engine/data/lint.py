"""The dataset linter: what a dataset file will become under a model's tokenizer and a config.

`lint_dataset` streams the file once (it keeps a few numbers per row, never the text or the
tokens) and applies exactly the rules training applies (`app.engine.data.dataset`), so its counts are
the run's counts. `dataset_report` gives the same report for an already loaded `Dataset`.
`lint_file` is the command's entry point (`workbench lint DATA.jsonl --model MODEL.gguf`).

The report: the format (and whether it was detected), rows accepted and rejected (each rejected
row with its line number, kind and reason), a histogram of row lengths in tokens against the
context, how many rows are truncated, split or dropped, the trained-token fraction, weight
statistics, and one example rendered as the model sees it with the trained tokens marked.
"""

from __future__ import annotations

import os
from array import array
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from app.engine.data.dataset import (DataConfig, Dataset, ProgressFn, RowTable, StopFn,
                                     encoded_rows, resolve_format)
from app.engine.data.formats import Rejection, RejectionLog
from app.engine.data.row_weights import read_weights_file, resolve_weights
from app.engine.data.windows import DROPPED, SPLIT, STATUSES, TRUNCATED, fit
from app.engine.io.gguf import read_gguf
from app.engine.text.tokenizer import Tokenizer
from app.engine.runtime.inputs import StopCheck, check_input_file

MAX_LISTED = 1000        # rejected rows listed in the JSON report (all are counted)
TEXT_LISTED = 20         # ... in the text report
HIST_BINS = 10
MARK_OPEN, MARK_CLOSE = "\u27e6", "\u27e7"   # ⟦ ⟧ around trained text
EXAMPLE_CHARS = 2000     # the text report shows at most this much of the example
EXAMPLE_TOKENS = 1024    # the example is decoded from at most this many tokens


@dataclass
class LintReport:
    path: str
    format: str
    format_detected: bool
    context: int
    overflow: str
    rows: int                    # non-blank lines
    accepted: int
    rejected: list[Rejection]    # the first MAX_KEPT_REJECTIONS, by line
    rejected_by_kind: dict[str, int]   # all of them
    histogram: dict
    truncated: int
    split: int
    dropped: int
    tokens: int                  # tokens of the accepted rows, before the overflow rule
    positions: int               # input positions that reach windows (weight != 0)
    trained_tokens: int          # trained targets among them
    weights: dict
    example: dict | None
    notes: list[str] = field(default_factory=list)

    @property
    def rejected_count(self) -> int:
        return sum(self.rejected_by_kind.values())

    @property
    def trains(self) -> bool:
        """Whether training would learn from this file: a trained token in a row that fits (or
        is cut to fit) the context with a weight other than 0. False is what training refuses
        as "Nothing to train on" (rows dropped by the overflow rule train nothing): `lint`
        exits 1 then."""
        return self.trained_tokens > 0

    @property
    def training_rows(self) -> int:
        """The rows that train: accepted and not dropped by the overflow rule (a dropped row is
        accepted, being a good row, and trains nothing)."""
        return self.accepted - self.dropped

    @property
    def trained_token_fraction(self) -> float:
        return self.trained_tokens / self.positions if self.positions else 0.0

    def to_dict(self) -> dict:
        return {
            "path": self.path, "format": self.format, "format_detected": self.format_detected,
            "context": self.context, "overflow": self.overflow, "rows": self.rows,
            "accepted": self.accepted, "rejected_count": self.rejected_count,
            "rejected_by_kind": dict(sorted(self.rejected_by_kind.items())),
            "rejected": [r.to_dict() for r in self.rejected[:MAX_LISTED]],
            "histogram": self.histogram, "truncated": self.truncated, "split": self.split,
            "dropped": self.dropped, "tokens": self.tokens, "positions": self.positions,
            "trained_tokens": self.trained_tokens,
            "trained_token_fraction": round(self.trained_token_fraction, 6),
            "trains": self.trains, "training_rows": self.training_rows,
            "weights": self.weights, "example": self.example, "notes": self.notes,
        }

    def to_text(self) -> str:
        return "\n".join(_text_lines(self))


# ---- building the report ----------------------------------------------------------------------

def _histogram(lengths: np.ndarray, context: int) -> dict:
    """Row lengths in tokens: HIST_BINS bins up to context + 1 tokens (what fits), then one bin
    for longer rows."""
    fits = context + 1
    edges = sorted({int(round(k * fits / HIST_BINS)) for k in range(HIST_BINS + 1)})
    inside = lengths[lengths <= fits]
    counts = np.histogram(inside, bins=np.asarray(edges) + 0.5)[0]   # integers (lo, hi]
    over = int((lengths > fits).sum())
    bins = [{"from": lo + 1, "to": hi, "rows": int(c)}
            for lo, hi, c in zip(edges[:-1], edges[1:], counts)]
    bins.append({"from": fits + 1, "to": int(lengths.max()) if over else None, "rows": over})
    stats = {}
    if len(lengths):
        stats = {"min": int(lengths.min()), "median": float(np.median(lengths)),
                 "mean": round(float(lengths.mean()), 2), "p95": float(np.percentile(lengths, 95)),
                 "max": int(lengths.max())}
    return {"unit": "tokens", "context": context, "fits_up_to": fits, "bins": bins,
            "over_context": over, **stats}


def _example(tokenizer: Tokenizer, line: int, ids: np.ndarray, mask: np.ndarray) -> dict:
    """The row's tokens decoded (the first EXAMPLE_TOKENS), with the character spans of the
    trained tokens (runs of consecutive targets) and a copy of the text with them marked."""
    n_tokens, trained = len(ids), int(np.asarray(mask)[1:].sum())
    ids = [int(i) for i in ids[:EXAMPLE_TOKENS]]
    text = tokenizer.decode(ids)
    flags = [bool(m) for m in mask[:EXAMPLE_TOKENS]]
    spans, k = [], 0
    while k < len(ids):
        if not flags[k]:
            k += 1
            continue
        j = k
        while j < len(ids) and flags[j]:
            j += 1
        start = len(tokenizer.decode(ids[:k])) if k else 0
        end = len(tokenizer.decode(ids[:j]))
        if end > start:
            spans.append([start, end])
        k = j
    marked, pos = [], 0
    for a, b in spans:
        marked += [text[pos:a], MARK_OPEN, text[a:b], MARK_CLOSE]
        pos = b
    marked.append(text[pos:])
    return {"line": line, "tokens": n_tokens, "trained_tokens": trained,
            "shown_tokens": len(ids), "text": text, "trained_spans": spans,
            "marked": "".join(marked)}


def build_report(path: str, fmt: str, detected: bool, config: DataConfig, rows: int,
                 table: RowTable, rejected: RejectionLog, weights: dict,
                 example: dict | None) -> LintReport:
    trained_rows = (table.weights != 0) if len(table.weights) else np.zeros(0, bool)
    notes = []
    if weights.get("zero"):
        notes.append(f"{weights['zero']} row(s) have weight 0 and are not trained.")
    if weights.get("rows_without_weight") and weights.get("source") == "row":
        notes.append(f"{weights['rows_without_weight']} row(s) have no weight and count as 1.0.")
    return LintReport(
        path=path, format=fmt, format_detected=detected, context=config.context,
        overflow=config.overflow, rows=rows, accepted=rows - rejected.total,
        rejected=sorted(rejected.kept, key=lambda r: r.line), rejected_by_kind=dict(rejected.kinds),
        histogram=_histogram(table.n_tokens, config.context),
        truncated=table.status.count(TRUNCATED), split=table.status.count(SPLIT),
        dropped=table.status.count(DROPPED), tokens=int(table.n_tokens.sum()),
        positions=int(table.kept_positions[trained_rows].sum()),
        trained_tokens=int(table.kept_targets[trained_rows].sum()),
        weights=weights, example=example, notes=notes)


def lint_dataset(path, tokenizer: Tokenizer, config: DataConfig | None = None, *,
                 progress: ProgressFn | None = None, should_stop: StopFn | None = None) -> LintReport:
    """Lint a dataset file in one streaming pass. Raises DatasetError when the file cannot be
    read (or is not a regular file) or its format cannot be told (bad rows are reported, not
    raised); Cancelled when `should_stop` asks (see `StopCheck`)."""
    config = config or DataConfig()
    config.validate()
    path = os.fspath(path)
    check_input_file(path, "dataset")
    weights_file = (read_weights_file(config.weights_path, should_stop) if config.weights_path
                    else None)
    stop = StopCheck(should_stop, f"reading {os.path.basename(path)}")
    fmt, detected = resolve_format(path, config, stop)
    # a few numbers per row, in typed arrays (8 bytes each); ids only when a weights file needs them
    lines, rows, n_tokens, n_targets, kept_pos, kept_tgt = (array("q") for _ in range(6))
    raw, status = array("d"), array("b")
    keep_ids = weights_file is not None and weights_file.by_id is not None
    ids: list[str | None] = []
    rejected = RejectionLog()
    candidates: list[tuple[int, int, np.ndarray, np.ndarray]] = []   # a few rows for the example
    n_rows = plain_special = 0
    special_text = None
    for item in encoded_rows(path, tokenizer, config, fmt, progress, stop):
        n_rows += 1
        if isinstance(item, Rejection):
            rejected.add(item)
            continue
        e, mask = item.example, item.trained
        if item.plain_special:
            plain_special += 1
            special_text = special_text or item.plain_special
        f = fit(mask, config.context, config.overflow)
        if len(candidates) < 20:
            candidates.append((len(lines), e.line, item.ids, mask))
        lines.append(e.line)
        rows.append(e.row)
        raw.append(np.nan if e.weight is None else e.weight)
        if keep_ids:
            ids.append(e.row_id)
        n_tokens.append(len(mask))
        n_targets.append(f.targets)
        kept_pos.append(f.kept_positions)
        kept_tgt.append(f.kept_targets)
        status.append(STATUSES.index(f.status))

    def arr(a, dtype=np.int64):
        return np.frombuffer(a, dtype=dtype) if len(a) else np.zeros(0, dtype)
    weights = resolve_weights(
        arr(raw, np.float64), arr(rows), arr(lines), ids if keep_ids else [None] * len(lines),
        n_rows=n_rows, weights_file=weights_file, field_name=config.weight_field,
        method=config.normalize, clip_range=config.clip_range,
        allow_negative=config.allow_negative_weights)
    keep = ~np.isnan(weights.final)
    pick = np.flatnonzero(keep)
    table = RowTable(arr(lines)[pick], arr(n_tokens)[pick], arr(n_targets)[pick],
                     arr(kept_pos)[pick], arr(kept_tgt)[pick],
                     [STATUSES[s] for s in arr(status, np.int8)[pick].tolist()],
                     weights.final[pick])
    example = next((_example(tokenizer, line, tok_ids, mask)
                    for i, line, tok_ids, mask in candidates if keep[i]), None)
    report = build_report(path, fmt, detected, config, n_rows, table,
                          rejected.extend(weights.rejected.values()), weights.summary, example)
    if plain_special:
        report.notes.append(
            f"{plain_special} row(s) contain special-token text (e.g. {special_text}) that is "
            "tokenized as plain text; parse special tokens (--parse-special) to make it the token.")
    return report


def dataset_report(ds: Dataset) -> LintReport:
    """The linter's report for a loaded dataset (its training file)."""
    t = ds.train_file
    keep = np.flatnonzero(~np.isnan(ds.weights.final))
    example = None
    if len(keep):
        line, ids, mask = ds.row(int(keep[0]))
        example = _example(ds.tokenizer, line, ids, mask)
    return build_report(t.path, t.format, t.detected, ds.config, t.n_rows, ds.table,
                        ds.rejections, ds.weights.summary, example)


def lint_tokenizer(model_path, config: DataConfig,
                   context: int | None) -> tuple[Tokenizer, int, list[str]]:
    """(the model file's tokenizer, the context to lint with, notes): `context` (else the
    config's) capped at the model's own context length, said in a note."""
    gguf = read_gguf(model_path)
    try:
        meta = gguf.metadata
        tokenizer = Tokenizer.from_metadata(meta)
        arch = meta.get("general.architecture")
        model_ctx = meta.get(f"{arch}.context_length")
    finally:
        gguf.close()
    ctx = context if context is not None else config.context
    notes = []
    if context is None and isinstance(model_ctx, (int, np.integer)) and 0 < model_ctx < ctx:
        notes.append(f"context lowered from {ctx} to the model's {int(model_ctx)}")
        ctx = int(model_ctx)
    return tokenizer, ctx, notes


def lint_file(data_path, model_path, config: DataConfig | None = None, *,
              context: int | None = None) -> LintReport:
    """Lint with a model file's tokenizer and chat template. `context` (else the config's)
    is capped at the model's own context length."""
    config = config or DataConfig()
    tokenizer, ctx, notes = lint_tokenizer(model_path, config, context)
    from dataclasses import replace

    report = lint_dataset(data_path, tokenizer, replace(config, context=ctx))
    report.notes = notes + report.notes
    return report


# ---- text -------------------------------------------------------------------------------------

def _fmt_stats(s: dict | None) -> str:
    if not s:
        return "-"
    return " ".join(f"{k} {v:.4g}" for k, v in s.items())


def _weights_text(w: dict) -> list[str]:
    source = w.get("source")
    norm = w.get("normalization", {}).get("method", "none")
    if source == "none" and norm == "none":
        return ["weights: none (every row weighs 1)"]
    origin = {"file": f"from {os.path.basename(w.get('file') or '')}",
              "row": f"from the rows' {w.get('field') or 'weight/reward'} field",
              "none": "no weights in the rows"}[source]
    out = [f"weights: {origin}; normalisation: {norm}"]
    if w.get("raw"):
        out.append(f"  raw:   {_fmt_stats(w['raw'])}")
    out.append(f"  final: {_fmt_stats(w.get('final'))}")
    return out


def _text_lines(r: LintReport) -> list[str]:
    name = os.path.basename(r.path)
    how = "detected" if r.format_detected else "as chosen"
    out = [f"{name}: {r.format} format ({how}), context {r.context} positions "
           f"(rows of up to {r.context + 1} tokens fit), overflow: {r.overflow}",
           # a row the overflow rule drops is not accepted: it trains nothing
           f"rows: {r.training_rows} accepted, "
           + (f"{r.dropped} dropped as longer than the context, " if r.dropped else "")
           + f"{r.rejected_count} rejected (of {r.rows})"]
    if r.rejected:
        out.append("rejected rows:")
        shown = r.rejected[:TEXT_LISTED]
        out += [f"  line {x.line}: {x.reason}" for x in shown]
        if r.rejected_count > len(shown):
            kinds = Counter(r.rejected_by_kind)
            out.append(f"  ... and {r.rejected_count - len(shown)} more ("
                       + ", ".join(f"{k}: {v}" for k, v in kinds.most_common())
                       + f"; --json lists the first {MAX_LISTED})")
    h = r.histogram
    if r.accepted and h.get("bins"):
        out.append("row lengths in tokens:")
        top = max(b["rows"] for b in h["bins"]) or 1
        for i, b in enumerate(h["bins"]):
            last = i == len(h["bins"]) - 1
            label = f">{h['fits_up_to']}" if last else f"{b['from']}-{b['to']}"
            out.append(f"  {label:>13} | {'#' * round(40 * b['rows'] / top):<40} {b['rows']}")
        out.append(f"  min {h['min']}, median {h['median']:g}, mean {h['mean']:g}, "
                   f"p95 {h['p95']:g}, max {h['max']}")
    out.append(f"longer than the context: {h.get('over_context', 0)} rows "
               f"({r.truncated} truncated, {r.split} split, {r.dropped} dropped)")
    out.append(f"trained tokens: {r.trained_tokens:,} of {r.positions:,} positions "
               f"({100 * r.trained_token_fraction:.1f}%)")
    out += _weights_text(r.weights)
    out += [f"note: {n}" for n in r.notes]
    if not r.trains:
        out.append("nothing would train: no row keeps a trained token in the context with a "
                   "weight other than 0 (training stops with 'Nothing to train on')")
    if r.example:
        ex = r.example
        out.append(f"example (line {ex['line']}, {ex['tokens']} tokens, {ex['trained_tokens']} "
                   f"trained, marked {MARK_OPEN} {MARK_CLOSE}):")
        text = ex["marked"]
        if len(text) > EXAMPLE_CHARS:
            text = text[:EXAMPLE_CHARS] + " [...]"
        out += ["  " + line for line in text.split("\n")]
    return out
