"""Reading multiple-choice task files as llama-perplexity reads them, and the errors (with the
line) for files that do not read."""

from __future__ import annotations

import json

import struct

import pytest

from app.engine.errors import DatasetError
from app.engine.evaluation.tasks import read_tasks, write_mc
from tests.conftest import DATA

EVAL = DATA / "eval"


def test_hellaswag_texts_are_context_space_ending(tmp_path):
    f = tmp_path / "hs.txt"
    f.write_text("Ctx: a man\n2\nruns.\nsits\nflies away\nsleeps\r\n"
                 "Second\n0\na\nb\nc\nd")          # no final newline; a CRLF line
    tasks = read_tasks("hellaswag", f)
    assert [t.gold for t in tasks] == [2, 0]
    assert tasks[0].texts == ["Ctx: a man runs.", "Ctx: a man sits", "Ctx: a man flies away",
                              "Ctx: a man sleeps"]
    assert tasks[1].where == "line 7" and tasks[1].correct == {0}
    assert len(read_tasks("hellaswag", EVAL / "hellaswag.txt")) == 60
    assert len(read_tasks("hellaswag", EVAL / "hellaswag.txt", limit=5)) == 5


WG = "index,sentence,option1,option2,answer\n"
JS = '{"question": "q", "choices": ["a", "b"], "answer": 1}\n'


@pytest.mark.parametrize("fmt,text,match", [
    ("hellaswag", "c\n1\na\nb\nc\nd\nc2\n1\n",
     r"8 lines, not a multiple of 6: .* \(from line 7\)"),
    ("hellaswag", "c\n1\na\nb\nc\nd\nc2\n4\na\nb\nc\nd\n",
     r"line 8: the gold ending's index must be"),
    ("hellaswag", "c\nx\na\nb\nc\nd\n", r"line 2: "),
    ("hellaswag", "", r"no tasks"),
    ("winogrande", WG + "0,no blank here,A,B,1\n", "line 2: the sentence has no _"),
    ("winogrande", WG + "0,a _ b,A,B,3\n", "line 2: the answer must be 1 or 2"),
    ("winogrande", WG + "0,a _ b,A,1\n", "line 2: 4 fields, not 5"),
    ("jsonl", JS + "{not json\n", "line 2: not JSON"),
    ("jsonl", JS + '{"question": "q", "choices": ["a"], "answer": 0}\n',
     'line 2: "choices" must be a list'),
    ("jsonl", JS + '{"question": "q", "choices": ["a", "b"], "answer": 2}\n',
     'line 2: "answer" must be'),
    ("jsonl", JS + '{"question": "q", "choices": ["a", "b"], "answer": true}\n',
     'line 2: "answer" must be'),
    ("jsonl", JS + '{"question": 3, "choices": ["a", "b"], "answer": 0}\n', 'line 2: "question"'),
    ("jsonl", '{"messages": [{"role": "user"}], "choices": ["a", "b"], "answer": 0}\n',
     'line 1: "messages" must be'),
])
def test_errors_name_the_line(tmp_path, fmt, text, match):
    f = tmp_path / "tasks"
    f.write_text(text)
    with pytest.raises(DatasetError, match=match):
        read_tasks(fmt, f)


def test_winogrande_fills_the_blank_and_strips_quotes(tmp_path):
    f = tmp_path / "wg.csv"
    f.write_text("index,sentence,option1,option2,answer\n"
                 '0,"At last, _ swam.",Tom,Lily,2\n'
                 "1,Sarah was better than Maria so _ got the easy cases.,Sarah,Maria,2\n")
    a, b = read_tasks("winogrande", f)
    assert a.texts == ["At last, Tom swam.", "At last, Lily swam."] and a.gold == 1
    assert a.base == ["At last, Tom", "At last, Lily"]
    assert b.texts[1] == "Sarah was better than Maria so Maria got the easy cases."
    assert b.where == "line 3"


def test_mc_round_trip_and_llamacpp_layout(tmp_path):
    f = tmp_path / "mc.bin"
    write_mc(f, [("Q1?", ["yes", "no"], [0, 1]), ("Q2?", ["a", "b", "c"], [1, 0, 1])])
    raw = f.read_bytes()
    n, off1, off2 = struct.unpack("<3I", raw[:12])
    assert n == 2 and off1 == 12                       # offsets of each task from the start
    assert struct.unpack("<I", raw[off2:off2 + 4])[0] == 3 and raw[off2 + 4:off2 + 7] == b"Q2?"
    t1, t2 = read_tasks("mc", f)
    assert t1.texts == ["Q1? yes", "Q1? no"] and t1.correct == {1} and t1.gold == 1
    assert t2.correct == {0, 2} and t2.gold == 0 and t2.where == "task 2 of 2"


def test_mc_errors_say_where(tmp_path):
    f = tmp_path / "mc.bin"
    write_mc(f, [("Q1?", ["yes", "no"], [0, 1]), ("Q2?", ["a", "b"], [1, 0])])
    f.write_bytes(f.read_bytes()[:-6])
    with pytest.raises(DatasetError, match="ends inside task 2 of 2"):
        read_tasks("mc", f)
    f.write_bytes(struct.pack("<I", 0))
    with pytest.raises(DatasetError, match="no tasks"):
        read_tasks("mc", f)
    write_mc(f, [("Q?", ["", "no"], [0, 1])])
    with pytest.raises(DatasetError, match="task 1 of 1 .* empty question or answer"):
        read_tasks("mc", f)


def test_jsonl_tasks(tmp_path):
    f = tmp_path / "mc.jsonl"
    f.write_text('{"question": "2 + 2 =", "choices": ["4", "5"], "answer": 0}\n\n'
                 '{"context": "Cows.", "question": "A cow says", "choices": ["moo", "baa"], '
                 '"answer": 0}\n')
    a, b = read_tasks("jsonl", f)
    assert a.texts == ["2 + 2 = 4", "2 + 2 = 5"] and b.texts[1] == "Cows.\nA cow says baa"
    assert b.where == "line 3"
    assert [t.texts for t in read_tasks("jsonl", EVAL / "mc.jsonl")] == \
        [t.texts for t in read_tasks("mc", EVAL / "mc.bin")]


def test_the_bundled_suite_scores_what_the_preference_pairs_teach():
    """The suite's last 16 rows ask what preferences.jsonl teaches, on prompts it does not
    hold: the right answer AND the chosen answers' ending. An answer that is only the ending
    (what a DPO adapter without --sft-weight writes: the answer's tokens are the same in the
    chosen and the rejected answer, so DPO's margin never sees them) or only the answer (the
    base) does not pass."""
    from app.engine.evaluation.suites import read_suite
    from app.engine.training.reward_functions import RewardScorer, ScoreItem
    from tests.conftest import SAMPLE_DATA

    taught = {json.loads(line)["prompt"][0]["content"]
              for line in (SAMPLE_DATA / "preferences.jsonl").read_text().splitlines()}
    rows = read_suite(SAMPLE_DATA / "eval_suite.jsonl")[40:]
    assert len(rows) == 16
    for r in rows:
        assert r.row["messages"][0]["content"] not in taught
        scorer = RewardScorer(r.specs, source="suite")
        answer = r.row["answer"]
        texts = [f"{answer} Have a nice day!", "Have a nice day!", answer, f"Sure! {answer}"]
        items = [ScoreItem("", t, r.row, r.index, r.line, 8, 64) for t in texts]
        totals = [float(v @ scorer.weights) for v in scorer.score(items)]
        scorer.close()
        assert [t >= r.pass_at for t in totals] == [True, False, False, False], (r.line, totals)


def test_jsonl_chat_rows_and_the_bundled_sample_sets():
    from app.engine.evaluation.suites import read_suite
    from app.engine.evaluation.scoring import tokenize_task
    from app.engine.model.transformer import load_model
    from app.engine.text.chat_template import generation_prompt_ids
    from tests.conftest import SAMPLE_DATA

    items = read_tasks("jsonl", SAMPLE_DATA / "eval_tasks.jsonl")
    assert len(items) == 56 and all(t.messages and len(t.texts) == 3 for t in items)
    assert len(read_suite(SAMPLE_DATA / "eval_suite.jsonl")) == 56
    tok = load_model(SAMPLE_DATA / "tiny-moe.gguf").tokenizer
    t = tokenize_task(tok, items[0])
    prompt = generation_prompt_ids(tok, items[0].messages)
    assert t.seqs[0] == prompt + tok.encode(items[0].texts[0], add_special=False)
    assert t.prefix >= len(prompt)
