"""Loss masks from rendered spans, token by token, on the real templates and vocabularies."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest

from app.engine.text.chat_template import render_chat_spans
from app.engine.data.formats import Example, Rejection
from app.engine.data.loss_masks import Encoder, encode_with_offsets, trained_tokens
from app.engine.text.tokenizer import load_tokenizer
from tests.conftest import DATA

DATA = DATA
TEMPLATES = DATA / "templates"
TEMPLATE_NAMES = sorted(p.stem for p in TEMPLATES.glob("*.jinja"))
CONVERSATION = (
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is 6."},
)
# Templates that leave a final assistant message open (test_chat_template.MARKERS).
OPEN_LAST = {"Apertus-8B-Instruct", "tencent-Hy3"}


@lru_cache(maxsize=None)
def vocab(name: str):
    return load_tokenizer(DATA / "vocab" / f"ggml-vocab-{name}.gguf")


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def chat_example(messages=CONVERSATION, trained=None) -> Example:
    trained = tuple(i for i, m in enumerate(messages) if m["role"] == "assistant") \
        if trained is None else trained
    return Example(line=1, row=0, messages=tuple(dict(m) for m in messages), trained=trained)


def text_example(*segments) -> Example:
    return Example(line=1, row=0, segments=tuple(segments))


def encode_one(tok, example, **kw):
    (out,) = Encoder(tok, **kw).encode([example])
    return out


def trained_runs(tok, ids, mask) -> list[str]:
    """Decoded text of each run of consecutive trained tokens."""
    runs, cur = [], []
    for i, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


# ---- offsets ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen2", "llama-spm", "phi-3", "gpt-2"])
@pytest.mark.parametrize("parse", [False, True])
def test_encode_with_offsets_gives_the_tokenizers_ids(name, parse):
    tok = vocab(name)
    texts = ["Hello  world\n\u00e9\u4f60\u597d <|im_end|>x <s>y</s>", " leading space", "", "a\r\n\tb",
             "<|endoftext|><|endoftext|>", "\U0001F600 emoji"]
    for text, (ids, offsets) in zip(texts, encode_with_offsets(tok, texts, parse)):
        assert ids.tolist() == tok.encode(text, add_special=False, parse_special=parse)
        assert offsets.shape == (len(ids), 2) and np.all(offsets[:, 0] <= offsets[:, 1])
        assert np.all(np.diff(offsets[:, 0]) >= 0)


def test_trained_tokens_is_overlap():
    offsets = np.array([[0, 3], [3, 5], [5, 5], [5, 9], [9, 10]])
    assert trained_tokens(offsets, [(4, 6)]).tolist() == [False, True, True, True, False]
    assert trained_tokens(offsets, [(0, 3), (9, 10)]).tolist() == [True, False, False, False, True]
    assert trained_tokens(offsets, [(5, 5)]).tolist() == [False] * 5   # empty span trains nothing


# ---- chat masks, token by token -----------------------------------------------------------------

def _token_ranges(tok, ids) -> list[tuple[int, int]]:
    """Character range of each token from decoded prefixes: independent of the HF offsets."""
    ends = [len(tok.decode(ids[:j + 1])) for j in range(len(ids))]
    return list(zip([0] + ends[:-1], ends))


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_chat_mask_token_by_token_on_every_template(name):
    """Qwen2's vocabulary (ChatML control tokens) with every real template: a token is trained
    exactly when its characters overlap an assistant message's content or end marker."""
    tok = vocab("qwen2")
    eot = {tok.token_to_piece(i) for i in tok.eot_ids}
    chat = render_chat_spans(template(name), list(CONVERSATION), bos_token="<|endoftext|>",
                             eos_token="<|endoftext|>", stop_texts=eot)
    out = encode_one(tok, chat_example(), chat_template=template(name))
    assert not isinstance(out, Rejection), out
    ids = tok.encode(chat.text, add_special=False, parse_special=True)
    assert tok.decode(ids) == chat.text                         # so decoded prefixes are offsets
    spans = [(s.content[0], s.end_marker[1]) for s in chat.assistant_spans]
    expected = [any(a < e and b > s for s, e in spans) for a, b in _token_ranges(tok, ids)]
    open_end = name in OPEN_LAST
    assert out.ids.tolist() == ids + ([tok.eos_id] if open_end else [])
    assert out.trained.tolist() == expected + ([True] if open_end else [])
    # and in plain words: the trained text is each answer and its end of turn, nothing else
    runs = [r.strip() for r in trained_runs(tok, out.ids, out.trained)]
    assert runs[0].startswith("4") and runs[-1].startswith("It is 6.")
    assert all("2+2" not in r and "3+3" not in r and "terse" not in r for r in runs)


def test_chatml_mask_with_qwen2():
    tok = vocab("qwen2")
    out = encode_one(tok, chat_example(), chat_template=template("Qwen-Qwen2.5-7B-Instruct"))
    pieces = [(tok.token_to_piece(i), bool(m)) for i, m in zip(out.ids.tolist(), out.trained)]
    assert pieces[-10:] == [
        ("<|im_start|>", False), ("assistant", False), ("\n", False),
        ("It", True), (" is", True), (" ", True), ("6", True), (".", True), ("<|im_end|>", True),
        ("\n", False)]
    assert trained_runs(tok, out.ids, out.trained) == ["4<|im_end|>", "It is 6.<|im_end|>"]
    assert tok.bos_id not in out.ids[:1].tolist()  # Qwen2 adds no BOS


def test_phi3_mask_keeps_the_templates_bos_and_trains_end_tokens():
    tok = vocab("phi-3")   # SentencePiece, add_bos, <|end|> is a control token
    out = encode_one(tok, chat_example(CONVERSATION[1:]))   # the model's own template
    assert out.ids[0] == tok.bos_id and out.ids.tolist().count(tok.bos_id) == 1
    assert [r.strip() for r in trained_runs(tok, out.ids, out.trained)] == ["4<|end|>", "It is 6.<|end|>"]
    assert out.ids.tolist().count(32007) == 4 and not out.trained[0]


def test_mistral_mask_with_a_sentencepiece_vocab():
    tok = vocab("llama-spm")   # <s> BOS added by the tokenizer and written by the template
    out = encode_one(tok, chat_example(CONVERSATION[1:]),
                     chat_template=template("mistralai-Mistral-Nemo-Instruct-2407"))
    assert out.ids.tolist().count(tok.bos_id) == 1 and out.ids[0] == tok.bos_id
    assert [r.strip() for r in trained_runs(tok, out.ids, out.trained)] == ["4</s>", "It is 6.</s>"]
    assert out.ids[-1] == tok.eos_id and out.trained[-1]


def test_open_final_turn_gets_a_trained_eos():
    tok = vocab("qwen2")
    out = encode_one(tok, chat_example(), chat_template=template("Apertus-8B-Instruct"))
    assert out.ids[-1] == tok.eos_id and out.trained[-1]
    no_eos = encode_one(tok, chat_example(), chat_template=template("Apertus-8B-Instruct"),
                        add_eos=False)
    assert no_eos.ids[-1] != tok.eos_id
    closed = encode_one(tok, chat_example(), chat_template=template("Qwen-Qwen2.5-7B-Instruct"))
    assert closed.ids.tolist().count(tok.eos_id) == 0   # <|im_end|> ends the turn, no extra EOS


def test_only_the_selected_assistant_turns_are_trained():
    tok = vocab("qwen2")
    out = encode_one(tok, chat_example(trained=(4,)), chat_template=template("Qwen-Qwen2.5-7B-Instruct"))
    assert trained_runs(tok, out.ids, out.trained) == ["It is 6.<|im_end|>"]


def test_template_failure_is_a_rejection():
    tok = vocab("qwen2")
    alternate = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
                 "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
                 "{{ m.content }}{% endfor %}")
    good = chat_example(CONVERSATION[1:])
    bad = chat_example(({"role": "assistant", "content": "hi"},))
    out = Encoder(tok, chat_template=alternate).encode([good, bad])
    assert not isinstance(out[0], Rejection)
    assert isinstance(out[1], Rejection) and out[1].kind == "template"
    assert "Conversation roles must alternate" in out[1].reason


# ---- text and completion masks ------------------------------------------------------------------

def test_completion_mask_and_eos_with_sentencepiece():
    tok = vocab("llama-spm")
    out = encode_one(tok, text_example(("Hello", False), (" world", True)))
    pieces = [tok.token_to_piece(i) for i in out.ids.tolist()]
    assert pieces == ["<s>", " Hello", " world", "</s>"]
    assert out.trained.tolist() == [False, False, True, True]


def test_text_mask_trains_everything_but_bos():
    tok = vocab("phi-3")
    out = encode_one(tok, text_example(("Once upon a time.", True)))
    assert out.ids[0] == tok.bos_id and out.ids[-1] == tok.eos_id
    assert out.trained.tolist() == [False] + [True] * (len(out.ids) - 1)
    no_eos = encode_one(tok, text_example(("Once upon a time.", True)), add_eos=False)
    assert no_eos.ids[-1] != tok.eos_id


def test_a_token_across_the_prompt_boundary_is_trained():
    tok = vocab("qwen2")
    out = encode_one(tok, text_example(("The answer: Hel", False), ("lo world", True)))
    pieces = [tok.token_to_piece(i) for i in out.ids.tolist()]
    assert pieces[:5] == ["The", " answer", ":", " Hello", " world"]
    assert out.trained.tolist()[:5] == [False, False, False, True, True]


def test_special_token_texts_in_plain_rows():
    tok = vocab("qwen2")
    row = text_example(("a<|im_end|>b", True))
    plain = encode_one(tok, row)
    parsed = encode_one(tok, row, parse_special=True)
    assert 151645 not in plain.ids.tolist() and 151645 in parsed.ids.tolist()
    ends = encode_one(tok, text_example(("done<|endoftext|>", True)), parse_special=True)
    assert ends.ids.tolist().count(tok.eos_id) == 1   # the text's own EOS, none appended


def test_a_single_token_row_is_rejected():
    tok = vocab("qwen2")
    out = encode_one(tok, text_example(("a", True)), add_eos=False)
    assert isinstance(out, Rejection) and out.kind == "nothing_to_train"
