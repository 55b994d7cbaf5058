"""Prompt suites: rows read with their rewards, answers generated and scored by the reward
functions, pass rate and mean reward; Python rewards only when trusted."""

from __future__ import annotations

import json
import math

import pytest

from app.engine.errors import DatasetError
from app.engine.evaluation import suites
from app.engine.model.transformer import load_model
from app.engine.training.reward_functions import UntrustedRewardError
from tests.conftest import SAMPLE_DATA


@pytest.fixture(scope="module")
def sample():
    return load_model(SAMPLE_DATA / "tiny-moe.gguf")


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rows_rewards_and_pass_threshold(tmp_path):
    (tmp_path / "check.py").write_text("def reward(prompt, completion, **row):\n    return 1.0\n")
    f = _write(tmp_path / "s.jsonl", [
        {"prompt": "2 + 2 =", "answer": "4"},
        {"messages": [{"role": "user", "content": "Hi!"}], "reward": ["contains:a.b", "format"]},
        {"prompt": "x", "reward": "check.py:2", "pass_at": 1},
    ])
    a, b, c = suites.read_suite(f)
    assert [s.kind for s in a.specs] == ["exact"] and a.pass_at == 1.0
    assert b.specs[0].kind == "regex" and b.specs[0].arg == r"a\.b" and b.pass_at == 2.0
    assert c.specs[0].arg == str(tmp_path / "check.py") and c.pass_at == 1.0 and c.line == 3
    assert len(suites.read_suite(f, limit=2)) == 2


@pytest.mark.parametrize("row,match", [
    ('{"answer": "4"}', 'line 2: no "prompt" or "messages"'),
    ('{"prompt": "x", "reward": 3}', 'line 2: "reward" must be'),
    ('{"prompt": "x", "reward": "bogus"}', "line 2: "),
    ('{"prompt": "x", "pass_at": "all"}', 'line 2: "pass_at" must be a number'),
    ("[1, 2]", "line 2: "),
])
def test_bad_rows_name_the_line(tmp_path, row, match):
    f = tmp_path / "s.jsonl"
    f.write_text('{"prompt": "ok"}\n' + row + "\n")
    with pytest.raises(DatasetError, match=match):
        suites.read_suite(f)


def test_python_rewards_need_trust(tmp_path):
    (tmp_path / "check.py").write_text("def reward(prompt, completion, **row):\n    return 1.0\n")
    rows = suites.read_suite(_write(tmp_path / "s.jsonl", [{"prompt": "x", "reward": "check.py"}]))
    with pytest.raises(UntrustedRewardError):
        suites.check_trust(rows)
    suites.check_trust(rows, trust=True)            # the user's --trust-reward-code
    suites.check_trust(rows)                        # recorded


def test_suite_scores_greedy_answers(sample, tmp_path):
    """Greedy answers of the sample model, scored: a record per answer whose reward is the
    reward functions' (exact against what it said is 1, a regex it cannot match is 0)."""
    f = _write(tmp_path / "s.jsonl", [
        {"messages": [{"role": "user", "content": "What color is snow?"}],
         "answer": "Snow is white.", "reward": "exact"},
        {"messages": [{"role": "user", "content": "What is 3 + 4?"}], "answer": "7",
         "reward": ["numeric", "regex:^Sure! "]},
        {"messages": [{"role": "user", "content": "Count to 3."}], "reward": "regex:^zzz"},
    ])
    rows = suites.read_suite(f)
    r = suites.run_suite(sample, None, 1.0, "suite:s.jsonl", rows, max_new_tokens=12)
    said = [rec["completion"] for rec in r.records]
    assert said[0] == "Snow is white."              # the sample model knows its facts
    assert [rec["pass"] for rec in r.records] == [True, False, False]
    assert r.records[1]["rewards"][1] == 0.0          # it never says "Sure!"
    assert r.value == pytest.approx(1 / 3) and r.extra["passed"] == 1 and r.n == 3
    assert r.stderr == pytest.approx(math.sqrt((1 / 3) * (2 / 3) / 2))
    assert r.extra["mean_reward"] == pytest.approx(
        sum(rec["reward"] for rec in r.records) / 3)


def test_samples_with_a_seed_repeat(sample, tmp_path):
    rows = suites.read_suite(_write(tmp_path / "s.jsonl", [
        {"prompt": "Once upon a time", "reward": "regex:."}]))
    one = suites.run_suite(sample, None, 1.0, "s", rows, samples=3, seed=5, max_new_tokens=8)
    two = suites.run_suite(sample, None, 1.0, "s", rows, samples=3, seed=5, max_new_tokens=8)
    assert [r["completion"] for r in one.records] == [r["completion"] for r in two.records]
    assert [r["sample"] for r in one.records] == [0, 1, 2] and one.n == 3
    assert len({r["completion"] for r in one.records}) > 1      # sampled, not greedy
