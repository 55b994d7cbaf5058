"""The dataset linter: report contents, agreement with loading, streaming, and `workbench lint`."""

from __future__ import annotations

import json
import tracemalloc
from functools import lru_cache
from pathlib import Path

import pytest

from app.cli.main import run_cli
from app.engine.data import dataset as data
from app.engine.data import cache as data_cache
from app.engine.data.dataset import DataConfig, load_dataset
from app.engine.data.lint import MARK_CLOSE, MARK_OPEN, dataset_report, lint_dataset, lint_file
from app.engine.text.tokenizer import load_tokenizer
from tests.conftest import GOLDEN, SAMPLE_DATA, VOCAB

VOCAB = VOCAB
QWEN2 = VOCAB / "ggml-vocab-qwen2.gguf"
SAMPLES = SAMPLE_DATA


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(data_cache.ENV_VAR, str(tmp_path / "cache"))


@lru_cache(maxsize=None)
def qwen2():
    return load_tokenizer(QWEN2)


def chat(q: str, a: str) -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def write(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def mixed(tmp_path) -> Path:
    return write(tmp_path / "mixed.jsonl", [
        chat("What is 71 + 92?", "163"),
        "{not json",
        chat("Tell me a long story.", "Once upon a time " * 40),
        {"messages": [{"role": "narrator", "content": "x"}]},
        {"text": "wrong format"},
        chat("Hi", "Hello!"),
    ])


def test_report_lists_everything(mixed):
    r = lint_dataset(mixed, qwen2(), DataConfig(context=64))
    assert (r.format, r.format_detected, r.rows, r.accepted) == ("chat", True, 6, 3)
    assert [(x.line, x.kind) for x in r.rejected] == [
        (2, "invalid_json"), (4, "unknown_role"), (5, "missing_key")]
    assert "looks like the text format" in r.rejected[2].reason
    h = r.histogram
    assert sum(b["rows"] for b in h["bins"]) == 3 and h["over_context"] == 1 == r.truncated
    assert h["fits_up_to"] == 65 and h["bins"][-1]["to"] == h["max"] > 65
    assert r.dropped == 0 and r.split == 0
    assert 0 < r.trained_token_fraction < 1 and r.positions <= 3 * 64
    ex = r.example
    assert ex["line"] == 1 and ex["marked"].count(MARK_OPEN) == 1
    assert f"{MARK_OPEN}163<|im_end|>{MARK_CLOSE}" in ex["marked"]
    assert [ex["text"][a:b] for a, b in ex["trained_spans"]] == ["163<|im_end|>"]
    assert r.weights["source"] == "none"


def test_lint_agrees_with_loading(mixed):
    cfg = DataConfig(context=64)
    lint = lint_dataset(mixed, qwen2(), cfg).to_dict()
    ds = load_dataset(mixed, qwen2(), cfg)
    assert dataset_report(ds).to_dict() == lint
    assert lint["trained_tokens"] == ds.stats.train_targets
    assert lint["positions"] == ds.stats.train_positions
    assert lint["accepted"] == ds.stats.accepted and lint["truncated"] == ds.stats.truncated


def test_overflow_rules_in_the_report(mixed):
    split = lint_dataset(mixed, qwen2(), DataConfig(context=64, overflow="split"))
    assert split.split == 1 and split.truncated == 0
    dropped = lint_dataset(mixed, qwen2(), DataConfig(context=64, overflow="drop"))
    assert dropped.dropped == 1 and dropped.positions < split.positions


def test_weights_in_the_report(tmp_path):
    rows = [{"prompt": "Q", "completion": f" A{i}", "reward": r} for i, r in enumerate([0, 2, 4, -1])]
    p = write(tmp_path / "r.jsonl", rows)
    r = lint_dataset(p, qwen2(), DataConfig())
    assert [(x.line, x.kind) for x in r.rejected] == [(4, "negative_weight")]
    assert r.weights["raw"] == {"min": 0.0, "max": 4.0, "mean": 2.0, "std": pytest.approx(1.633, 1e-3)}
    mm = lint_dataset(p, qwen2(), DataConfig(normalize="min-max"))
    assert mm.weights["final"]["min"] == 0 and mm.weights["final"]["max"] == 1
    assert mm.weights["zero"] == 1 and any("weight 0" in n for n in mm.notes)
    assert mm.positions == 3 * 3        # Q, " A", "0" -> EOS: 3 positions for each row of weight > 0
    neg = lint_dataset(p, qwen2(), DataConfig(allow_negative_weights=True))
    assert not neg.rejected and neg.weights["negative"] == 1 and neg.positions == 3 * 3


def test_lint_streams(tmp_path, monkeypatch):
    """The linter keeps a few numbers per row (and one block of rows), not the text or tokens:
    four times the rows cost well under the size of the extra rows in memory."""
    monkeypatch.setattr(data, "BLOCK_ROWS", 64)
    line = json.dumps({"text": "The cat sat on the mat. " * 20}) + "\n"   # ~500 bytes, 120 tokens

    def peak(rows: int) -> int:
        p = tmp_path / f"{rows}.jsonl"
        p.write_text(line * rows)
        tracemalloc.start()
        try:
            assert lint_dataset(p, qwen2(), DataConfig(format="text")).accepted == rows
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    small, large = peak(400), peak(1600)
    assert (large - small) / 1200 < 150, (small, large)   # bytes per extra row


def test_lint_file_uses_the_models_context(tmp_path):
    p = write(tmp_path / "t.jsonl", [{"text": "x" * 400}])
    r = lint_file(p, GOLDEN / "llama-f32.gguf")        # byte vocabulary, context 256 in the file
    assert r.context == 256 and r.truncated == 1 and "model's 256" in r.notes[0]
    assert lint_file(p, GOLDEN / "llama-f32.gguf", context=1000).truncated == 0


# ---- the command --------------------------------------------------------------------------------

def test_cli_json(mixed, capsys):
    assert run_cli(["lint", str(mixed), "--model", str(QWEN2), "--ctx", "64", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("format", "accepted", "rejected", "histogram", "truncated", "dropped",
                "trained_token_fraction", "weights", "example"):
        assert key in report
    assert report["rejected"][0] == {"line": 2, "kind": "invalid_json",
                                     "reason": report["rejected"][0]["reason"]}
    assert report["accepted"] == 3 and report["context"] == 64


@pytest.mark.slow
def test_cli_text(mixed, capsys):
    assert run_cli(["lint", str(mixed), "-m", str(QWEN2), "--ctx", "64"]) == 0
    out = capsys.readouterr().out
    assert "mixed.jsonl: chat format (detected), context 64" in out
    assert "rows: 3 accepted, 3 rejected (of 6)" in out
    assert "line 4: unknown role \"narrator\"" in out
    assert "longer than the context: 1 rows (1 truncated" in out
    assert MARK_OPEN + "163<|im_end|>" + MARK_CLOSE in out


@pytest.mark.slow
def test_cli_options(tmp_path, capsys):
    p = write(tmp_path / "r.jsonl", [{"prompt": "Q", "completion": " A", "reward": r, "id": i}
                                     for i, r in enumerate([1, 3])])
    w = tmp_path / "w.txt"
    w.write_text("5\n7\n")
    assert run_cli(["lint", str(p), "-m", str(QWEN2), "--json", "--format", "completion",
                    "--weights", str(w), "--normalize", "clip", "--clip", "0", "6"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format_detected"] is False
    assert report["weights"]["source"] == "file" and report["weights"]["final"]["max"] == 6


@pytest.mark.slow
def test_cli_errors_exit_2(tmp_path, capsys):
    good = write(tmp_path / "g.jsonl", [chat("a", "b")])
    assert run_cli(["lint", str(tmp_path / "missing.jsonl"), "-m", str(QWEN2)]) == 2
    assert "Cannot read the dataset" in capsys.readouterr().err
    bad_model = tmp_path / "bad.gguf"
    bad_model.write_bytes(b"not a gguf")
    assert run_cli(["lint", str(good), "-m", str(bad_model)]) == 2
    unknown = write(tmp_path / "u.jsonl", [{"question": "q"}])
    assert run_cli(["lint", str(unknown), "-m", str(QWEN2)]) == 2
    err = capsys.readouterr().err
    assert "Cannot tell the format" in err and "hint:" in err
    assert run_cli(["lint", str(good), "-m", str(QWEN2), "--normalize", "mean-std"]) == 2


@pytest.mark.parametrize("name, fmt", [("stories.jsonl", "text"),
                                       ("rated_completions.jsonl", "completion")])
def test_sample_datasets_are_clean(name, fmt):
    r = lint_dataset(SAMPLES / name, qwen2(), DataConfig(context=256, normalize="min-max"))
    assert (r.format, r.accepted, len(r.rejected), r.truncated) == (fmt, 300, 0, 0)
    if fmt == "completion":
        assert r.weights["raw"]["min"] == 0 and r.weights["raw"]["max"] == 10


def test_many_bad_rows_are_counted_but_only_the_first_are_kept(tmp_path, monkeypatch):
    from app.engine.data import formats
    monkeypatch.setattr(formats, "MAX_KEPT_REJECTIONS", 5)
    p = write(tmp_path / "bad.jsonl", ["{oops"] * 20 + [{"text": 3}] * 10 + [chat("a", "b")])
    r = lint_dataset(p, qwen2(), DataConfig(format="chat"))
    assert r.rejected_count == 30 and len(r.rejected) == 5 and r.accepted == 1
    assert r.to_dict()["rejected_by_kind"] == {"invalid_json": 20, "missing_key": 10}
    assert "... and 25 more (invalid_json: 20, missing_key: 10" in r.to_text()
    ds = load_dataset(p, qwen2(), DataConfig(format="chat"))
    assert ds.stats.rejected == 30 and len(ds.skipped) == 5 and ds.stats.accepted == 1


def test_special_token_text_in_plain_rows_is_noted(tmp_path):
    p = write(tmp_path / "t.jsonl", [{"text": "<|im_start|>user\nHi<|im_end|>"}, {"text": "plain"}])
    r = lint_dataset(p, qwen2(), DataConfig())
    assert any("1 row(s) contain special-token text" in n for n in r.notes)
    assert not any("special-token" in n for n in lint_dataset(p, qwen2(), DataConfig(parse_special=True)).notes)


def test_rows_the_overflow_rule_drops_are_not_accepted_and_nothing_to_train_exits_1(tmp_path,
                                                                                    capsys):
    """Probe finding 9: one row longer than the context with --overflow drop: lint said "1
    accepted ... 1 dropped, trained tokens 0" and exited 0; training refuses it ("Nothing to
    train on"). Another row that fits makes it train again (exit 0)."""
    long = write(tmp_path / "long.jsonl", [{"text": "x" * 5000}])
    argv = ["lint", str(long), "-m", str(QWEN2), "--overflow", "drop", "--ctx", "16"]
    assert run_cli(argv) == 1
    out = capsys.readouterr().out
    assert "rows: 0 accepted, 1 dropped as longer than the context, 0 rejected (of 1)" in out
    assert "nothing would train" in out
    with pytest.raises(data.DatasetError, match="Nothing to train on"):
        load_dataset(long, qwen2(), DataConfig(overflow="drop", context=16))
    write(long, [{"text": "x" * 5000}, {"text": "short"}])
    assert run_cli(argv) == 0
    out = capsys.readouterr().out
    assert "rows: 1 accepted, 1 dropped" in out and "nothing would train" not in out
