"""The GGUF tokenizer against llama.cpp.

Oracles: llama.cpp's own tokenizer test files (tests/data/vocab/*.gguf with .inp/.out, made with
add_special=False, parse_special=False), and ids / detokenized text recorded from llama.cpp
(llama-cpp-python 0.3.36, the llama.cpp snapshot of SPEC-llamacpp.md) for the other cases.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from app.engine.errors import ModelFormatError, UnsupportedModelError
from app.engine.io.gguf import read_gguf
from app.engine.text.tokenizer import Tokenizer, _clean_spaces, load_tokenizer
from tests.conftest import VOCAB

VOCAB = VOCAB
VOCAB_NAMES = ("gemma-4", "gpt-2", "llama-spm", "phi-3", "qwen2", "qwen35")
SEPARATOR = b"\n__ggml_vocab_test__\n"


def vocab_path(name: str) -> Path:
    return VOCAB / f"ggml-vocab-{name}.gguf"


@lru_cache(maxsize=None)
def vocab_tokenizer(name: str) -> Tokenizer:
    return load_tokenizer(vocab_path(name))


@lru_cache(maxsize=None)
def vocab_metadata(name: str) -> dict:
    gguf_file = read_gguf(vocab_path(name))
    meta = dict(gguf_file.metadata)
    gguf_file.close()
    return meta


def read_cases(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's test-tokenizer-0 format: inputs separated by a marker line (which may also end
    the file, tests/test-tokenizer-0.cpp:83-96), outputs one line of space-separated ids per input."""
    path = vocab_path(name)
    raw = path.with_name(path.name + ".inp").read_bytes()
    inputs = raw.removesuffix(SEPARATOR).split(SEPARATOR)
    outputs = path.with_name(path.name + ".out").read_text().split("\n")[:-1]
    assert len(inputs) == len(outputs) > 0
    return [(i.decode("utf-8"), [int(x) for x in o.split()]) for i, o in zip(inputs, outputs)]


# ---- llama.cpp's vocab test files -------------------------------------------------------------

@pytest.mark.parametrize("name", VOCAB_NAMES)
def test_vocab_files_tokenize_like_llamacpp(name):
    tok = vocab_tokenizer(name)
    cases = read_cases(name)
    failures = [(text, tok.encode(text, add_special=False), want)
                for text, want in cases if tok.encode(text, add_special=False) != want]
    assert not failures, f"{len(failures)} of {len(cases)} cases differ, first: {failures[0]}"


@pytest.mark.parametrize("name", VOCAB_NAMES)
def test_vocab_files_round_trip(name):
    """decode(encode(x)) == x wherever llama.cpp's detokenizer gives x back: GPT-2 and Gemma 4
    clean up spaces before punctuation (`clean_spaces`), as in " ?" and " ." of two inputs."""
    tok = vocab_tokenizer(name)
    broken = [text for text, _ in read_cases(name)
              if tok.decode(tok.encode(text, add_special=False)) != text]
    cleaned = [text for text, _ in read_cases(name) if _clean_spaces(text.encode()) != text.encode()]
    assert broken == (cleaned if name in ("gpt-2", "gemma-4") else [])
    assert len(cleaned) == 2


def test_detokenizer_cleans_spaces_like_llamacpp():
    tok = vocab_tokenizer("gpt-2")
    ids = tok.encode("Hello , world ! Is it ? Yes . I 'm sure he 's ' ok ' we 've", add_special=False)
    assert ids == [15496, 837, 995, 5145, 1148, 340, 5633, 3363, 764, 314, 705, 76, 1654, 339,
                   705, 82, 705, 12876, 705, 356, 705, 303]
    assert tok.decode(ids) == "Hello, world! Is it? Yes. I'm sure he's'ok'we've"
    # llama.cpp's outputs at the edges of its clean-up passes
    assert tok.decode(tok.encode(" ' ok", add_special=False)) == "'ok"
    assert tok.decode(tok.encode(" ' ' x", add_special=False)) == "'' x"


# ---- special tokens, BOS/EOS, decoding --------------------------------------------------------

def test_spm_prefixes_a_space_after_special_tokens():
    """llama.cpp puts a space before every text fragment that follows a special token."""
    tok = vocab_tokenizer("llama-spm")
    assert tok.encode("<s>Hello</s> world", add_special=False, parse_special=True) == \
        [1, 15043, 2, 29871, 3186]
    assert tok.encode("<s>Hello</s> world", add_special=True, parse_special=False) == \
        [1, 529, 29879, 29958, 10994, 829, 29879, 29958, 3186]


def test_parse_special_controls_chatml_markers():
    tok = vocab_tokenizer("qwen2")
    text = "<|im_start|>user\nHi<|im_end|>"
    assert tok.encode(text, add_special=False, parse_special=True) == [151644, 872, 198, 13048, 151645]
    assert tok.encode(text, add_special=False, parse_special=False) == \
        [27, 91, 318, 4906, 91, 29, 872, 198, 13048, 27, 91, 318, 6213, 91, 29]


def test_phi3_strips_whitespace_after_special_tokens():
    tok = vocab_tokenizer("phi-3")
    ids = tok.encode("<|user|>\n  Hi<|end|>\n<|assistant|>", add_special=True, parse_special=True)
    assert ids == [1, 32010, 6324, 32007, 32001]
    assert tok.decode(ids) == "<s><|user|> Hi<|end|><|assistant|>"
    assert tok.decode(ids, skip_special=True) == " Hi"


def test_jina_v2_strips_whitespace_before_its_mask_token():
    """llama.cpp sets LSTRIP on `<mask>` for the jina-v2 pre-tokenizers (llama-vocab.cpp:3108-3117)."""
    meta = vocab_metadata("gpt-2")
    tokens, types = list(meta["tokenizer.ggml.tokens"]), np.array(meta["tokenizer.ggml.token_type"])
    tokens[50000], types[50000] = "<mask>", 3  # CONTROL
    meta = {**meta, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}
    assert Tokenizer.from_metadata(meta).encode("a <mask>", parse_special=True) == [64, 220, 50000]
    jina = Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "jina-v2-es"})
    assert jina.encode("a <mask>", parse_special=True) == [64, 50000]


def test_add_special_follows_the_models_rules():
    spm, gpt2, qwen2 = (vocab_tokenizer(n) for n in ("llama-spm", "gpt-2", "qwen2"))
    assert (spm.add_bos, spm.add_eos, spm.bos_id, spm.eos_id) == (True, False, 1, 2)
    assert spm.encode(" Hello") == [1, 29871, 15043]
    assert spm.encode("") == [1] and spm.encode("", add_special=False) == []
    assert not gpt2.add_bos and gpt2.encode("Hello") == gpt2.encode("Hello", add_special=False)
    assert not qwen2.add_bos and qwen2.bos_id == 151643


def test_decode_matches_llamacpp_detokenize():
    tok = vocab_tokenizer("llama-spm")
    ids = [1, 15043, 2, 29871, 3186]
    assert tok.decode(ids) == "<s> Hello</s>  world"
    assert tok.decode(ids, skip_special=True) == " Hello  world"
    assert tok.decode([1, 29871, 15043]) == "<s>  Hello"
    assert tok.decode([29871, 15043]) == " Hello"  # the prefix space is removed once
    assert tok.token_to_piece(15043) == " Hello"
    assert tok.token_to_piece(1) == "<s>"
    with pytest.raises(ValueError):
        tok.decode([-1])


def test_decode_joins_byte_tokens_into_characters():
    tok = vocab_tokenizer("llama-spm")
    ids = tok.encode("🦙", add_special=False)
    assert [tok.token_to_piece(i) for i in ids[1:]] == ["\ufffd"] * 4  # one UTF-8 byte each
    assert tok.decode(ids) == "🦙"


@pytest.mark.parametrize("name, eot", [
    ("gemma-4", {1, 50, 106}),                # <eos>, <|tool_response>, <turn|>; </s> is normal
    ("gpt-2", {50256}),
    ("llama-spm", {2}),
    ("phi-3", {2, 32000, 32007}),             # </s>, <|endoftext|>, <|end|>
    ("qwen2", {128247, 151643, 151645}),      # </s>, <|endoftext|>, <|im_end|>
])
def test_end_of_generation_ids_match_llamacpp(name, eot):
    assert vocab_tokenizer(name).eot_ids == eot


def test_properties():
    tok = vocab_tokenizer("phi-3")
    assert tok.vocab_size == 32064
    assert tok.chat_template.startswith("{{ bos_token }}")
    assert vocab_tokenizer("gpt-2").chat_template is None


# ---- pre-tokenizers ---------------------------------------------------------------------------

PRE_TEXT = "Hello World's 12345 ÄpfelÖl  x\n\n  y ;;; 日本語ABCdef'll I'M 3.14 camelCaseWord 😀!"
# llama.cpp's ids for PRE_TEXT with add_special=True: the GPT-2 vocabulary and merges, with only
# tokenizer.ggml.pre changed (llama-bpe and tekken also add BOS 50256 by default).
PRE_EXPECTED = {
    "default": [15496, 2159, 6, 82, 220, 10163, 2231, 6184, 226, 79, 69, 417, 127, 244, 75, 220,
                2124, 628, 220, 331, 220, 7665, 26, 10545, 245, 98, 17312, 105, 45739, 252, 24694,
                4299, 6, 297, 314, 6, 44, 220, 18, 13, 1415, 41021, 20448, 26449, 30325, 222, 0],
    "gpt-2": [15496, 2159, 338, 17031, 2231, 6184, 226, 79, 69, 417, 127, 244, 75, 220, 2124, 628,
              220, 331, 2162, 7665, 10545, 245, 98, 17312, 105, 45739, 252, 24694, 4299, 1183, 314,
              6, 44, 513, 13, 1415, 41021, 20448, 26449, 30325, 222, 0],
    "llama-bpe": [50256, 15496, 2159, 338, 220, 10163, 2231, 6184, 226, 79, 69, 417, 127, 244, 75,
                  220, 2124, 628, 220, 331, 2162, 7665, 10545, 245, 98, 17312, 105, 45739, 252,
                  24694, 4299, 1183, 314, 6, 44, 220, 18, 13, 1415, 41021, 20448, 26449, 30325,
                  222, 0],
    "qwen2": [15496, 2159, 338, 220, 16, 17, 18, 19, 20, 6184, 226, 79, 69, 417, 127, 244, 75, 220,
              2124, 628, 220, 331, 2162, 7665, 10545, 245, 98, 17312, 105, 45739, 252, 24694, 4299,
              1183, 314, 6, 44, 220, 18, 13, 16, 19, 41021, 20448, 26449, 30325, 222, 0],
    "tekken": [50256, 15496, 2159, 338, 220, 16, 17, 18, 19, 20, 6184, 226, 79, 69, 417, 127, 244,
               75, 220, 2124, 628, 220, 331, 2162, 7665, 10545, 245, 98, 17312, 105, 45739, 252,
               24694, 4299, 1183, 314, 6, 44, 220, 18, 13, 16, 19, 41021, 20448, 26449, 30325, 222,
               0],
    "gpt-4o": [15496, 2159, 338, 220, 10163, 2231, 6184, 226, 79, 69, 417, 127, 244, 75, 220, 2124,
               628, 220, 331, 2162, 7665, 10545, 245, 98, 17312, 105, 45739, 252, 24694, 4299, 1183,
               314, 6, 44, 220, 18, 13, 1415, 41021, 20448, 26449, 30325, 222, 0],
    "deepseek-v3": [15496, 2159, 338, 220, 10163, 2231, 6184, 226, 79, 69, 417, 127, 244, 75, 220,
                    2124, 628, 220, 331, 2162, 7665, 220, 33768, 98, 17312, 105, 45739, 252, 24694,
                    4299, 1183, 314, 6, 44, 220, 18, 13, 1415, 41021, 20448, 26449, 30325, 222, 0],
}


@pytest.mark.parametrize("pre", sorted(PRE_EXPECTED))
def test_pre_tokenizer_regexes_match_llamacpp(pre):
    tok = Tokenizer.from_metadata({**vocab_metadata("gpt-2"), "tokenizer.ggml.pre": pre})
    assert tok.encode(PRE_TEXT) == PRE_EXPECTED[pre]


# ---- unsupported and broken files -------------------------------------------------------------

@pytest.mark.parametrize("model", ["bert", "t5", "rwkv", "plamo2", "hybriddna", "whitespace", "no_vocab"])
def test_unsupported_tokenizer_models_are_named(model):
    with pytest.raises(UnsupportedModelError, match=model) as err:
        Tokenizer.from_metadata({**vocab_metadata("gpt-2"), "tokenizer.ggml.model": model})
    assert "'llama'" in err.value.message and "'gpt2'" in err.value.message


def test_unknown_pre_tokenizer_is_unsupported():
    with pytest.raises(UnsupportedModelError, match="made-up-pre") as err:
        Tokenizer.from_metadata({**vocab_metadata("gpt-2"), "tokenizer.ggml.pre": "made-up-pre"})
    assert "llama3" in err.value.message and "qwen2" in err.value.message


def test_gemma4_files_follow_llamacpps_gemma4_rules():
    """A `gemma4` tokenizer always uses the gemma4 pre-tokenizer and adds BOS; spaces are U+2581
    in its vocabulary and byte tokens are <0xXX> (llama-vocab.cpp:2110-2152, :528-537, :2650-2656)."""
    meta = {**vocab_metadata("gemma-4"), "tokenizer.ggml.pre": "qwen2",
            "tokenizer.ggml.add_bos_token": False}
    tok = Tokenizer.from_metadata(meta)
    assert tok.encode("Hello world") == [2, *vocab_tokenizer("gemma-4").encode("Hello world", add_special=False)]
    assert tok.add_bos and (tok.bos_id, tok.eos_id) == (2, 1)
    ids = tok.encode("\x01 a", add_special=False)
    assert tok.token_to_piece(ids[0]) == "\x01" and tok.decode(ids) == "\x01 a"
    no_ids = {k: v for k, v in vocab_metadata("gemma-4").items() if not k.endswith("_token_id")}
    with pytest.raises(ModelFormatError):  # no default BOS id (gpt2's is 11), yet it must add one
        Tokenizer.from_metadata(no_ids)


def test_kimi_k2_needs_no_merges():
    """llama.cpp loads a kimi-k2 vocabulary without merges (llama-vocab.cpp:1997-2008)."""
    meta = {k: v for k, v in vocab_metadata("gpt-2").items() if k != "tokenizer.ggml.merges"}
    tok = Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "kimi-k2"})
    assert tok.encode("ab", add_special=False) == [64, 65]
    with pytest.raises(ModelFormatError):
        Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "qwen2"})


def test_missing_vocabulary_is_a_format_error():
    meta = {k: v for k, v in vocab_metadata("gpt-2").items() if k != "tokenizer.ggml.tokens"}
    with pytest.raises(ModelFormatError):
        Tokenizer.from_metadata(meta)
    with pytest.raises(ModelFormatError):
        Tokenizer.from_metadata({"general.architecture": "llama"})


# ---- hash -------------------------------------------------------------------------------------

def test_hash_is_stable_and_tracks_the_rules():
    meta = vocab_metadata("llama-spm")
    first = Tokenizer.from_metadata(meta).hash()
    assert first == vocab_tokenizer("llama-spm").hash()
    assert len(first) == 64 and int(first, 16) >= 0
    assert Tokenizer.from_metadata({**meta, "tokenizer.ggml.add_bos_token": False}).hash() != first
    assert vocab_tokenizer("phi-3").hash() != first


# ---- the real Gemma 3 270M (llama.cpp ids recorded from llama-cpp-python 0.3.36) ----------------

GEMMA_CHAT = "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
GEMMA_CASES = [
    # (text, add_special, parse_special, llama.cpp ids)
    ("The capital of France is Paris. The capital of Germany is", True, False,
     [2, 818, 5279, 529, 7001, 563, 9079, 236761, 669, 5279, 529, 9405, 563]),
    ("Hello world", False, False, [9259, 1902]),
    ("  leading spaces and   multiple   spaces ", False, False,
     [138, 26016, 9952, 532, 139, 43819, 139, 35220, 236743]),
    ("line one\nline two\n\n\nthree\ttab", False, False,
     [1257, 886, 107, 1257, 1156, 109, 19891, 255968, 4823]),
    ("Numbers: 3.14159, 1234567890 and 42%", False, False,
     [37091, 236787, 236743, 236800, 236761, 236770, 236812, 236770, 236810, 236819, 236764, 236743,
      236770, 236778, 236800, 236812, 236810, 236825, 236832, 236828, 236819, 236771, 532, 236743,
      236812, 236778, 236908]),
    ("Unicode: café naïve Straße 日本語 😀👍🏽", False, False,
     [123540, 236787, 33443, 120362, 80176, 33375, 238582, 163543, 240493, 242713]),
    (GEMMA_CHAT, True, True,
     [2, 105, 2364, 107, 3689, 563, 236743, 236778, 236862, 236778, 236881, 106, 107, 105, 4368, 107]),
    (GEMMA_CHAT, True, False,
     [2, 236820, 3041, 236779, 1340, 236779, 887, 236813, 2364, 107, 3689, 563, 236743, 236778,
      236862, 236778, 145912, 643, 236779, 1340, 236779, 887, 236813, 107, 236820, 3041, 236779,
      1340, 236779, 887, 236813, 4368, 107]),
    # "</s>" is a user-defined HTML token in Gemma that llama.cpp turns into an end-of-generation
    # control token by its text; "<b>" stays user-defined and is split off either way.
    ("</s> and <b>bold</b>", False, False, [954, 236751, 236813, 532, 236743, 200, 15640, 209]),
    ("</s> and <b>bold</b>", False, True, [212, 532, 236743, 200, 15640, 209]),
]


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma3_270m) -> Tokenizer:
    return load_tokenizer(gemma3_270m)


@pytest.mark.slow
@pytest.mark.parametrize("text, add_special, parse_special, expected", GEMMA_CASES)
def test_gemma3_tokenizes_like_llamacpp(gemma_tokenizer, text, add_special, parse_special, expected):
    assert gemma_tokenizer.encode(text, add_special, parse_special) == expected


@pytest.mark.slow
def test_gemma3_rules_and_decoding(gemma_tokenizer):
    tok = gemma_tokenizer
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (2, 1, True, False)
    assert tok.eot_ids == {1, 106, 212}  # <eos>, <end_of_turn>, </s>
    assert tok.vocab_size == 262144
    ids = GEMMA_CASES[6][3]
    assert tok.decode(ids) == "<bos>" + GEMMA_CHAT
    assert tok.decode(ids, skip_special=True) == "user\nWhat is 2+2?\nmodel\n"
    for text, *_ in GEMMA_CASES:
        assert tok.decode(tok.encode(text, add_special=False)) == text
