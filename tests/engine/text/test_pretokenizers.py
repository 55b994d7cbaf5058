"""Every pre-tokenizer llama.cpp accepts, on a minimal vocab GGUF built here.

Oracle: how llama.cpp 0c1e57098 (llama-cpp-python 0.3.36) cuts TEXT into pre-tokens, recorded by
running its own `unicode_regex_split` (src/unicode.cpp) with each type's regexes from
`llm_tokenizer_bpe` (src/llama-vocab.cpp:280-575), as lengths in code points. (Run over the
llama.cpp vocab test inputs and a set of harder strings, it splits exactly like our table for all
91 names.) The vocabulary built for a type makes the ids show those cuts: every substring of
every expected pre-token is a token and every split of one into two tokens is a merge, so a
pre-token always merges into one token; the pairs that straddle two neighbouring pre-tokens are
tokens too, merged first, so a pre-tokenizer that fails to cut there gives other ids.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest

from app.engine.text.pretokenizers import PRE_RULES, TYPES
from app.engine.text.tokenizer import Tokenizer, _byte_alphabet, load_tokenizer
from tests.gguf_build import write_gguf

TEXT = ("Hello World's 1234567 ÄpfelÖl  x\n\n  y ;;; 日本語ABC'll I'M camelCase 😀!\u3000。 ١٢٣ e\u0301 "
        "<sentinel:1>")
# llama.cpp's pre-tokens of TEXT (of TEXT with spaces written U+2581 for gemma4 / sarvam-moe).
CUTS = {
    "DEFAULT": [5, 6, 1, 1, 1, 3, 3, 1, 8, 1, 2, 3, 2, 1, 3, 7, 1, 2, 2, 1, 1, 10, 2, 1, 1, 1, 1, 3, 2, 1, 1, 1, 8, 1, 1, 1],
    "MINICPM5": [5, 6, 2, 1, 3, 3, 1, 8, 1, 2, 2, 1, 2, 4, 7, 3, 2, 2, 10, 3, 1, 1, 1, 3, 2, 1, 2, 8, 1, 1, 1],
    "LLAMA3": [5, 6, 2, 1, 3, 3, 1, 8, 1, 2, 2, 1, 2, 4, 7, 3, 2, 2, 10, 3, 1, 1, 1, 3, 2, 1, 2, 8, 1, 1, 1],
    "DEEPSEEK_LLM": [5, 6, 1, 1, 1, 7, 2, 4, 1, 1, 1, 2, 1, 1, 1, 2, 4, 1, 3, 3, 1, 2, 2, 1, 1, 10, 2, 1, 1, 1, 1, 3, 2, 1, 2, 8, 1, 1, 1],
    "DEEPSEEK_CODER": [5, 6, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 8, 1, 2, 1, 1, 1, 2, 4, 1, 3, 3, 1, 2, 2, 1, 1, 10, 2, 1, 1, 1, 1, 1, 1, 1, 2, 3, 8, 1, 1, 1],
    "DEEPSEEK3_LLM": [5, 6, 2, 1, 3, 3, 1, 8, 1, 2, 2, 1, 2, 4, 1, 3, 3, 3, 2, 2, 10, 3, 1, 1, 1, 3, 3, 2, 8, 1, 1, 1],
    "SPARK2_5": [5, 6, 2, 1, 1, 1, 1, 1, 1, 1, 1, 8, 1, 2, 1, 1, 1, 2, 4, 1, 3, 3, 3, 2, 2, 10, 3, 1, 1, 1, 1, 1, 1, 3, 2, 8, 1, 1, 1],
    "YOUTU": [5, 8, 1, 1, 1, 1, 1, 1, 1, 1, 8, 1, 2, 2, 1, 2, 4, 1, 3, 6, 4, 10, 3, 1, 1, 1, 1, 1, 1, 3, 2, 8, 1, 1, 1],
    "FALCON": [5, 6, 1, 1, 1, 3, 3, 1, 8, 1, 2, 3, 2, 1, 3, 7, 1, 2, 2, 1, 1, 10, 2, 1, 1, 1, 4, 2, 1, 1, 1, 8, 1, 1, 1],
    "GPT2": [5, 6, 2, 8, 8, 1, 2, 3, 2, 4, 7, 3, 2, 1, 1, 10, 3, 1, 1, 4, 2, 1, 2, 8, 1, 1, 1],
    "STARCODER": [5, 6, 2, 1, 1, 1, 1, 1, 1, 1, 1, 8, 1, 2, 3, 2, 4, 7, 3, 2, 1, 1, 10, 3, 1, 1, 1, 1, 1, 1, 2, 1, 2, 8, 1, 1, 1],
    "JAIS2": [5, 6, 2, 1, 3, 3, 1, 8, 1, 2, 2, 1, 2, 4, 7, 3, 2, 2, 10, 3, 1, 1, 1, 3, 2, 1, 2, 8, 1, 1, 1],
    "GEMMA4": [32, 2, 56],
    "SARVAM_MOE": [32, 2, 56],
    "WHITESPACE": [5, 1, 7, 1, 7, 1, 7, 2, 1, 4, 1, 1, 3, 1, 9, 1, 3, 1, 9, 1, 2, 1, 1, 1, 3, 1, 2, 1, 12],
    "QWEN2": [5, 6, 2, 1, 1, 1, 1, 1, 1, 1, 1, 8, 1, 2, 2, 1, 2, 4, 7, 3, 2, 2, 10, 3, 1, 1, 1, 1, 1, 1, 2, 1, 2, 8, 1, 1, 1],
    "QWEN35": [5, 6, 2, 1, 1, 1, 1, 1, 1, 1, 1, 8, 1, 2, 2, 1, 2, 4, 7, 3, 2, 2, 10, 3, 1, 1, 1, 1, 1, 1, 3, 2, 8, 1, 1, 1],
    "BLOOM": [5, 8, 8, 8, 1, 2, 3, 2, 4, 10, 4, 10, 2, 3, 4, 3, 13],
    "VIKING": [5, 8, 1, 1, 1, 1, 1, 1, 1, 1, 8, 1, 2, 3, 2, 4, 10, 4, 10, 2, 3, 1, 1, 1, 1, 3, 11, 1, 1],
    "TEKKEN": [5, 6, 2, 1, 1, 1, 1, 1, 1, 1, 1, 8, 1, 2, 2, 1, 2, 4, 4, 3, 3, 2, 2, 6, 4, 3, 1, 1, 1, 1, 1, 1, 2, 1, 2, 8, 1, 1, 1],
    "EXAONE_MOE": [11, 2, 1, 1, 1, 1, 1, 1, 1, 1, 8, 1, 2, 2, 1, 2, 4, 7, 3, 2, 2, 10, 3, 1, 1, 1, 1, 1, 1, 3, 2, 8, 1, 1, 1],
    "CHAMELEON": [5, 6, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 8, 2, 1, 1, 1, 2, 1, 1, 1, 1, 1, 7, 1, 2, 2, 1, 1, 10, 2, 1, 1, 1, 1, 1, 1, 1, 2, 1, 1, 1, 8, 1, 1, 1],
    "GPT4O": [5, 8, 1, 3, 3, 1, 8, 1, 2, 2, 1, 2, 4, 4, 6, 4, 6, 4, 3, 1, 1, 1, 3, 2, 1, 2, 8, 1, 1, 1],
    "GRANITE_EMB_MULTI": [5, 8, 1, 3, 3, 1, 8, 1, 2, 2, 1, 2, 4, 4, 6, 4, 6, 4, 3, 1, 1, 1, 3, 3, 2, 8, 1, 1, 1],
    "TINY_AYA": [5, 8, 1, 1, 3, 3, 8, 1, 2, 2, 1, 2, 4, 10, 4, 10, 3, 1, 1, 1, 3, 3, 2, 8, 1, 1, 1],
    "SUPERBPE": [14, 1, 3, 3, 50, 3, 14, 1, 1],
    "BAILINGMOE": [5, 6, 2, 1, 1, 1, 1, 1, 1, 1, 1, 8, 1, 2, 2, 1, 2, 4, 7, 3, 2, 2, 10, 3, 1, 1, 1, 1, 1, 1, 2, 1, 2, 8, 1, 1, 1],
    "SEED_CODER": [5, 6, 2, 1, 1, 1, 1, 1, 1, 1, 1, 8, 1, 2, 2, 1, 2, 4, 7, 3, 2, 2, 10, 3, 1, 1, 1, 1, 1, 1, 2, 1, 2, 8, 1, 1, 1],
    "KIMI_K2": [5, 8, 1, 3, 3, 1, 8, 1, 2, 2, 1, 2, 4, 1, 3, 6, 4, 10, 3, 1, 1, 1, 3, 2, 1, 2, 8, 1, 1, 1],
    "UFAKZEKA": [5, 6, 2, 1, 1, 1, 1, 1, 1, 1, 1, 8, 1, 2, 2, 1, 2, 4, 7, 3, 2, 2, 10, 3, 1, 1, 1, 1, 1, 1, 2, 1, 2, 8, 1, 1, 1],
    "AFMOE": [5, 6, 2, 1, 1, 3, 3, 8, 1, 2, 2, 1, 2, 4, 1, 3, 3, 3, 2, 2, 10, 3, 1, 1, 1, 3, 3, 2, 8, 1, 1, 1],
    "LAGUNA": [5, 6, 2, 1, 1, 1, 1, 1, 1, 1, 1, 8, 1, 2, 2, 1, 2, 4, 7, 3, 2, 2, 10, 3, 1, 1, 1, 1, 1, 1, 2, 1, 2, 8, 1, 1, 1],
}
_BYTE_CHARS = {b: ch for ch, b in _byte_alphabet().items()}


def pre_tokens(pre_type: str) -> list[str]:
    text = TEXT.replace(" ", "▁") if PRE_RULES[_NAME_OF[pre_type]].escape_whitespaces else TEXT
    pieces, at = [], 0
    for n in CUTS[pre_type]:
        pieces.append(text[at:at + n])
        at += n
    assert at == len(text)
    if TYPES[pre_type].byte_encode:  # the vocabulary holds pre-tokens in the GPT-2 byte alphabet
        pieces = ["".join(_BYTE_CHARS[b] for b in p.encode()) for p in pieces]
    return pieces


_NAME_OF = {rules.type: name for name, rules in reversed(PRE_RULES.items())}


@lru_cache(maxsize=None)
def vocab_metadata(pre_type: str) -> tuple[dict, list[int]]:
    """A BPE vocabulary for `pre_type` and the ids of llama.cpp's pre-tokens of TEXT in it."""
    pieces = pre_tokens(pre_type)
    straddling = {a[-1] + b[0]: (a[-1], b[0]) for a, b in zip(pieces, pieces[1:])}
    substrings = {p[i:j] for p in pieces for i in range(len(p)) for j in range(i + 1, len(p) + 1)}
    if TYPES[pre_type].byte_encode:
        bytes_ = [_BYTE_CHARS[b] for b in range(256)]
    else:
        bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tokens = bytes_ + sorted((substrings | set(straddling)) - set(bytes_))
    merges = [f"{a} {b}" for a, b in straddling.values()] + [
        f"{t[:k]} {t[k:]}" for t in sorted(substrings, key=lambda t: (len(t), t)) for k in range(1, len(t))
        if t[:k] in substrings and t[k:] in substrings]
    types = [6 if not TYPES[pre_type].byte_encode else 1] * 256 + [1] * (len(tokens) - 256)
    meta = {"general.architecture": "llama", "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": _NAME_OF[pre_type], "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
            "tokenizer.ggml.merges": merges}
    index = {t: i for i, t in enumerate(tokens)}
    return meta, [index[p] for p in pieces]


def test_every_pre_tokenizer_type_has_llamacpp_cuts():
    assert set(CUTS) == set(TYPES) == {rules.type for rules in PRE_RULES.values()}
    assert len(PRE_RULES) == 91  # every name of llama-vocab.cpp:2166-2426, "default" included


@pytest.mark.parametrize("pre_type", sorted(CUTS))
def test_minimal_vocab_gguf_tokenizes_like_llamacpp(tmp_path, pre_type):
    meta, expected = vocab_metadata(pre_type)
    tok = load_tokenizer(write_gguf(tmp_path / "vocab.gguf", meta, {}))
    assert tok.encode(TEXT, add_special=False) == expected
    assert tok.decode(expected) == TEXT if not PRE_RULES[_NAME_OF[pre_type]].clean_spaces else True


@pytest.mark.parametrize("name", sorted(PRE_RULES))
def test_every_name_loads_with_its_types_cuts(name):
    rules = PRE_RULES[name]
    meta, expected = vocab_metadata(rules.type)
    tok = Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": name})
    assert tok.encode(TEXT, add_special=False) == expected
    bos = None if rules.no_bos else 11  # BPE's default BOS id (llama-vocab.cpp:2031)
    assert tok.bos_id == bos and tok.add_bos == (rules.add_bos or TYPES[rules.type].force_bos)
