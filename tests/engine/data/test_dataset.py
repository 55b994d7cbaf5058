"""Datasets: every format, every kind of bad row, weights and normalisations, split, shuffle, cache."""

from __future__ import annotations

import json
import os
import tracemalloc
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from app.engine.data import cache as data_cache
from app.engine.data import formats
from app.engine.data.dataset import DataConfig, load_dataset, split_rows, tokenize_file
from app.engine.errors import ConfigError, DatasetError
from app.engine.data.formats import Example, Rejection, detect_format, read_examples
from app.engine.text.tokenizer import load_tokenizer
from tests.conftest import VOCAB

VOCAB = VOCAB


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(data_cache.ENV_VAR, str(tmp_path / "cache"))
    return tmp_path / "cache" / "datasets"


@lru_cache(maxsize=None)
def qwen2():
    return load_tokenizer(VOCAB / "ggml-vocab-qwen2.gguf")


def write(path: Path, rows) -> Path:
    """rows: dicts (as JSON), str (a raw line) or bytes (raw bytes of a line)."""
    with open(path, "wb") as f:
        for row in rows:
            if isinstance(row, dict):
                row = json.dumps(row)
            f.write(row if isinstance(row, bytes) else row.encode("utf-8"))
            f.write(b"\n")
    return path


def examples(path, fmt, **kw) -> list:
    return list(read_examples(path, fmt, **kw))


CHAT = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}


# ---- formats ------------------------------------------------------------------------------------

def test_text_and_completion_rows(tmp_path):
    p = write(tmp_path / "d.jsonl", [
        {"text": "Once upon a time."},
        {"prompt": "Q: 2+2?", "completion": " 4"},
        {"prompt": "Q: 3+3?", "response": " 6"},
        {"prompt": "", "output": "seven"},
    ])
    text, = examples(p, "text")[:1]
    assert text.segments == (("Once upon a time.", True),) and text.line == 1 and text.row == 0
    _, c1, c2, c3 = examples(p, "completion")
    assert c1.segments == (("Q: 2+2?", False), (" 4", True))
    assert c2.segments == (("Q: 3+3?", False), (" 6", True))
    assert c3.segments == (("seven", True),)


def test_completion_as_chat_and_conversational_completions(tmp_path):
    p = write(tmp_path / "d.jsonl", [
        {"prompt": "2+2?", "completion": "4", "system": "Be brief."},
        {"prompt": [{"role": "user", "content": "Hi"}],
         "completion": [{"role": "assistant", "content": "Hello"}]},
    ])
    wrapped, conversational = examples(p, "completion", completion_as_chat=True)
    assert [m["role"] for m in wrapped.messages] == ["system", "user", "assistant"]
    assert wrapped.trained == (2,)
    assert conversational.messages[1] == {"role": "assistant", "content": "Hello"}
    assert conversational.trained == (1,)


def test_chat_alpaca_and_sharegpt_rows_become_chats(tmp_path):
    p = write(tmp_path / "d.jsonl", [
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
                      {"role": "assistant", "content": "A1", "weight": 0},
                      {"role": "user", "content": [{"type": "text", "text": "U"}, {"type": "text", "text": "2"}]},
                      {"role": "assistant", "content": "A2"}],
         "tools": [{"name": "calc"}]},
        {"instruction": "Add.", "input": "2 and 2", "output": "4", "system": "Math."},
        {"instruction": "Say hi.", "input": "", "output": "hi"},
        {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"},
                           {"from": "user", "value": "Q2"}, {"from": "assistant", "value": "A2"}],
         "system": "Sys"},
    ])
    chat = examples(p, "chat")[0]
    assert chat.messages[3]["content"] == "U2" and chat.trained == (4,)
    assert dict(chat.extra) == {"tools": [{"name": "calc"}]}
    alpaca, bare = examples(p, "alpaca")[1:3]
    assert alpaca.messages == ({"role": "system", "content": "Math."},
                               {"role": "user", "content": "Add.\n\n2 and 2"},
                               {"role": "assistant", "content": "4"})
    assert bare.messages[0] == {"role": "user", "content": "Say hi."}
    share = examples(p, "sharegpt")[3]
    assert [m["role"] for m in share.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert share.trained == (2, 4)
    last = list(read_examples(p, "sharegpt", chat_loss="last"))[3]
    assert last.trained == (4,)


@pytest.mark.parametrize("rows, fmt", [
    ([{"text": "a"}], "text"),
    ([{"prompt": "a", "completion": "b"}], "completion"),
    ([{"prompt": "a", "output": "b"}], "completion"),
    ([CHAT], "chat"),
    ([{"instruction": "a", "output": "b"}], "alpaca"),
    ([{"conversations": []}], "sharegpt"),
    (["not json", {"text": "a"}, {"text": "b"}, CHAT], "text"),   # the majority
    ([{"text": "a"}, CHAT], "chat"),                               # a tie: chat first
])
def test_format_detection(tmp_path, rows, fmt):
    assert detect_format(write(tmp_path / "d.jsonl", rows)) == fmt


def test_format_detection_refuses_unknown_files(tmp_path):
    with pytest.raises(DatasetError, match="not a JSONL dataset"):
        detect_format(write(tmp_path / "a.jsonl", ["hello", "world"]))
    with pytest.raises(DatasetError, match="question, answer") as e:
        detect_format(write(tmp_path / "b.jsonl", [{"question": "q", "answer": "a"}]))
    assert "format" in e.value.hint
    with pytest.raises(DatasetError, match="Cannot read"):
        detect_format(tmp_path / "missing.jsonl")


# ---- bad rows -----------------------------------------------------------------------------------

BAD_ROWS = [  # (line, expected kind, reason fragment)
    ('{"text": "ok"}', None, None),
    ('{"text": "unterminated', "invalid_json", "invalid JSON"),
    ("[1, 2]", "not_object", "got a list"),
    (b'{"text": "caf\xe9"}', "not_utf8", "byte 0xe9"),
    ('{"text": "\\ud800 lone"}', "not_utf8", "surrogate"),
    ('{"text": 5}', "wrong_type", '"text" must be a string, got a number'),
    ('{"text": "   "}', "empty", '"text" is empty'),
    ('{"prompt": "p", "completion": "c"}', "missing_key", "looks like the completion format"),
    ('{"text": "ok", "weight": "high"}', "bad_weight", "must be a number"),
    ('{"text": "ok", "reward": NaN}', "bad_weight", "finite"),
    ('{"text": "ok", "weight": true}', "bad_weight", "must be a number"),
]


def test_every_kind_of_bad_row_is_reported_with_its_line(tmp_path):
    lines = []
    for i, (row, _, _) in enumerate(BAD_ROWS):
        lines.append(row)
        if i == 3:
            lines.append("   ")   # blank lines are ignored but still counted as lines
    p = write(tmp_path / "d.jsonl", lines)
    out = examples(p, "text")
    assert len(out) == len(BAD_ROWS)
    expected_lines = [i + 1 + (i > 3) for i in range(len(BAD_ROWS))]
    for item, (_, kind, fragment), line in zip(out, BAD_ROWS, expected_lines):
        assert item.line == line
        if kind is None:
            assert isinstance(item, Example)
        else:
            assert isinstance(item, Rejection) and item.kind == kind, item
            assert fragment in item.reason


@pytest.mark.parametrize("row, kind, fragment", [
    ({"messages": "hi"}, "wrong_type", '"messages" must be a list'),
    ({"messages": []}, "empty", '"messages" is empty'),
    ({"messages": ["hi"]}, "wrong_type", "message 1 must be an object"),
    ({"messages": [{"content": "x"}]}, "missing_key", '"role" in message 1'),
    ({"messages": [{"role": "bot", "content": "x"}]}, "unknown_role", 'unknown role "bot"'),
    ({"messages": [{"role": "user"}]}, "missing_key", '"content" in message 1'),
    ({"messages": [{"role": "user", "content": None}]}, "wrong_type", "got null"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "wrong_type", "part"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no_assistant", "no assistant message"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " "}]},
     "empty", "message 2 (assistant) is empty"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "content": "y", "weight": 0}]},
     "nothing_to_train", "excluded"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "content": "y", "weight": 0.5}]}, "wrong_type", "0 or 1"),
    ({"messages": CHAT["messages"], "tools": "calc"}, "wrong_type", '"tools" must be a list'),
    ({"text": "hello"}, "missing_key", "looks like the text format; the dataset is chat"),
])
def test_bad_chat_rows(tmp_path, row, kind, fragment):
    (out,) = examples(write(tmp_path / "d.jsonl", [row]), "chat")
    assert isinstance(out, Rejection) and out.kind == kind and fragment in out.reason, out


@pytest.mark.parametrize("fmt, row, kind", [
    ("sharegpt", {"conversations": [{"from": "robot", "value": "x"}]}, "unknown_role"),
    ("sharegpt", {"conversations": [{"from": "human"}]}, "missing_key"),
    ("sharegpt", {"conversations": {"from": "human"}}, "wrong_type"),
    ("alpaca", {"instruction": "x"}, "missing_key"),
    ("alpaca", {"instruction": "", "output": "y"}, "empty"),
    ("alpaca", {"instruction": "x", "output": 3}, "wrong_type"),
    ("completion", {"prompt": "x"}, "missing_key"),
    ("completion", {"prompt": 1, "completion": "y"}, "wrong_type"),
    ("completion", {"prompt": "x", "completion": ""}, "empty"),
])
def test_bad_rows_of_the_other_formats(tmp_path, fmt, row, kind):
    (out,) = examples(write(tmp_path / "d.jsonl", [row]), fmt)
    assert isinstance(out, Rejection) and out.kind == kind, out


def test_reader_handles_bom_crlf_and_long_lines(tmp_path, monkeypatch):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"text": "a"}\r\n\r\n{"text": "' + b"x" * 5000 + b'"}\r\n{"text": "b"}')
    monkeypatch.setattr(formats, "MAX_LINE_BYTES", 1000)
    out = list(read_examples(p, "text"))
    assert isinstance(out[0], Example) and out[0].segments[0][0] == "a"
    assert isinstance(out[1], Rejection) and out[1].kind == "line_too_long" and out[1].line == 3
    assert isinstance(out[2], Example) and out[2].line == 4 and out[2].row == 2


def test_reader_streams(tmp_path):
    """Reading a ~6 MB file never holds more than a little of it in memory."""
    p = tmp_path / "big.jsonl"
    row = json.dumps({"text": "The cat sat on the mat. " * 20}) + "\n"
    p.write_text(row * 12000)
    tracemalloc.start()
    try:
        count = sum(1 for _ in read_examples(p, "text"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert count == 12000 and p.stat().st_size > 5e6
    assert peak < 1e6, peak


def test_tokenizing_keeps_memory_to_a_small_multiple_of_the_tokens(tmp_path):
    """A dataset's tokens are 5 bytes each in memory (int32 id + bool mask). The reader streams
    and keeps only those, in growing flat buffers: the traced peak while tokenizing 1.8 M tokens
    is about 6.8 bytes per token (the buffers' growth slack and a few blocks of rows in flight).
    The bound, 10 bytes per token plus 4 MB for the blocks in flight, is generous; keeping a
    NumPy array per row and concatenating them at the end (as before) peaked at 16.6."""
    import random
    rng = random.Random(0)
    words = "the quick brown fox jumps over lazy dog alpha beta gamma delta".split()
    p = tmp_path / "big.jsonl"
    with open(p, "w") as f:
        for _ in range(16000):
            f.write(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(20, 200)))})
                    + "\n")
    tok = qwen2()
    tracemalloc.start()
    try:
        t = tokenize_file(p, tok, DataConfig(), use_cache=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    tokens = len(t.seqs.tokens)
    assert tokens > 1_500_000 and t.seqs.tokens.dtype == np.int32
    assert peak < 10 * tokens + (4 << 20), peak / tokens


def test_row_ids_and_weights_are_read(tmp_path):
    p = write(tmp_path / "d.jsonl", [{"text": "a", "id": 7, "reward": 2}, {"text": "b", "id": "x"},
                                     {"text": "c", "id": [1], "weight": 0.5, "reward": 9}])
    a, b, c = examples(p, "text")
    assert (a.row_id, a.weight) == ("7", 2.0)
    assert (b.row_id, b.weight) == ("x", None)
    assert (c.row_id, c.weight) == (None, 0.5)        # "weight" wins over "reward"
    (c2,) = examples(p, "text", weight_field="reward")[2:]
    assert c2.weight == 9.0


# ---- loading: skip vs strict, errors ------------------------------------------------------------

def test_bad_rows_are_skipped_and_listed_or_refused_in_strict_mode(tmp_path):
    p = write(tmp_path / "d.jsonl", [CHAT, "{oops", CHAT, {"messages": [{"role": "bot", "content": "x"}]}])
    ds = load_dataset(p, qwen2(), DataConfig())
    assert [(r.line, r.kind) for r in ds.skipped] == [(2, "invalid_json"), (4, "unknown_role")]
    assert ds.stats.accepted == 2 and ds.stats.rejected == 2 and ds.stats.rows == 4
    with pytest.raises(DatasetError, match=r"2 bad row\(s\).*line 2: invalid JSON.*line 4"):
        load_dataset(p, qwen2(), DataConfig(strict=True))


def test_nothing_to_train_is_refused(tmp_path):
    with pytest.raises(DatasetError, match="has no rows"):
        load_dataset(write(tmp_path / "e.jsonl", []), qwen2(), DataConfig(format="text"))
    with pytest.raises(DatasetError, match="Nothing to train on: 2 of 2 rows rejected"):
        load_dataset(write(tmp_path / "b.jsonl", [{"text": ""}, {"text": 1}]), qwen2(),
                     DataConfig(format="text"))
    with pytest.raises(DatasetError, match="1 too long"):
        load_dataset(write(tmp_path / "l.jsonl", [{"text": "word " * 50}]), qwen2(),
                     DataConfig(context=8, overflow="drop"))


@pytest.mark.parametrize("kw, match", [
    (dict(format="csv"), "Unknown format"),
    (dict(overflow="wrap"), "Unknown overflow"),
    (dict(packing="tight"), "Unknown packing"),
    (dict(context=0), "context"),
    (dict(val_fraction=1.0), "fraction"),
    (dict(val_fraction=0.1, val_path="v.jsonl"), "Choose one"),
    (dict(normalize="zscore"), "normalisation"),
    (dict(normalize="mean-std"), "negative weights"),
    (dict(normalize="clip"), "range"),
    (dict(normalize="clip", clip_range=(2, 1)), "range"),
    (dict(normalize="clip", clip_range=(-1, 1)), "negative"),
])
def test_config_validation(kw, match):
    with pytest.raises(ConfigError) as e:
        DataConfig(**kw).validate()
    assert match in str(e.value)


def test_config_round_trips_through_json():
    cfg = DataConfig(context=128, normalize="clip", clip_range=(0.0, 2.0), val_fraction=0.2)
    assert DataConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ConfigError, match="bogus"):
        DataConfig.from_dict({"bogus": 1})


# ---- weights ------------------------------------------------------------------------------------

def rewards_file(tmp_path, rewards) -> Path:
    return write(tmp_path / "r.jsonl", [{"prompt": f"Q{i}?", "completion": f" A{i}.", "reward": r,
                                         "id": f"r{i}"} for i, r in enumerate(rewards)])


def weights_by_line(ds) -> dict[int, float]:
    t = ds.train_file
    return {int(t.lines[i]): float(ds.weights.final[i]) for i in range(len(t.seqs))
            if not np.isnan(ds.weights.final[i])}


@pytest.mark.parametrize("method, kw, expected", [
    ("none", {}, [0.0, 5.0, 10.0, 2.5]),
    ("min-max", {}, [0.0, 0.5, 1.0, 0.25]),
    ("clip", {"clip_range": (1.0, 6.0)}, [1.0, 5.0, 6.0, 2.5]),
    ("mean-std", {"allow_negative_weights": True},
     list((np.array([0, 5, 10, 2.5]) - 4.375) / np.array([0, 5, 10, 2.5]).std())),
])
def test_normalisations(tmp_path, method, kw, expected):
    ds = load_dataset(rewards_file(tmp_path, [0, 5, 10, 2.5]), qwen2(),
                      DataConfig(normalize=method, **kw))
    got = weights_by_line(ds)
    assert [got[i] for i in (1, 2, 3, 4)] == pytest.approx(expected)
    assert ds.weights.summary["normalization"]["method"] == method


def test_constant_rewards_weigh_one():
    from app.engine.data.row_weights import fit_normalizer
    for method in ("mean-std", "min-max"):
        assert fit_normalizer(np.array([3.0, 3.0]), method)(np.array([3.0, 3.0])).tolist() == [1, 1]


def test_token_weights_carry_the_row_weight_and_zero_rows_are_not_trained(tmp_path):
    ds = load_dataset(rewards_file(tmp_path, [0, 5, 10, 2.5]), qwen2(),
                      DataConfig(normalize="min-max", shuffle=False, packing="none"))
    batches = [b for step in ds.train_batches(0) for b in step]
    assert len(batches) == 3 and ds.stats.zero_weight == 1     # the 0-reward row has no window
    weights = sorted(float(b.token_weights[0]) for b in batches)
    assert weights == pytest.approx([0.25, 0.5, 1.0])
    for b in batches:
        assert np.all(b.token_weights == b.token_weights[0])
    unweighted = load_dataset(rewards_file(tmp_path, [1, 1, 1, 1]), qwen2(), DataConfig())
    assert all(b.token_weights is None for step in unweighted.train_batches(0) for b in step)


def test_negative_weights_are_rejected_unless_allowed(tmp_path):
    p = rewards_file(tmp_path, [1, -2, 3])
    ds = load_dataset(p, qwen2(), DataConfig())
    assert [(r.line, r.kind) for r in ds.skipped] == [(2, "negative_weight")]
    allowed = load_dataset(p, qwen2(), DataConfig(allow_negative_weights=True))
    assert not allowed.skipped and weights_by_line(allowed)[2] == -2.0
    assert load_dataset(p, qwen2(), DataConfig(normalize="min-max")).skipped == []


def test_weights_file_of_numbers(tmp_path):
    p = write(tmp_path / "d.jsonl", [{"text": "a b", "reward": 100}, "{bad json", "",
                                     {"text": "c d"}, {"text": "e f"}])
    w = tmp_path / "w.txt"
    w.write_text("0.5\n\n9\n2\n1.5\n")   # one number per non-blank data line, bad rows included
    ds = load_dataset(p, qwen2(), DataConfig(weights_path=str(w)))
    assert weights_by_line(ds) == {1: 0.5, 4: 2.0, 5: 1.5}       # the row's own reward is ignored
    assert ds.weights.summary["source"] == "file"
    w.write_text("1\n2\n")
    with pytest.raises(DatasetError, match="2 numbers for 4 dataset rows"):
        load_dataset(p, qwen2(), DataConfig(weights_path=str(w)))
    w.write_text("1\ntwo\n3\n4\n")
    with pytest.raises(DatasetError, match="w.txt line 2: expected a number"):
        load_dataset(p, qwen2(), DataConfig(weights_path=str(w)))


def test_weights_file_with_ids(tmp_path):
    p = write(tmp_path / "d.jsonl", [{"text": "a b", "id": 1}, {"text": "c d", "id": "two"},
                                     {"text": "e f"}, {"text": "g h", "id": "gone"}])
    w = write(tmp_path / "w.jsonl", [{"id": "1", "reward": 3}, {"id": "two", "weight": 4},
                                     {"id": "extra", "reward": 1}])
    ds = load_dataset(p, qwen2(), DataConfig(weights_path=str(w)))
    assert weights_by_line(ds) == {1: 3.0, 2: 4.0}
    assert [(r.line, r.kind) for r in ds.skipped] == [(3, "no_weight"), (4, "no_weight")]
    assert "gone" in ds.skipped[1].reason
    write(w, [{"id": 1, "reward": 3}, {"id": "1", "reward": 4}])
    with pytest.raises(DatasetError, match="line 2: the id '1' appears twice"):
        load_dataset(p, qwen2(), DataConfig(weights_path=str(w)))
    write(w, [{"id": 1, "reward": "x"}])
    with pytest.raises(DatasetError, match="finite number"):
        load_dataset(p, qwen2(), DataConfig(weights_path=str(w)))


# ---- split and shuffle --------------------------------------------------------------------------

def test_split_is_exact_seeded_and_independent_of_order():
    digests = np.arange(1000, 1100, dtype=np.uint64) * np.uint64(2654435761)
    val = split_rows(digests, 0.1, seed=0)
    assert val.sum() == 10
    perm = np.random.default_rng(1).permutation(100)
    assert np.array_equal(split_rows(digests[perm], 0.1, 0), val[perm])   # same rows, any order
    assert not np.array_equal(split_rows(digests, 0.1, 1), val)          # the seed matters
    assert split_rows(digests[:2], 0.01, 0).sum() == 1                    # at least one
    assert split_rows(digests[:1], 0.5, 0).sum() == 0                     # never all
    assert split_rows(digests, 0.0, 0).sum() == 0


def _stories(n):
    return [{"text": f"Story {i}: the cat number {i} sat on mat {i * 7}."} for i in range(n)]


def test_val_fraction_and_val_file(tmp_path):
    rows = _stories(40)
    a = load_dataset(write(tmp_path / "a.jsonl", rows), qwen2(), DataConfig(val_fraction=0.25))
    b = load_dataset(write(tmp_path / "b.jsonl", rows[::-1]), qwen2(), DataConfig(val_fraction=0.25))
    assert a.stats.val_rows == 10 and a.stats.train_rows == 30

    def val_texts(ds):
        return sorted(qwen2().decode(b.tokens[b.segments == s]) for b in ds.val_batches()
                      for s in np.unique(b.segments))
    assert val_texts(a) == val_texts(b)                  # the same rows, whatever the order
    assert all(b.token_weights is None for b in a.val_batches())
    c = load_dataset(write(tmp_path / "c.jsonl", rows), qwen2(),
                     DataConfig(val_path=str(write(tmp_path / "v.jsonl", _stories(3) + ["{x"]))))
    assert c.stats.val_rows == 3 and c.stats.train_rows == 40
    assert [r.line for r in c.val_skipped] == [4]
    assert sum(len(b.tokens) for b in c.val_batches()) > 0


def test_shuffle_is_seeded_per_epoch(tmp_path):
    p = write(tmp_path / "s.jsonl", _stories(30))
    cfg = DataConfig(context=64, packing="none")

    def order(ds, epoch):
        return [w[0][0] for w in ds.train_windows(epoch)]
    ds = load_dataset(p, qwen2(), cfg)
    again = load_dataset(p, qwen2(), cfg)
    assert order(ds, 0) == order(again, 0) and order(ds, 1) == order(again, 1)
    assert order(ds, 0) != order(ds, 1) and sorted(order(ds, 0)) == list(range(30))
    other_seed = load_dataset(p, qwen2(), DataConfig(context=64, packing="none", seed=5))
    assert order(other_seed, 0) != order(ds, 0)
    fixed = load_dataset(p, qwen2(), DataConfig(context=64, packing="none", shuffle=False))
    assert order(fixed, 0) == order(fixed, 3) == list(range(30))


# ---- the cache ----------------------------------------------------------------------------------

def test_cache_hit_miss_and_key(tmp_path, cache_dir):
    p = write(tmp_path / "c.jsonl", [CHAT] * 3 + ["{bad"])
    first = tokenize_file(p, qwen2(), DataConfig())
    assert not first.from_cache and len(list(cache_dir.glob("*.npz"))) == 1
    second = tokenize_file(p, qwen2(), DataConfig(context=7, normalize="min-max", seed=3))
    assert second.from_cache                              # windows/weights settings: same entry
    assert np.array_equal(first.seqs.tokens, second.seqs.tokens)
    assert np.array_equal(first.seqs.trained, second.seqs.trained)
    assert second.rejected == first.rejected and second.format == "chat"
    assert not tokenize_file(p, qwen2(), DataConfig(chat_loss="last")).from_cache
    gpt2 = load_tokenizer(VOCAB / "ggml-vocab-gpt-2.gguf")
    assert not tokenize_file(p, gpt2, DataConfig()).from_cache       # another tokenizer
    write(p, [CHAT] * 4)
    assert not tokenize_file(p, qwen2(), DataConfig()).from_cache    # the file changed
    assert not list(cache_dir.glob("*.tmp"))                          # atomic writes left nothing
    assert not tokenize_file(p, qwen2(), DataConfig(), use_cache=False).from_cache


def test_corrupt_cache_is_rebuilt(tmp_path, cache_dir):
    p = write(tmp_path / "c.jsonl", [CHAT] * 3)
    tokenize_file(p, qwen2(), DataConfig())
    (entry,) = cache_dir.glob("*.npz")
    good = entry.read_bytes()
    for damage in (good[: len(good) // 2], b"garbage", b""):
        entry.write_bytes(damage)
        rebuilt = tokenize_file(p, qwen2(), DataConfig())
        assert not rebuilt.from_cache and len(rebuilt.seqs) == 3
        assert tokenize_file(p, qwen2(), DataConfig()).from_cache    # rewritten
    arrays = dict(np.load(entry))
    arrays["starts"] = arrays["starts"][:-1]                           # inconsistent arrays
    np.savez(entry, **arrays)
    assert not tokenize_file(p, qwen2(), DataConfig()).from_cache


def test_clear_cache(tmp_path, cache_dir):
    p = write(tmp_path / "c.jsonl", [CHAT])
    tokenize_file(p, qwen2(), DataConfig())
    (cache_dir / ".abc-1.tmp").write_bytes(b"half")                    # an interrupted write
    assert data_cache.clear() == 2 and not list(cache_dir.iterdir())
    assert not tokenize_file(p, qwen2(), DataConfig()).from_cache


def test_unwritable_cache_still_loads(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(data_cache.ENV_VAR, str(blocker))
    ds = load_dataset(write(tmp_path / "c.jsonl", [CHAT]), qwen2(), DataConfig())
    assert ds.stats.accepted == 1


def test_cache_dir_default_is_the_user_cache(monkeypatch):
    monkeypatch.delenv(data_cache.ENV_VAR, raising=False)
    import platformdirs
    assert data_cache.cache_dir() == Path(platformdirs.user_cache_dir("gguf-workbench")) / "datasets"


def test_progress_and_cancel(tmp_path, monkeypatch):
    from app.engine.errors import Cancelled
    from app.engine.runtime import inputs
    monkeypatch.setattr(inputs, "STOP_EVERY_S", 0.0)   # ask at every line
    p = write(tmp_path / "p.jsonl", _stories(2000))
    seen = []
    load_dataset(p, qwen2(), DataConfig(), use_cache=False,
                 progress=lambda r, d, t: seen.append((r, d, t)))
    assert seen and seen[-1] == (2000, os.path.getsize(p), os.path.getsize(p))
    with pytest.raises(Cancelled):
        load_dataset(p, qwen2(), DataConfig(), use_cache=False, should_stop=lambda: True)
