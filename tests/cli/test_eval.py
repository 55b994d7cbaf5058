"""`workbench eval`: perplexity with llama-perplexity's chunking, against a reference computed
here from the model's logits."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from app.cli.main import run_cli
from app.engine.errors import ConfigError
from app.engine.export.evaluate import chunks
from app.engine.model.lora import load_adapter
from app.engine.model.transformer import load_model
from tests.conftest import GOLDEN

TEXT = " ".join(f"The {w} sat on the {v} mat number {i}." for i, (w, v) in
                enumerate(zip(["cat", "dog", "bird", "fox"] * 20, ["red", "blue", "old"] * 27)))


def _reference(model, tokens, n_ctx, adapter=None):
    """llama-perplexity: n_tokens // n_ctx chunks, BOS in front of each, second half scored."""
    total, count = 0.0, 0
    for c in range(len(tokens) // n_ctx):
        chunk = list(tokens[c * n_ctx:(c + 1) * n_ctx])
        if model.tokenizer.add_bos:
            chunk[0] = model.tokenizer.bos_id
        logits = model.logits(chunk, adapter=adapter).astype(np.float64)
        for pos in range(n_ctx // 2, n_ctx - 1):
            row = logits[pos]
            lse = row.max() + math.log(np.exp(row - row.max()).sum())
            total += lse - row[chunk[pos + 1]]
            count += 1
    return math.exp(total / count), count


@pytest.mark.parametrize("name,adapter", [("llama", False), ("gemma3", True)])
def test_eval_matches_llama_perplexity_chunking(tmp_path, capsys, name, adapter):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    model = load_model(GOLDEN / f"{name}-f32.gguf")
    lora = load_adapter(GOLDEN / f"{name}-lora.gguf") if adapter else None
    tokens = model.tokenizer.encode(TEXT, add_special=True)
    n_ctx = 32
    assert len(tokens) >= 3 * n_ctx
    want, count = _reference(model, tokens, n_ctx, lora)
    args = ["eval", "-m", str(GOLDEN / f"{name}-f32.gguf"), "-f", str(text), "--ctx", str(n_ctx)]
    args += ["-a", str(GOLDEN / f"{name}-lora.gguf")] if adapter else []
    assert run_cli(args + ["--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["ppl"] == pytest.approx(want, rel=1e-6)
    assert got["n_scored"] == count == (len(tokens) // n_ctx) * (n_ctx - 1 - n_ctx // 2)
    assert got["n_chunks"] == len(tokens) // n_ctx and len(got["chunk_ppl"]) == got["n_chunks"]
    assert run_cli(args) == 0
    assert capsys.readouterr().out.startswith(f"PPL = {want:.4f}")


def test_eval_chunks_and_short_texts(tmp_path, capsys):
    parts = chunks(list(range(10, 75)), 16, bos_id=1)
    assert len(parts) == 4 and all(p[0] == 1 and len(p) == 16 for p in parts)
    assert parts[1][1:] == list(range(27, 42))
    assert chunks(list(range(40)), 16, None)[1][0] == 16      # no BOS: the text's own token
    with pytest.raises(ConfigError, match="at least 64"):
        chunks(list(range(63)), 32, 1)
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    assert run_cli(["eval", "-m", str(GOLDEN / "llama-f32.gguf"), "-f", str(short)]) == 2
    assert "needs at least 1024" in capsys.readouterr().err


def test_eval_tasks_base_and_adapters_side_by_side(tmp_path, capsys):
    """--task (repeatable) with two adapters: one row per model, one column per task; --json
    has one record per task item and model, whose choices are the engine's."""
    from app.engine.evaluation import scoring, tasks
    from tests.conftest import DATA

    model_path, lora = GOLDEN / "gemma3-f32.gguf", str(GOLDEN / "gemma3-lora.gguf")
    ev = DATA / "eval"
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    args = ["eval", "-m", str(model_path), "-a", lora, "-a", lora,
            "-t", f"hellaswag:{ev}/hellaswag.txt", "-t", f"winogrande:{ev}/winogrande.csv",
            "-t", str(ev / "mc.jsonl"), "--limit", "7", "-f", str(text), "-c", "32"]
    assert run_cli(args + ["--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert list(got["models"]) == ["base", "gemma3-lora.gguf", "gemma3-lora.gguf'"]
    base = {r["task"]: r for r in got["models"]["base"]}
    assert list(base) == ["hellaswag:hellaswag.txt", "winogrande:winogrande.csv",
                          "jsonl:mc.jsonl", "ppl:text.txt"]
    assert base["ppl:text.txt"]["metric"] == "ppl" and base["ppl:text.txt"]["value"] > 1
    records = got["records"]
    assert len(records) == 3 * 3 * 7
    assert set(records[0]) >= {"model", "task", "index", "choice", "gold", "scores"}
    model = load_model(model_path)
    items = tasks.read_tasks("hellaswag", ev / "hellaswag.txt", limit=7)
    want = scoring.score_tasks(model, model.params(llamacpp_numerics=True), "hellaswag", items)
    mine = [r for r in records if r["model"] == "base" and r["task"] == "hellaswag:hellaswag.txt"]
    assert [r["choice"] for r in mine] == [s.choice for s in want]
    assert [r["gold"] for r in mine] == [t.gold for t in items]
    adapted = got["models"]["gemma3-lora.gguf"]
    assert adapted == got["models"]["gemma3-lora.gguf'"]           # the same adapter twice
    assert [r["value"] for r in adapted] != [r["value"] for r in got["models"]["base"]]
    acc = base["hellaswag:hellaswag.txt"]
    assert acc["n"] == 7 and acc["value"] == sum(r["choice"] == r["gold"] for r in mine) / 7

    assert run_cli(args[:5] + ["-t", f"mc:{ev}/mc.bin", "--limit", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["model", "mc:mc.bin"]
    assert lines[1].startswith("base ") and " +- " in lines[1]
    assert lines[2].startswith("gemma3-lora.gguf ")


def test_eval_task_errors(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_text("ctx\n1\na\nb\nc\nd\nctx\n7\na\nb\nc\nd\n")
    model = str(GOLDEN / "llama-f32.gguf")
    assert run_cli(["eval", "-m", model, "-t", f"hellaswag:{bad}"]) == 2
    assert "line 8: the gold ending's index must be 0, 1, 2 or 3" in capsys.readouterr().err
    assert run_cli(["eval", "-m", model, "-t", "nope:x"]) == 2
    assert "Not a task" in capsys.readouterr().err
    assert run_cli(["eval", "-m", model]) == 2
    assert "Nothing to evaluate" in capsys.readouterr().err
    assert run_cli(["eval", "-m", model, "-t", f"mc:{tmp_path}/missing.bin"]) == 2
    assert "No task file" in capsys.readouterr().err


def test_eval_save_appends_to_the_runs_evals_whole_or_not_at_all(tmp_path, capsys, monkeypatch):
    from app.engine.errors import Cancelled
    from app.engine.evaluation import runner
    from app.engine.evaluation.store import read_evals
    from app.engine.runs.runlock import RunLock
    from tests.conftest import DATA

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    lora = str(GOLDEN / "gemma3-lora.gguf")
    args = ["eval", "-m", str(GOLDEN / "gemma3-f32.gguf"), "-a", lora, "--save", str(run),
            "-t", f"mc:{DATA}/eval/mc.bin", "-t", str(DATA / "eval" / "mc.jsonl"), "--limit", "4"]
    assert run_cli(args) == 0
    capsys.readouterr()
    rows = read_evals(run)
    assert [(r["model"], r["task"]) for r in rows] == [
        ("base", "mc:mc.bin"), ("base", "jsonl:mc.jsonl"),
        ("gemma3-lora.gguf", "mc:mc.bin"), ("gemma3-lora.gguf", "jsonl:mc.jsonl")]
    assert rows[0]["adapter"] is None and rows[2]["adapter"] == lora
    assert rows[0]["spec"] == f"mc:{DATA}/eval/mc.bin" and rows[0]["n"] == 4
    assert len({r["eval_id"] for r in rows}) == 1
    before = (run / "evals.jsonl").read_bytes()

    def cancelled(*a, **k):        # a cancel after the first task: nothing of it is saved
        raise Cancelled("The evaluation was cancelled.")
    monkeypatch.setattr(runner, "run_choice_task", cancelled)
    assert run_cli(args) == 2
    assert (run / "evals.jsonl").read_bytes() == before
    monkeypatch.undo()
    lock = RunLock(run, "a test").acquire()        # the run is being written: refused
    try:
        assert run_cli(args) == 2
        assert "run" in capsys.readouterr().err.lower()
    finally:
        lock.release()
    assert run_cli(args) == 0
    assert len(read_evals(run)) == 8 and len({r["eval_id"] for r in read_evals(run)}) == 2
