"""Training data: a JSONL file -> tokenized rows (cached) -> reward-weighted windows -> Batches.

The train loop's interface::

    ds = load_dataset("chat.jsonl", tokenizer, DataConfig(context=512, val_fraction=0.1))
    for micro_batches in ds.train_batches(epoch, grad_accum=4):   # one optimizer step each
        session.step(micro_batches)
    loss, acc = session.evaluate(ds.val_batches())
    ds.stats, ds.skipped                                          # counts; rejected rows

The pieces: `app.engine.data.formats` (rows -> examples, bad rows -> rejections), `app.engine.data.loss_masks`
(examples -> tokens and loss masks, BOS/EOS rules), `app.engine.data.row_weights` (weights),
`app.engine.data.windows` (context overflow, packing, padding; the label convention),
`app.engine.data.cache` (tokenize once) and `app.engine.data.lint` (the report).

Bad rows never crash a run and never pass silently: by default they are skipped and listed in
`Dataset.skipped` (line number, kind, reason); with ``strict=True`` any bad row makes
`load_dataset` refuse with a DatasetError. A dataset with nothing left to train on is refused
either way.

Order and split. The training pieces are packed into windows once (first-fit over an order
shuffled with the seed), and the windows are shuffled every epoch with ``(seed, epoch)``: every
epoch has the same number of steps, and an epoch's batches are a pure function of the data, the
config and the epoch (`train_batches(epoch, grad_accum, start_step)` resumes mid-epoch). Packed
sequences never attend to each other, so which pieces share a window does not change their
gradients.

The validation rows are either a separate file (`val_path`) or a fraction of the rows chosen by
a seeded hash of each row's text: the same rows whatever the file order, duplicates stay on one
side, and exactly round(fraction * rows) rows (at least one, never all). Validation batches are
unweighted (plain cross-entropy over the trained tokens, comparable whatever the reward
settings); rows whose weight is 0 are left out of validation as they are of training.

Memory: the tokenized rows live in flat arrays (5 bytes per token) plus a few numbers per row;
the linter (`app.engine.data.lint`) keeps only the numbers.
"""

from __future__ import annotations

import math
import os
from array import array
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from typing import Callable, ClassVar, Iterator

import numpy as np

from app.engine.data import cache as data_cache
from app.engine.errors import ConfigError, DatasetError
from app.engine.data.formats import (FORMATS, Example, Rejection, RejectionLog, detect_format,
                                     read_examples)
from app.engine.data.loss_masks import Encoded, Encoder
from app.engine.data.row_weights import (NORMALIZATIONS, Weights, WeightsFile, check_normalization,
                                         read_weights_file, resolve_weights)
from app.engine.runtime.inputs import NEVER, StopCheck, check_input_file
from app.engine.runtime.schema import ANY, AT_LEAST_0, AT_LEAST_1, FRACTION, TEXT
from app.engine.text.tokenizer import Tokenizer
from app.engine.data.batches import Batch
from app.engine.data.windows import (DROPPED, OVERFLOW, PACKING, SPLIT, STATUSES, TRUNCATED,
                                     Sequences, build_batch, fit, plan_windows)

CHAT_LOSS = ("assistant", "last")
BLOCK_ROWS = 512  # rows rendered and tokenized per batch
_IMPLEMENTATION = 1  # bump when tokens or masks of a cached dataset would change


@dataclass(frozen=True)
class DataConfig:
    """How a dataset file becomes training windows.

    format: "auto" (detected from the first rows) or one of text, completion, chat, alpaca,
      sharegpt (`app.engine.data.formats`).
    context: positions per window; a row fits when it has at most context + 1 tokens.
    overflow: "truncate" | "split" | "drop" rows longer than that (`app.engine.data.windows`).
    packing: "pack" short rows into shared windows | "pad" each to the context | "none".
    shuffle, seed: the packing order and the per-epoch order of the training windows.
    val_fraction / val_path: the validation rows (a seeded fraction, or a separate file).
    strict: refuse to load when any row is bad (default: skip and report bad rows).
    add_eos: append EOS after text/completion rows and open-ended chats (`app.engine.data.loss_masks`).
    parse_special: in text/completion rows, turn special-token texts such as <|im_end|> into
      their tokens (chat rows always are, the template's markup being special tokens).
    chat_loss: "assistant" (every assistant turn) or "last" (the final assistant turn only).
    completion_as_chat: render prompt/completion rows with the chat template as a user and an
      assistant turn, instead of joining the two texts.
    chat_template: a template to use instead of the model's (None: the model's, else ChatML).
    weight_field: the row field with the reward weight (None: "weight", else "reward").
    weights_path: a separate weights file (`app.engine.data.row_weights`).
    normalize: "none" | "mean-std" | "min-max" | "clip" (with clip_range (lo, hi)).
    allow_negative_weights: train with negative weights (pushing those rows' likelihood down).
    """

    format: str = "auto"
    context: int = 512
    overflow: str = "truncate"
    packing: str = "pack"
    shuffle: bool = True
    seed: int = 0
    val_fraction: float = 0.0
    val_path: str | None = None
    strict: bool = False
    add_eos: bool = True
    parse_special: bool = False
    chat_loss: str = "assistant"
    completion_as_chat: bool = False
    chat_template: str | None = None
    weight_field: str | None = None
    weights_path: str | None = None
    normalize: str = "none"
    clip_range: tuple[float, float] | None = None
    allow_negative_weights: bool = False

    SCHEMA_RULES: ClassVar[dict] = dict(  # app.engine.runtime.schema: what the types cannot say
        format=("auto", *FORMATS), context=AT_LEAST_1, overflow=OVERFLOW, packing=PACKING,
        seed=AT_LEAST_0, val_fraction=FRACTION, val_path=TEXT, chat_loss=CHAT_LOSS,
        chat_template=TEXT, weight_field=TEXT, weights_path=TEXT, normalize=NORMALIZATIONS,
        clip_range=ANY)

    def validate(self) -> None:
        def choice(name, options):
            if getattr(self, name) not in options:
                raise ConfigError(f"Unknown {name.replace('_', ' ')} {getattr(self, name)!r}.",
                                  "Use one of: " + ", ".join(options) + ".")
        choice("format", ("auto", *FORMATS))
        choice("overflow", OVERFLOW)
        choice("packing", PACKING)
        choice("chat_loss", CHAT_LOSS)
        if not isinstance(self.context, int) or self.context < 1:
            raise ConfigError(f"The context must be a positive number of tokens, got {self.context!r}.")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"The validation fraction must be in [0, 1), got {self.val_fraction}.")
        if self.val_fraction and self.val_path:
            raise ConfigError("Both a validation fraction and a validation file are set.",
                              "Choose one of them.")
        check_normalization(self.normalize, self.clip_range, self.allow_negative_weights)

    def tokenization_key(self) -> dict:
        """The settings that change tokens, masks or accepted rows (part of the cache key)."""
        return {"format": self.format, "add_eos": self.add_eos, "parse_special": self.parse_special,
                "chat_loss": self.chat_loss, "completion_as_chat": self.completion_as_chat,
                "chat_template": self.chat_template, "weight_field": self.weight_field}

    def to_dict(self) -> dict:
        out = asdict(self)
        out["clip_range"] = list(self.clip_range) if self.clip_range is not None else None
        return out

    @classmethod
    def from_dict(cls, d: dict) -> DataConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"Unknown data settings: {', '.join(unknown)}.")
        d = dict(d)
        if d.get("clip_range") is not None:
            d["clip_range"] = tuple(d["clip_range"])
        return cls(**d)


# ---- one file, tokenized ----------------------------------------------------------------------

@dataclass
class Tokenized:
    """The accepted rows of one file as token sequences, with per-row facts, and its rejections.

    Row i (0..N-1) is seqs.ids(i) with mask seqs.mask(i); lines/rows/raw_weights/ids/digests
    are per accepted row (raw_weights NaN: the row has none). n_rows counts non-blank lines.
    rejected: the first MAX_KEPT_REJECTIONS rejections; rejected_kinds counts all of them.
    """

    path: str
    format: str
    detected: bool
    n_rows: int
    seqs: Sequences
    lines: np.ndarray
    rows: np.ndarray
    raw_weights: np.ndarray
    ids: list
    digests: np.ndarray
    rejected: list[Rejection]
    rejected_kinds: dict[str, int]
    from_cache: bool = False

    def to_arrays(self) -> dict[str, np.ndarray]:
        meta = {"path": self.path, "format": self.format, "detected": self.detected,
                "n_rows": self.n_rows, "ids": self.ids,
                "rejected": [[r.line, r.kind, r.reason] for r in self.rejected],
                "rejected_kinds": self.rejected_kinds}
        return {"tokens": self.seqs.tokens, "trained": self.seqs.trained, "starts": self.seqs.starts,
                "lines": self.lines, "rows": self.rows, "raw_weights": self.raw_weights,
                "digests": self.digests, "meta": data_cache.json_array(meta)}

    @classmethod
    def from_arrays(cls, path: str, a: dict[str, np.ndarray]) -> Tokenized | None:
        """From a cache entry; None when it is inconsistent (treated as corrupt)."""
        try:
            meta = data_cache.from_json_array(a["meta"])
            seqs = Sequences(a["tokens"].astype(np.int32, copy=False),
                             a["trained"].astype(bool, copy=False), a["starts"].astype(np.int64))
            n = len(seqs)
            ok = (len(a["lines"]) == len(a["rows"]) == len(a["raw_weights"]) == len(a["digests"])
                  == len(meta["ids"]) == n and seqs.starts[0] == 0
                  and seqs.starts[-1] == len(seqs.tokens) == len(seqs.trained)
                  and bool(np.all(np.diff(seqs.starts) >= 2)))
            if not ok:
                return None
            return cls(path, meta["format"], bool(meta["detected"]), int(meta["n_rows"]), seqs,
                       a["lines"].astype(np.int64), a["rows"].astype(np.int64),
                       a["raw_weights"].astype(np.float64), list(meta["ids"]),
                       a["digests"].astype(np.uint64),
                       [Rejection(int(l), str(k), str(r)) for l, k, r in meta["rejected"]],
                       {str(k): int(v) for k, v in meta["rejected_kinds"].items()},
                       from_cache=True)
        except Exception:  # a damaged entry is a cache miss
            return None


ProgressFn = Callable[[int, int, int], None]   # (rows read, bytes read, file size)
StopFn = Callable[[], object]                  # a true value ("pause", "cancel") stops


def encoded_rows(path, tokenizer: Tokenizer, config: DataConfig, fmt: str,
                 progress: ProgressFn | None = None,
                 stop: Callable[[], None] = NEVER) -> Iterator[Encoded | Rejection]:
    """Every non-blank line of the file as an `Encoded` row or a `Rejection`, in file order,
    streaming (rows are rendered and tokenized in blocks of BLOCK_ROWS). `progress` is called
    after each block; `stop` (a `StopCheck`) at every line read and every block."""
    encoder = Encoder(tokenizer, chat_template=config.chat_template,
                      parse_special=config.parse_special, add_eos=config.add_eos)
    size = os.path.getsize(path)
    read = [0]                 # bytes read so far (iter_lines reports every few MB)
    rows = 0
    block: list[Example | Rejection] = []
    pending: deque = deque()

    def done(results: list) -> list:
        nonlocal rows
        rows += len(results)
        if progress is not None:
            progress(rows, read[0], size)
        return results

    # Blocks are rendered here while the previous block is tokenized in a thread.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize") as pool:
        for item in read_examples(path, fmt, chat_loss=config.chat_loss,
                                  completion_as_chat=config.completion_as_chat,
                                  weight_field=config.weight_field,
                                  progress=lambda n: read.__setitem__(0, n), stop=stop):
            block.append(item)
            if len(block) >= BLOCK_ROWS:
                stop()
                pending.append(pool.submit(encoder.tokenize, encoder.prepare(block)))
                block = []
                while len(pending) > 1:
                    yield from done(pending.popleft().result())
        pending.append(pool.submit(encoder.tokenize, encoder.prepare(block)))
        while pending:
            yield from done(pending.popleft().result())


def resolve_format(path, config: DataConfig, stop: Callable[[], None] = NEVER) -> tuple[str, bool]:
    """(format, detected?) of a file under a config."""
    if config.format != "auto":
        return config.format, False
    return detect_format(path, stop), True


def _raw_bytes(a: np.ndarray, dtype) -> memoryview:
    """The bytes of `a` as `dtype`, without a copy when it already is (for array.frombytes)."""
    return memoryview(np.ascontiguousarray(a, dtype)).cast("B")


class _Rows:
    """The accepted rows of a file as they are tokenized, in growing flat buffers (`array`:
    amortised appends, handed to NumPy without a copy at the end): 5 bytes per token and about
    40 per row, never a Python object per token nor a NumPy array per row."""

    def __init__(self):
        self.tokens, self.trained = array("i"), array("b")
        self.starts, self.lines, self.rows = array("q", [0]), array("q"), array("q")
        self.raw, self.digests, self.ids = array("d"), array("Q"), []

    def add(self, item: Encoded) -> None:
        e = item.example
        self.tokens.frombytes(_raw_bytes(item.ids, np.int32))
        self.trained.frombytes(_raw_bytes(item.trained, np.bool_))
        self.starts.append(len(self.tokens))
        self.lines.append(e.line)
        self.rows.append(e.row)
        self.raw.append(math.nan if e.weight is None else e.weight)
        self.digests.append(e.digest)
        self.ids.append(e.row_id)

    def sequences(self) -> Sequences:
        return Sequences(np.frombuffer(self.tokens, np.int32) if self.tokens else
                         np.zeros(0, np.int32),
                         np.frombuffer(self.trained, np.bool_) if self.trained else
                         np.zeros(0, bool), np.frombuffer(self.starts, np.int64))

    @staticmethod
    def numbers(a: array, dtype) -> np.ndarray:
        return np.frombuffer(a, dtype) if len(a) else np.zeros(0, dtype)


def tokenize_file(path, tokenizer: Tokenizer, config: DataConfig, *, use_cache: bool = True,
                  progress: ProgressFn | None = None, should_stop: StopFn | None = None,
                  what: str = "dataset") -> Tokenized:
    """Tokenize a dataset file (`what` names it in errors), or take it from the cache. The file
    is read line by line and only the tokens are kept (see `_Rows`); `should_stop` is asked
    about every quarter second (`StopCheck`: a stop request raises Cancelled)."""
    path = os.fspath(path)
    stop = StopCheck(should_stop, f"reading {os.path.basename(path)}")
    # first read: checks that the file is a regular file (a pipe or a device: DatasetError)
    digest = data_cache.file_digest(path, what=what, stop=stop)
    template = config.chat_template if config.chat_template is not None else tokenizer.chat_template
    key = data_cache.cache_key({"impl": _IMPLEMENTATION, "file": digest,
                                "tokenizer": tokenizer.hash(), "template": template,
                                **config.tokenization_key()})
    if use_cache:
        cached = data_cache.load(key)
        if cached is not None:
            tokenized = Tokenized.from_arrays(path, cached)
            if tokenized is not None:
                tokenized.path = path
                return tokenized
    fmt, detected = resolve_format(path, config, stop)
    kept = _Rows()
    rejected = RejectionLog()
    n_rows = 0
    for item in encoded_rows(path, tokenizer, config, fmt, progress, stop):
        n_rows += 1
        if isinstance(item, Rejection):
            rejected.add(item)
        else:
            kept.add(item)
    tokenized = Tokenized(path, fmt, detected, n_rows, kept.sequences(),
                          kept.numbers(kept.lines, np.int64), kept.numbers(kept.rows, np.int64),
                          kept.numbers(kept.raw, np.float64), kept.ids,
                          kept.numbers(kept.digests, np.uint64), rejected.kept,
                          dict(rejected.kinds))
    if use_cache:
        data_cache.save(key, tokenized.to_arrays())
    return tokenized


# ---- the dataset ------------------------------------------------------------------------------

def _mix(digests: np.ndarray, seed: int) -> np.ndarray:
    """A seeded 64-bit hash of each row digest (splitmix64's finaliser)."""
    x = digests.astype(np.uint64) ^ np.uint64((seed * 0x9E3779B97F4A7C15 + 1) % (1 << 64))
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def split_rows(digests: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """(N,) bool, True for validation rows: the round(fraction * N) rows (at least one when
    fraction > 0 and N >= 2, never all) with the smallest seeded hash of their text."""
    n = len(digests)
    val = np.zeros(n, dtype=bool)
    k = int(round(fraction * n))
    if fraction > 0 and n >= 2:
        k = min(max(k, 1), n - 1)
    else:
        k = 0
    if k:
        order = np.lexsort((np.arange(n), _mix(digests, seed)))
        val[order[:k]] = True
    return val


@dataclass
class RowTable:
    """Per accepted row (after weights): what the context does to it, for reports.

    status: "fits" | "truncated" | "split" | "dropped"; kept_*: positions and trained targets
    that reach windows."""

    lines: np.ndarray
    n_tokens: np.ndarray
    n_targets: np.ndarray
    kept_positions: np.ndarray
    kept_targets: np.ndarray
    status: list[str]
    weights: np.ndarray


@dataclass(frozen=True)
class DatasetStats:
    format: str
    rows: int                 # non-blank lines of the training file
    accepted: int
    rejected: int
    train_rows: int
    val_rows: int
    truncated: int
    split: int
    dropped: int              # rows with nothing left to train after the context overflow rule
    zero_weight: int          # rows with weight 0 (kept out of every window)
    train_pieces: int
    train_positions: int      # input positions in the training pieces
    train_targets: int        # trained labels among them
    windows_per_epoch: int    # the same every epoch
    fill: float               # train positions / (windows * context)
    weighted: bool            # token weights are not all 1
    from_cache: bool


class Dataset:
    """A loaded dataset: see the module docstring. Build it with `load_dataset`."""

    def __init__(self, train: Tokenized, config: DataConfig, tokenizer: Tokenizer,
                 val_file: Tokenized | None = None, weights_file: WeightsFile | None = None):
        self.config, self.tokenizer = config, tokenizer
        self.train_file, self.val_file = train, val_file
        self.format = train.format
        self.pad_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0
        n = len(train.seqs)
        self.weights: Weights = resolve_weights(
            train.raw_weights, train.rows, train.lines, train.ids, n_rows=train.n_rows,
            weights_file=weights_file, field_name=config.weight_field, method=config.normalize,
            clip_range=config.clip_range, allow_negative=config.allow_negative_weights)
        ok = ~np.isnan(self.weights.final)
        self.rejections = RejectionLog()
        self.rejections.kept, self.rejections.kinds = list(train.rejected), Counter(train.rejected_kinds)
        self.rejections.extend(self.weights.rejected.values())
        self.skipped: list[Rejection] = self.rejections.kept     # the first MAX_KEPT_REJECTIONS
        self.val_skipped: list[Rejection] = list(val_file.rejected) if val_file else []
        in_val = np.zeros(n, dtype=bool)
        if config.val_fraction:
            idx = np.flatnonzero(ok & (self.weights.final != 0))
            in_val[idx[split_rows(train.digests[idx], config.val_fraction, config.seed)]] = True
        self.table, pieces = self._cut_rows(train, np.flatnonzero(ok))
        if config.strict:
            self._refuse_bad_rows()
        row_weight = self.weights.final[pieces[:, 0]]
        train_sel = ~in_val[pieces[:, 0]] & (row_weight != 0)
        self._train = pieces[train_sel]                       # (P, 3): row, start, end
        self._train_weights = row_weight[train_sel].astype(np.float32)
        self._train_rows = int((ok & ~in_val).sum())
        self.weighted = bool(np.any(self._train_weights != 1.0))
        if not len(self._train):
            raise DatasetError(self._nothing_to_train(int(in_val.sum())),
                               "Fix the rows, or raise the context.")
        if val_file is None:
            self._val_source, self._val = train, pieces[in_val[pieces[:, 0]]]
            self._val_rows = int(in_val.sum())
        else:
            self._val_source = val_file
            self._val = self._cut_rows(val_file, np.arange(len(val_file.seqs)))[1]
            self._val_rows = len(val_file.seqs)
        # Pack once (first-fit over a seeded shuffle): every epoch has the same windows, in its
        # own order, so steps per epoch are constant (schedules, progress, resume positions).
        lengths = self._train[:, 2] - self._train[:, 1] - 1
        order = (np.random.default_rng([config.seed, 1 << 20]).permutation(len(lengths))
                 if config.shuffle else np.arange(len(lengths)))
        self._windows = plan_windows(lengths, order, config.context, config.packing)
        self._val_batches: list[Batch] | None = None

    # -- rows -> pieces --
    def _cut_rows(self, t: Tokenized, idx: np.ndarray) -> tuple[RowTable, np.ndarray]:
        """The report table of rows `idx` and their window pieces (P, 3): row, start, end."""
        cfg = self.config
        flat, n_targets, kept_pos, kept_tgt, status = (array("q") for _ in range(5))
        for i in idx.tolist():
            f = fit(t.seqs.mask(i), cfg.context, cfg.overflow)
            for a, b in f.pieces:
                flat.extend((i, a, b))
            n_targets.append(f.targets)
            kept_pos.append(f.kept_positions)
            kept_tgt.append(f.kept_targets)
            status.append(STATUSES.index(f.status))

        def arr(a):
            return np.frombuffer(a, dtype=np.int64).copy() if len(a) else np.zeros(0, np.int64)
        table = RowTable(t.lines[idx], t.seqs.lengths[idx], arr(n_targets), arr(kept_pos),
                         arr(kept_tgt), [STATUSES[k] for k in status.tolist()],
                         self.weights.final[idx] if t is self.train_file else np.ones(len(idx)))
        return table, arr(flat).reshape(-1, 3)

    def _refuse_bad_rows(self) -> None:
        bad = [str(r) for r in self.skipped]
        total = self.rejections.total
        if self.val_file is not None:
            name = os.path.basename(self.val_file.path)
            bad += [f"{name} {r}" for r in self.val_skipped]
            total += sum(self.val_file.rejected_kinds.values())
        if bad:
            first = "; ".join(bad[:3])
            more = f" (and {total - 3} more)" if total > 3 else ""
            raise DatasetError(f"{total} bad row(s) in the dataset: {first}{more}.",
                               "Fix them (the linter lists them all), or let the run skip them.")

    def _nothing_to_train(self, held_out: int) -> str:
        t = self.train_file
        if not t.n_rows:
            return f"The dataset {os.path.basename(t.path)} has no rows."
        parts = [f"{self.rejections.total} of {t.n_rows} rows rejected"]
        dropped = self.table.status.count(DROPPED)
        if dropped:
            parts.append(f"{dropped} too long for a context of {self.config.context}")
        zero = self.weights.summary.get("zero", 0)
        if zero:
            parts.append(f"{zero} with weight 0")
        if held_out:
            parts.append(f"{held_out} held out for validation")
        first = f" (first: {self.skipped[0]})" if self.skipped else ""
        return "Nothing to train on: " + ", ".join(parts) + first + "."

    # -- windows and batches --
    def _epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self._windows)
        if not self.config.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.config.seed, epoch]).permutation(n)

    def train_windows(self, epoch: int) -> list[list[tuple[int, int, int]]]:
        """The epoch's windows in training order, each a list of pieces (row, start, end)."""
        return [[tuple(int(v) for v in self._train[i]) for i in self._windows[w]]
                for w in self._epoch_order(epoch)]

    def steps_per_epoch(self, grad_accum: int = 1, epoch: int = 0) -> int:
        """Optimizer steps in an epoch (the same for every epoch)."""
        return math.ceil(len(self._windows) / grad_accum)

    def _batch(self, source: Tokenized, pieces, weights) -> Batch:
        pad_to = self.config.context if self.config.packing == "pad" else 0
        return build_batch(source.seqs, pieces, weights, pad_to, self.pad_id)

    def train_batches(self, epoch: int = 0, grad_accum: int = 1,
                      start_step: int = 0) -> Iterator[list[Batch]]:
        """Micro-batches for each optimizer step of an epoch: lists of `grad_accum` windows (the
        last list may be shorter), starting at step `start_step` (to resume)."""
        if grad_accum < 1:
            raise ConfigError("grad_accum must be at least 1.")
        plan = [self._windows[w] for w in self._epoch_order(epoch)]
        for s in range(start_step * grad_accum, len(plan), grad_accum):
            step = []
            for w in plan[s:s + grad_accum]:
                pieces = [tuple(int(v) for v in self._train[i]) for i in w]
                weights = [float(self._train_weights[i]) for i in w] if self.weighted else None
                step.append(self._batch(self.train_file, pieces, weights))
            yield step

    def val_batches(self) -> list[Batch]:
        """The validation windows (file order, packed like training, unweighted); [] if none."""
        if self._val_batches is None:
            v = self._val
            lengths = v[:, 2] - v[:, 1] - 1
            plan = plan_windows(lengths, range(len(v)), self.config.context, self.config.packing)
            self._val_batches = [
                self._batch(self._val_source, [tuple(int(x) for x in v[i]) for i in w], None)
                for w in plan]
        return self._val_batches

    # -- facts --
    @cached_property
    def stats(self) -> DatasetStats:
        t, tab = self.train_file, self.table
        lengths = self._train[:, 2] - self._train[:, 1] - 1
        targets = sum(int(t.seqs.mask(i)[a + 1:b].sum()) for i, a, b in self._train.tolist())
        windows = len(self._windows)
        return DatasetStats(
            format=self.format, rows=t.n_rows, accepted=t.n_rows - self.rejections.total,
            rejected=self.rejections.total, train_rows=self._train_rows, val_rows=self._val_rows,
            truncated=tab.status.count(TRUNCATED), split=tab.status.count(SPLIT),
            dropped=tab.status.count(DROPPED), zero_weight=self.weights.summary.get("zero", 0),
            train_pieces=len(self._train), train_positions=int(lengths.sum()),
            train_targets=targets, windows_per_epoch=windows,
            fill=float(lengths.sum()) / max(windows * self.config.context, 1),
            weighted=self.weighted, from_cache=t.from_cache)

    def row(self, i: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(line, ids, trained mask) of accepted row i of the training file."""
        t = self.train_file
        return int(t.lines[i]), t.seqs.ids(i), t.seqs.mask(i)


def check_data_files(path, config: DataConfig) -> None:
    """DatasetError unless the dataset, the validation data and the weights file (those the
    config names) are regular files: said before a run folder is made for them."""
    check_input_file(path, "dataset")
    if config.val_path:
        check_input_file(config.val_path, "validation data")
    if config.weights_path:
        check_input_file(config.weights_path, "weights file")


def load_dataset(path, tokenizer: Tokenizer, config: DataConfig | None = None, *,
                 use_cache: bool = True, progress: ProgressFn | None = None,
                 should_stop: StopFn | None = None) -> Dataset:
    """Read, tokenize (or take from the cache), weight, split and window a dataset file.

    progress(rows read, bytes read, file size) is called while tokenizing; should_stop() is
    asked about every quarter second while reading any of the files (a true value raises
    Cancelled). Raises DatasetError (unreadable file, not a regular file, unknown format,
    nothing to train on, a bad row in strict mode, a bad weights file) or ConfigError.
    """
    config = config or DataConfig()
    config.validate()
    weights_file = (read_weights_file(config.weights_path, should_stop) if config.weights_path
                    else None)
    train = tokenize_file(path, tokenizer, config, use_cache=use_cache, progress=progress,
                          should_stop=should_stop)
    val = None
    if config.val_path:
        val = tokenize_file(config.val_path, tokenizer, config, use_cache=use_cache,
                            should_stop=should_stop, what="validation data")
    return Dataset(train, config, tokenizer, val, weights_file)
