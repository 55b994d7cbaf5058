"""evals.jsonl read back (issue 32): `latest_evals` gives the newest evaluation's lines only,
`saved_cell` prints a saved line as `workbench eval` printed its result (TaskResult.cell)."""

from __future__ import annotations

import math

from app.engine.evaluation.results import TaskResult, saved_cell
from app.engine.evaluation.store import latest_evals, read_evals, save_evals

RESULTS = [TaskResult("mc:a.bin", "mc", "acc", 0.625, 0.044, 120, {"acc_raw": 0.6}),
           TaskResult("mc:b.bin", "mc", "acc", 0.5, math.nan, 1),
           TaskResult("suite:s.jsonl", "suite", "pass_rate", 0.8, None, 10,
                      {"passed": 8, "mean_reward": 1.2}),
           TaskResult("ppl:v.txt", "ppl", "ppl", 12.3456, None, 100)]


def test_latest_evals_are_the_last_evaluations_lines(tmp_path):
    assert latest_evals(tmp_path) == []
    first, _ = save_evals(tmp_path, {"base": RESULTS[:1]}, {"base": None}, {})
    second, _ = save_evals(tmp_path, {"base": RESULTS[:2], "sft": RESULTS[2:3]},
                           {"base": None, "sft": "/a.gguf"}, {})
    latest = latest_evals(tmp_path)
    assert [r["eval_id"] for r in latest] == [second] * 3 and first != second
    assert latest == read_evals(tmp_path)[1:]
    assert [(r["model"], r["task"]) for r in latest] == [("base", "mc:a.bin"),
                                                         ("base", "mc:b.bin"),
                                                         ("sft", "suite:s.jsonl")]


def test_a_saved_line_prints_as_its_result(tmp_path):
    save_evals(tmp_path, {"base": RESULTS}, {"base": None}, {})
    rows = read_evals(tmp_path)       # through JSON: NaN, None and the extra fields
    assert [saved_cell(r) for r in rows] == [r.cell() for r in RESULTS]
    assert [saved_cell(r) for r in rows] == ["62.50 +- 4.40", "50.00", "80.0% (8/10)",
                                             "PPL 12.3456"]
    assert saved_cell({"task": "x", "value": "high"}) == "?"       # written by hand
    assert saved_cell({"task": "x"}) == "?"
