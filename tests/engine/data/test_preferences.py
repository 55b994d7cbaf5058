"""Preference data: every row form, the loss masks (only completion tokens count, as SFT's),
rejections by line, detection, the linter's report and KTO's mismatched KL sequences."""

from __future__ import annotations

import json

import numpy as np
import pytest

from app.engine import load_model
from app.engine.data.preferences import (IDENTICAL, TOO_LONG, detect_preference_format,
                                         lint_preference_file, load_preferences, unpaired)
from app.engine.data.dataset import DataConfig
from app.engine.training.preference import mismatched

SAMPLE = "sample_data/tiny-moe.gguf"


@pytest.fixture(scope="module")
def tok():
    return load_model(SAMPLE).tokenizer


def _write(tmp_path, rows, name="p.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def _completion(tok, seq) -> str:
    """The text of a sequence's target tokens."""
    return tok.decode([int(i) for i, t in zip(seq.ids, seq.trained) if t])


MSG = lambda role, text: {"role": role, "content": text}
CHAT_ROWS = {
    "trl_messages": {"prompt": [MSG("user", "What is 2 + 3?")],
                     "chosen": [MSG("assistant", "5. Have a nice day!")],
                     "rejected": [MSG("assistant", "5.")]},
    "implicit_messages": {"chosen": [MSG("user", "What is 2 + 3?"), MSG("assistant", "5. Have a nice day!")],
                          "rejected": [MSG("user", "What is 2 + 3?"), MSG("assistant", "5.")]},
    "llamafactory_alpaca": {"instruction": "What is 2 + 3?", "input": "",
                            "chosen": "5. Have a nice day!", "rejected": "5."},
    "llamafactory_sharegpt": {"conversations": [{"from": "human", "value": "What is 2 + 3?"}],
                              "chosen": {"from": "gpt", "value": "5. Have a nice day!"},
                              "rejected": {"from": "gpt", "value": "5."}},
    "string_prompt_message_answers": {"prompt": "What is 2 + 3?",
                                      "chosen": [MSG("assistant", "5. Have a nice day!")],
                                      "rejected": [MSG("assistant", "5.")]},
}


@pytest.mark.parametrize("form", list(CHAT_ROWS))
def test_chat_forms_give_the_same_pair_with_completion_masks(tmp_path, tok, form):
    data = load_preferences(_write(tmp_path, [CHAT_ROWS[form]]), tok, context=256)
    assert data.format == "preference" and len(data.items) == 1 and not data.rejections.total
    it = data.items[0]
    # the chat template renders the user turn; only the assistant's text and its <|im_end|> count
    assert _completion(tok, it.chosen) == "5. Have a nice day!<|im_end|>"
    assert _completion(tok, it.rejected) == "5.<|im_end|>"
    assert "What is 2 + 3?" in tok.decode([int(i) for i in it.chosen.ids])
    assert np.array_equal(it.chosen.ids[:10], it.rejected.ids[:10])    # the same prompt


def test_string_rows_explicit_and_implicit_prompt(tmp_path, tok):
    path = _write(tmp_path, [{"prompt": "Q: hi A:", "chosen": " yes", "rejected": " no"},
                             {"chosen": "Q: hi A: yes", "rejected": "Q: hi A: no"}])
    data = load_preferences(path, tok, context=256)
    for it in data.items:           # joined as they are (SFT's completion rows), EOS trained
        assert _completion(tok, it.chosen) == " yes<|endoftext|>"
        assert _completion(tok, it.rejected) == " no<|endoftext|>"
    as_chat = load_preferences(path, tok, context=256, completion_as_chat=True)
    assert _completion(tok, as_chat.items[0].chosen) == " yes<|im_end|>"


def test_kto_rows_and_unpairing(tmp_path, tok):
    path = _write(tmp_path, [{"prompt": "Q: hi A:", "completion": " yes", "label": True},
                             {"prompt": [MSG("user", "hi")], "completion": [MSG("assistant", "no")],
                              "label": False},
                             {"prompt": "x", "completion": "y", "label": "yes"}])
    assert detect_preference_format(path) == "kto"
    data = load_preferences(path, tok, context=256)
    assert [it.label for it in data.items] == [True, False] and not data.paired
    assert [r.line for r in data.rejections.kept] == [3]
    pairs = load_preferences(_write(tmp_path, [CHAT_ROWS["trl_messages"]], "q.jsonl"), tok,
                             context=256)
    rows = unpaired(pairs.items)
    assert [r.label for r in rows] == [True, False] and rows[1].chosen is pairs.items[0].rejected


def test_bad_rows_are_rejected_by_line(tmp_path, tok):
    path = _write(tmp_path, [
        CHAT_ROWS["trl_messages"],                                                     # 1 ok
        {"prompt": "x", "chosen": "same", "rejected": "same"},                        # 2
        {"prompt": "x", "chosen": "", "rejected": "a"},                               # 3
        "not json",                                                                    # 4
        {"prompt": "x", "chosen": 3, "rejected": "a"},                                # 5
        {"prompt": "x", "chosen": "a"},                                               # 6
        {"prompt": [MSG("user", "x")], "chosen": [MSG("user", "a")], "rejected": "b"},  # 7
        {"prompt": "x " * 300, "chosen": "a", "rejected": "b"},                       # 8
    ])
    data = load_preferences(path, tok, context=64)
    assert len(data.items) == 1
    reasons = {r.line: (r.kind, r.reason) for r in data.rejections.kept}
    assert sorted(reasons) == [2, 3, 4, 5, 6, 7, 8]
    assert reasons[2][0] == IDENTICAL and "empty" in reasons[3][1]
    assert reasons[4][0] == "invalid_json" and "number" in reasons[5][1]
    assert 'missing key "rejected"' in reasons[6][1] and "assistant" in reasons[7][1]
    assert reasons[8][0] == TOO_LONG and "65" in reasons[8][1]


def test_lint_counts_pairs_flags_and_shows_both_completions(tmp_path):
    path = _write(tmp_path, [CHAT_ROWS["trl_messages"], CHAT_ROWS["llamafactory_alpaca"],
                             {"prompt": "x", "chosen": "same", "rejected": "same"},
                             {"prompt": "x", "chosen": " ", "rejected": "b"}, "{bad"])
    report = lint_preference_file(path, SAMPLE, DataConfig(), None)
    assert report["pairs"] == 2 and report["identical"] == 1 and report["empty"] == 1
    assert [r["line"] for r in report["rejected"]] == [3, 4, 5]
    assert report["lengths"]["fits_up_to"] == 257 and report["trains"]
    ex = report["example"]
    assert "\u27e65. Have a nice day!<|im_end|>\u27e7" in ex["chosen"]["marked"]
    assert "\u27e65.<|im_end|>\u27e7" in ex["rejected"]["marked"]
    assert "identical pairs 1" in report["text"] and "rejected" in report["text"]
    assert report["format_detected"] and "(detected)" in report["text"]
    chosen = lint_preference_file(path, SAMPLE, DataConfig(), None, "preference")
    assert not chosen["format_detected"] and "(as chosen)" in chosen["text"]
    sft = _write(tmp_path, [{"text": "hello"}], "sft.jsonl")
    assert lint_preference_file(sft, SAMPLE, DataConfig(), None) is None   # the SFT linter's


def test_kto_kl_sequences_pair_each_prompt_with_the_previous_completion(tmp_path, tok):
    data = load_preferences(_write(tmp_path, [
        {"prompt": [MSG("user", f"q{i}")], "completion": [MSG("assistant", f"a{i}")],
         "label": True} for i in range(3)]), tok, context=256)
    kl = mismatched(data.items, 257)
    for i, s in enumerate(kl):
        text = tok.decode([int(x) for x in s.ids])
        assert f"q{i}" in text and f"a{(i - 1) % 3}" in text and f"a{i}" not in text
        assert _completion(tok, s) == f"a{(i - 1) % 3}<|im_end|>"
