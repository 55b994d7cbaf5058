"""GGUF vocabulary -> a tokenizer that tokenizes exactly like llama.cpp.

A GGUF file carries no `tokenizer.json`, only llama.cpp's metadata keys (SPEC 5.1). We read
them with llama.cpp's rules (`llama_vocab::impl::load`, src/llama-vocab.cpp) and build a HF
`tokenizers` pipeline from them (SPEC 5.2), so the hot loop runs in Rust:

* `llama` (SentencePiece, "SPM"): a BPE model over the vocabulary with byte fallback. llama.cpp
  merges the adjacent pair whose *merged token has the highest score*, leftmost first; a BPE
  model whose merge ranks are sorted by that score does the same. We always derive the merges
  from the scores, even when a file also lists merges, because llama.cpp ignores them for SPM.
  Spaces become U+2581 and, when `add_space_prefix` holds, one is prepended to every text
  fragment (llama.cpp prepends a space to the first fragment and to every fragment that follows
  a special token, and fragments are always separated by special tokens). That is a normalizer
  (`Prepend` + `Replace`), not `Metaspace`, which skips the prefix when the text already starts
  with a space. Gemma needs nothing more: its multi-space and newline tokens are user-defined,
  so they are split off before the model sees the text, exactly as llama.cpp does.
* `gpt2` (BPE): the file's merges, and the pre-tokenizer llama.cpp uses for the file's
  `tokenizer.ggml.pre` (pretokenizers.py: every name llama.cpp accepts, as regex splits), then
  the GPT-2 byte alphabet. A few pre-tokenizers (gemma4, sarvam-moe, whitespace) skip the byte
  alphabet: raw UTF-8 with `<0xXX>` byte-fallback tokens, spaces written U+2581 for the first two.
* `gemma4`: BPE with the `gemma4` pre-tokenizer, whatever the file's `tokenizer.ggml.pre` says.

Special tokens follow llama.cpp's partitioning: CONTROL and UNKNOWN tokens are cut out of the
text only with `parse_special=True`; USER_DEFINED tokens always are. They become HF added
tokens (special and non-special) and `encode_special_tokens` switches the former off.
Known, accepted differences from llama.cpp: where two special-token occurrences overlap, HF
takes the leftmost-longest match while llama.cpp matches the longest token text first over the
whole string; the whitespace stripped beside special tokens (Phi-3, jina-v2's mask) is Unicode
whitespace in HF, ASCII whitespace in llama.cpp.

Decoding does not use HF: it replays llama.cpp's `token_to_piece` and `detokenize` (leading-space
removal, `clean_spaces`, BOS/EOS removal) over per-token byte pieces, which is short and exact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import threading
from itertools import chain
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from app.engine.errors import ModelFormatError, UnsupportedModelError
from app.engine.io.gguf import read_gguf
from app.engine.text.pretokenizers import PRE_RULES, TYPES, PreRules, PreType

# Bump when a change here alters token ids or the rules hashed by `Tokenizer.hash()`.
_IMPLEMENTATION_VERSION = 2

# `tokenizer.ggml.token_type` values (gguf constants / llama.h `llama_token_type`).
_TYPE_NORMAL, _TYPE_UNKNOWN, _TYPE_CONTROL, _TYPE_USER_DEFINED, _TYPE_UNUSED, _TYPE_BYTE = range(1, 7)

# llama.cpp's per-token attribute bits (llama.h `llama_token_attr`).
_ATTR_UNKNOWN = 1 << 0
_ATTR_UNUSED = 1 << 1
_ATTR_NORMAL = 1 << 2
_ATTR_CONTROL = 1 << 3
_ATTR_USER_DEFINED = 1 << 4
_ATTR_BYTE = 1 << 5
_ATTR_LSTRIP = 1 << 7
_ATTR_RSTRIP = 1 << 8

_TYPE_TO_ATTR = {
    _TYPE_NORMAL: _ATTR_NORMAL, _TYPE_UNKNOWN: _ATTR_UNKNOWN, _TYPE_CONTROL: _ATTR_CONTROL,
    _TYPE_USER_DEFINED: _ATTR_USER_DEFINED, _TYPE_UNUSED: _ATTR_UNUSED, _TYPE_BYTE: _ATTR_BYTE,
}

# Token texts llama.cpp treats as end-of-generation whatever the file says, forcing them to
# CONTROL (llama-vocab.cpp, "maintain a list of tokens that cause end-of-generation").
END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})
# Fill-in-the-middle tokens llama.cpp detects by text (forced to CONTROL); pad/repo/file-sep
# also end generation.
_FIM_TEXTS = {
    "pre": {"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
            "▁<PRE>", "<|code_prefix|>", "<|prefix|>"},
    "suf": {"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
            "▁<SUF>", "<|code_suffix|>", "<|suffix|>"},
    "mid": {"<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
            "▁<MID>", "<|code_middle|>", "<|middle|>"},
    "pad": {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"},
    "rep": {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"},
    "sep": {"<|file_sep|>"},
}
_FIM_EOG = ("pad", "rep", "sep")
# gpt-oss: llama.cpp always renders these, as USER_DEFINED tokens.
_ALWAYS_USER_DEFINED = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})

def _byte_alphabet() -> dict[str, int]:
    """GPT-2 alphabet character -> byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return {ch: b for b, ch in table.items()}


_UNICODE_TO_BYTE = _byte_alphabet()
# str.translate table: alphabet character -> the Latin-1 character of its byte; characters below
# 256 that are not in the alphabet -> U+FFFF, so that encoding to Latin-1 fails on them.
_TO_LATIN1 = {**{c: "\uffff" for c in range(256)}, **{ord(ch): chr(b) for ch, b in _UNICODE_TO_BYTE.items()}}


# ---- the vocabulary, resolved with llama.cpp's rules ------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Vocab:
    kind: str                       # "spm" or "bpe" (llama.cpp's vocab type)
    pre: str                        # tokenizer.ggml.pre as llama.cpp resolved it
    tokens: list[str]
    attrs: np.ndarray               # (V,) int32 llama_token_attr bits, after llama.cpp's overrides
    scores: np.ndarray              # (V,) float32
    merges: list[str]               # BPE only
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    eog_ids: frozenset[int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    clean_spaces: bool
    ignore_merges: bool
    escape_whitespaces: bool        # BPE: spaces are U+2581 in the vocabulary
    pre_type: PreType | None        # BPE only


def _as_list(value: Any) -> list:
    return value.tolist() if isinstance(value, np.ndarray) else list(value)


def _read_tokens(meta: dict[str, Any]) -> list[str]:
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelFormatError("The model file has no tokenizer vocabulary (tokenizer.ggml.tokens).",
                               "Use a GGUF converted with its tokenizer.")
    # llama.cpp renames empty tokens rather than rejecting the file.
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(_as_list(tokens))]
    if len(set(tokens)) != len(tokens):
        raise ModelFormatError("The tokenizer vocabulary lists the same token twice.",
                               "The file is damaged or was converted wrongly; re-convert it.")
    return tokens


def _per_token(meta: dict[str, Any], key: str, n: int, default: float, dtype) -> np.ndarray:
    """A per-token array (scores, types); llama.cpp accepts longer arrays and ignores the rest."""
    value = meta.get(key)
    if value is None:
        return np.full(n, default, dtype=dtype)
    arr = np.asarray(value, dtype=dtype)
    if arr.ndim != 1 or arr.shape[0] < n:
        raise ModelFormatError(f"{key} has {arr.size} entries for {n} tokens.",
                               "The file is damaged or was converted wrongly; re-convert it.")
    return arr[:n].copy()


def _token_id(meta: dict[str, Any], name: str, default: int | None, n: int) -> int | None:
    """A special token id: the file's key if in range, else llama.cpp's default if in range."""
    if default is not None and default >= n:
        default = None
    value = meta.get(f"tokenizer.ggml.{name}_token_id")
    if value is None or not 0 <= int(value) < n:
        return default
    return int(value)


def _type_attrs(types: np.ndarray) -> np.ndarray:
    """`token_type` values -> attribute bits; unknown types become UNDEFINED (0), as in llama.cpp."""
    table = np.zeros(7, dtype=np.int32)
    for token_type, attr in _TYPE_TO_ATTR.items():
        table[token_type] = attr
    valid = (types >= 0) & (types < len(table))
    return np.where(valid, table[np.clip(types, 0, len(table) - 1)], 0).astype(np.int32)


def _resolve_attrs(tokens: list[str], types: np.ndarray, meta: dict[str, Any],
                   eos_id: int | None) -> tuple[np.ndarray, frozenset[int]]:
    """Token attributes and the end-of-generation set, with llama.cpp's text-based overrides.

    llama.cpp finds EOG and FIM tokens by their text and forces them to CONTROL, whatever the
    file's token type says; that decides whether `parse_special=False` leaves them as text.
    Where llama.cpp keeps only one of several FIM candidates (in hash-map order), we keep all.
    """
    index = {t: i for i, t in enumerate(tokens)}
    attrs = _type_attrs(types)
    eog: set[int] = set()
    for kind, texts in _FIM_TEXTS.items():
        key_id = _token_id(meta, f"fim_{kind}", None, len(tokens))
        found = [key_id] if key_id is not None else [index[t] for t in texts if t in index]
        if key_id is None:
            attrs[found] |= _ATTR_CONTROL
        if kind in _FIM_EOG:
            eog.update(found)
    found = [index[t] for t in END_OF_GENERATION_TEXTS if t in index]
    attrs[found] |= _ATTR_CONTROL
    eog.update(found)
    attrs[[index[t] for t in _ALWAYS_USER_DEFINED if t in index]] = _ATTR_USER_DEFINED
    eog.update(i for i in (_token_id(meta, "eot", None, len(tokens)),
                           _token_id(meta, "eom", None, len(tokens)), eos_id) if i is not None)
    _harmony_end_fix(tokens, attrs, eog)
    _normal_s_fix(tokens, attrs, eog)
    _strip_attrs(meta, index, attrs)
    return attrs, frozenset(eog)


def _harmony_end_fix(tokens: list[str], attrs: np.ndarray, eog: set[int]) -> None:
    """gpt-oss / solar-open: `<|end|>` separates messages there, it does not end generation."""
    texts = {tokens[i]: i for i in eog}
    has_call = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
        end = texts["<|end|>"]
        eog.discard(end)
        attrs[end] = _ATTR_USER_DEFINED


def _normal_s_fix(tokens: list[str], attrs: np.ndarray, eog: set[int]) -> None:
    """gemma4 / plamo: `</s>` is a normal token there, not an end of generation (:3004-3032)."""
    texts = {tokens[i]: i for i in eog}
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog.discard(texts["</s>"])
        attrs[texts["</s>"]] = _ATTR_NORMAL


def _strip_attrs(meta: dict[str, Any], index: dict[str, int], attrs: np.ndarray) -> None:
    """Whitespace llama.cpp strips beside some special tokens, chosen by the pre-tokenizer,
    architecture or `general.name` as llama.cpp does (:3089-3138): before the mask token of
    jina-v2 / nomic-bert-moe / jina-bert-v3 and modern-bert; after Phi-3's special tokens, except
    <unk>, <s> and <|endoftext|>."""
    name = str(meta.get("general.name", "")).lower()
    pre, arch = str(meta.get("tokenizer.ggml.pre", "")), str(meta.get("general.architecture", ""))
    if any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or \
            any(a in arch for a in ("nomic-bert-moe", "jina-bert-v3")):
        if "<mask>" in index:
            attrs[index["<mask>"]] |= _ATTR_LSTRIP
    elif "phi-3" in name or "phi3" in name:
        attrs[(attrs & (_ATTR_CONTROL | _ATTR_USER_DEFINED | _ATTR_UNKNOWN)) != 0] |= _ATTR_RSTRIP
        if "</s>" in index:
            attrs[index["</s>"]] |= _ATTR_RSTRIP
        for text in ("<unk>", "<s>", "<|endoftext|>"):
            if text in index:
                attrs[index[text]] &= ~_ATTR_RSTRIP
    elif "modern-bert" in name and "[MASK]" in index:
        attrs[index["[MASK]"]] |= _ATTR_LSTRIP


# tokenizer.ggml.model -> llama.cpp's default BOS, EOS and UNK ids (`llama_vocab::impl::load`).
_MODEL_DEFAULTS: dict[str, tuple[int | None, int | None, int | None]] = {
    "llama": (1, 2, 0),              # SPM, :1971-1980
    "gpt2": (11, 11, None),          # BPE, :1993-2037
    "gemma4": (None, None, None),    # BPE with the gemma4 pre-tokenizer, :2110-2152
}
# SPM has no pre-tokenizer; its flags (:2430-2435).
_SPM_RULES = PreRules("DEFAULT", add_bos=True, clean_spaces=False)


def _tokenizer_model(meta: dict[str, Any]) -> str:
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise ModelFormatError("The file has no tokenizer (tokenizer.ggml.model is missing).",
                               "Use a model file that includes its tokenizer.")
    if model not in _MODEL_DEFAULTS:
        raise UnsupportedModelError(
            f"The model's tokenizer type is {model!r}; the workbench supports 'llama' "
            "(SentencePiece), 'gpt2' and 'gemma4' (BPE).",
            "Pick a model with one of these tokenizers (Llama, Mistral, Gemma, Qwen, Phi, ...).")
    return model


def _pre_rules(meta: dict[str, Any], model: str) -> tuple[str, PreRules]:
    """A BPE file's pre-tokenizer: a `gemma4` file's is always gemma4 (:2151), a missing name
    means "default" (:2159-2167), an unknown one is refused, as in llama.cpp."""
    pre = "gemma4" if model == "gemma4" else meta.get("tokenizer.ggml.pre") or "default"
    if pre not in PRE_RULES:
        raise UnsupportedModelError(
            f"The model's pre-tokenizer {pre!r} is not supported; supported: "
            f"{', '.join(sorted(PRE_RULES))}.",
            "Pick a model whose tokenizer the workbench knows, or report the model name.")
    if "tokenizer.ggml.merges" not in meta and pre != "kimi-k2":  # kimi-k2 may lack them, :1999-2008
        raise ModelFormatError("The BPE tokenizer has no merges (tokenizer.ggml.merges).",
                               "Re-convert the model with a current llama.cpp.")
    return pre, PRE_RULES[pre]


def _read_vocab(meta: dict[str, Any]) -> _Vocab:
    """The vocabulary and every rule llama.cpp derives for it (defaults, then the file's keys)."""
    model = _tokenizer_model(meta)
    tokens = _read_tokens(meta)
    n = len(tokens)
    types = _per_token(meta, "tokenizer.ggml.token_type", n, _TYPE_NORMAL, np.int32)
    scores = _per_token(meta, "tokenizer.ggml.scores", n, 0.0, np.float32)
    if model == "llama":
        pre, rules, pre_type, merges = "default", _SPM_RULES, None, []
    else:
        pre, rules = _pre_rules(meta, model)
        pre_type, merges = TYPES[rules.type], _as_list(meta.get("tokenizer.ggml.merges", []))
    bos, eos, unk = _MODEL_DEFAULTS[model]
    bos_id = _token_id(meta, "bos", None if rules.no_bos else bos, n)
    eos_id, unk_id = _token_id(meta, "eos", eos, n), _token_id(meta, "unknown", unk, n)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", rules.add_bos))
    add_bos = add_bos or (pre_type is not None and pre_type.force_bos)
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if add_bos and bos_id is None or add_eos and eos_id is None:
        raise ModelFormatError("The tokenizer must add a BOS/EOS token but the file names none.",
                               "Re-convert the model with a current llama.cpp.")
    attrs, eog = _resolve_attrs(tokens, types, meta, eos_id)
    return _Vocab(
        kind="spm" if model == "llama" else "bpe", pre=pre, tokens=tokens, attrs=attrs,
        scores=scores, merges=merges, bos_id=bos_id, eos_id=eos_id, unk_id=unk_id, eog_ids=eog,
        add_bos=add_bos, add_eos=add_eos,
        add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", model == "llama")),
        clean_spaces=rules.clean_spaces, ignore_merges=rules.ignore_merges,
        escape_whitespaces=rules.escape_whitespaces, pre_type=pre_type)


# ---- the HF pipeline --------------------------------------------------------------------------

def _hf_vocab(tokens: list[str]) -> dict[str, int]:
    """Token text -> id for HF. A token that is not valid UTF-8 (the reader keeps its bytes as
    surrogate escapes) can never come out of valid text, so it gets an unreachable name."""
    def name(i: int, t: str) -> str:
        try:
            t.encode("utf-8")
            return t
        except UnicodeEncodeError:
            return f"[INVALID_UTF8_{i}]"
    return {name(i, t): i for i, t in enumerate(tokens)}


def _spm_merges(hf_vocab: dict[str, int], scores: np.ndarray) -> list[tuple[str, str]]:
    """Every split of every token into two tokens, ranked by the merged token's score.

    llama.cpp's SPM merges any adjacent pair whose concatenation is a token (of any type), best
    score first; ties go to the leftmost pair, which a rank order cannot express, so equal scores
    fall back to token id order.
    """
    pairs: list[tuple[str, str]] = []
    merged: list[int] = []
    for tok, tid in hf_vocab.items():
        for k in range(1, len(tok)):
            left, right = tok[:k], tok[k:]
            if left in hf_vocab and right in hf_vocab:
                pairs.append((left, right))
                merged.append(tid)
    merged_arr = np.asarray(merged, dtype=np.int64)
    order = np.lexsort((merged_arr, -scores[merged_arr].astype(np.float64)))
    return [pairs[i] for i in order]


def _bpe_merges(merges: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The file's merges, split like llama.cpp (at the first space after position 0). Merges
    whose parts or result are not tokens can never yield a token, and HF rejects them."""
    out = []
    for merge in merges:
        pos = merge.find(" ", 1)
        if pos < 0:
            continue
        left, right = merge[:pos], merge[pos + 1:]
        if left in vocab and right in vocab and left + right in vocab:
            out.append((left, right))
    return out


def _added_tokens(vocab: _Vocab, hf_vocab: dict[str, int]) -> list[AddedToken]:
    """llama.cpp's partition list: CONTROL/UNKNOWN (special) and USER_DEFINED tokens."""
    names = {i: t for t, i in hf_vocab.items()}
    partition = _ATTR_CONTROL | _ATTR_USER_DEFINED | _ATTR_UNKNOWN
    return [
        AddedToken(names[i], special=bool(vocab.attrs[i] & (_ATTR_CONTROL | _ATTR_UNKNOWN)),
                   normalized=False, lstrip=bool(vocab.attrs[i] & _ATTR_LSTRIP),
                   rstrip=bool(vocab.attrs[i] & _ATTR_RSTRIP))
        for i in np.flatnonzero(vocab.attrs & partition).tolist()
        if names[i] == vocab.tokens[i]
    ]


def _build_backend(vocab: _Vocab) -> HFTokenizer:
    hf_vocab = _hf_vocab(vocab.tokens)
    if vocab.kind == "spm":
        unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
        backend = HFTokenizer(models.BPE(vocab=hf_vocab, merges=_spm_merges(hf_vocab, vocab.scores),
                                         unk_token=unk, byte_fallback=True))
        steps = [normalizers.Replace(" ", "▁")]
        if vocab.add_space_prefix:
            steps.insert(0, normalizers.Prepend("▁"))
        backend.normalizer = normalizers.Sequence(steps)
    else:
        pre_type = vocab.pre_type
        backend = HFTokenizer(models.BPE(vocab=hf_vocab, merges=_bpe_merges(vocab.merges, hf_vocab),
                                         ignore_merges=vocab.ignore_merges,
                                         byte_fallback=not pre_type.byte_encode))
        if vocab.escape_whitespaces:
            backend.normalizer = normalizers.Replace(" ", "▁")
        steps = [pre_tokenizers.Split(Regex(r), behavior=b) for r, b in pre_type.splits]
        if pre_type.byte_encode:
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    added = _added_tokens(vocab, hf_vocab)
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])
    return backend


# ---- decoding: llama.cpp's token_to_piece / detokenize ----------------------------------------

def _byte_level_decode(text: str) -> bytes:
    """A byte-level token back to bytes (llama.cpp `llama_decode_text`, including its marker for
    characters outside the GPT-2 alphabet)."""
    try:
        return text.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        pass
    out = bytearray()
    for ch in text:
        byte = _UNICODE_TO_BYTE.get(ch)
        if byte is not None:
            out.append(byte)
        else:
            utf8 = ch.encode("utf-8", "surrogateescape")
            out += b"[UNK_BYTE_0x" + utf8.hex().encode() + text.encode("utf-8", "surrogateescape") + b"]"
    return bytes(out)


def _piece(vocab: _Vocab, token_id: int) -> bytes:
    """The bytes llama.cpp renders for a token with `special=True`."""
    attr = int(vocab.attrs[token_id])
    text = vocab.tokens[token_id]
    if attr & (_ATTR_UNKNOWN | _ATTR_CONTROL | _ATTR_USER_DEFINED):
        return text.encode("utf-8", "surrogateescape")
    if attr & _ATTR_NORMAL:
        if vocab.kind == "spm" or vocab.escape_whitespaces:
            return text.replace("▁", " ").encode("utf-8", "surrogateescape")
        return _byte_level_decode(text)
    if attr & _ATTR_BYTE:
        return bytes([int(text[3:5], 16)])
    return b""  # UNUSED / UNDEFINED tokens render as nothing


def _clean_spaces(text: bytes) -> bytes:
    """llama.cpp's three clean-up passes (`clean_up_tokenization_spaces`) in `detokenize`."""
    text = re.sub(rb" (?=[?!.,])", b"", text)
    text = re.sub(rb" ' ", b"'", text)
    return re.sub(rb" (?='(?:[sm]|re|ve))", b"", text)


# ---- the public tokenizer ---------------------------------------------------------------------

class Tokenizer:
    """A GGUF model's tokenizer with llama.cpp's semantics. Build it with `from_metadata`."""

    def __init__(self, vocab: _Vocab, chat_template: str | None):
        self._vocab = vocab
        self._chat_template = chat_template
        self._backend = _build_backend(vocab)
        self._pieces = [_piece(vocab, i) for i in range(len(vocab.tokens))]
        self._hidden = (vocab.attrs & (_ATTR_CONTROL | _ATTR_UNKNOWN)) != 0  # skip_special drops these
        # `encode_special_tokens` is backend state: one encode at a time flips it safely.
        self._lock = threading.Lock()
        self._hash: str | None = None

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """Build from a GGUF metadata dict (key -> Python value, arrays as lists or NumPy)."""
        template = meta.get("tokenizer.chat_template")
        return cls(_read_vocab(meta), template if isinstance(template, str) else None)

    # -- encoding --
    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`, as llama.cpp's `llama_tokenize(text, add_special, parse_special)`.

        add_special: add BOS (and EOS) as the model's `add_bos_token`/`add_eos_token` rules say.
        parse_special: text such as `<start_of_turn>` becomes its control token; otherwise it is
        tokenized as plain text. User-defined tokens are matched either way, as in llama.cpp.
        """
        with self._lock:
            self._backend.encode_special_tokens = not parse_special
            ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special:
            v = self._vocab
            ids = ([v.bos_id] if v.add_bos else []) + ids + ([v.eos_id] if v.add_eos else [])
        return ids

    def encode_batch_with_offsets(self, texts, parse_special: bool = False):
        """[(ids (n,) int32, offsets (n, 2) int64 character [start, end))] per text, tokenized as
        `encode(text, add_special=False, parse_special=...)`, in one parallel batch (the data
        pipeline maps rendered character spans to tokens with these offsets)."""
        with self._lock:
            self._backend.encode_special_tokens = not parse_special
            encodings = self._backend.encode_batch(list(texts), add_special_tokens=False)
        out = []
        for enc in encodings:
            ids = np.array(enc.ids, dtype=np.int32)
            flat = np.fromiter(chain.from_iterable(enc.offsets), np.int64, count=2 * len(ids))
            offsets = flat.reshape(len(ids), 2)
            out.append((ids, offsets))
        return out

    # -- decoding --
    def decode(self, ids, skip_special: bool = False) -> str:
        """Text of `ids`, as llama.cpp's `llama_detokenize(remove_special=skip_special,
        unparse_special=not skip_special)`: with skip_special, control tokens render as nothing
        and an added leading BOS / trailing EOS is dropped. Invalid UTF-8 becomes U+FFFD."""
        ids = [int(i) for i in ids]
        v = self._vocab
        if ids:
            self._check_ids(min(ids), max(ids))
        remove_space = v.add_space_prefix
        if skip_special and v.add_bos and ids and ids[0] == v.bos_id:
            remove_space = False
            ids = ids[1:]
        if skip_special and v.add_eos and ids and ids[-1] == v.eos_id:
            ids = ids[:-1]
        parts = []
        for i in ids:
            piece = b"" if skip_special and self._hidden[i] else self._pieces[i]
            if remove_space and piece.startswith(b" "):
                piece = piece[1:]
            remove_space = False
            parts.append(piece)
        text = b"".join(parts)
        if v.clean_spaces:
            text = _clean_spaces(text)
        return text.decode("utf-8", errors="replace")

    def token_to_piece(self, token_id: int) -> str:
        """One token's text, special tokens included; a lone byte of a multi-byte character
        comes out as U+FFFD (decode the whole sequence to join such bytes)."""
        self._check_ids(token_id)
        return self._pieces[token_id].decode("utf-8", errors="replace")

    def _check_ids(self, *ids: int) -> None:
        if not all(0 <= i < len(self._pieces) for i in ids):
            raise ValueError(f"token ids must be in [0, {len(self._pieces)}), got {ids}")

    # -- properties --
    @property
    def bos_id(self) -> int | None:
        return self._vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self._vocab.eos_id

    @property
    def eot_ids(self) -> frozenset[int]:
        """llama.cpp's end-of-generation set: EOS, EOT, EOM, and tokens such as `<end_of_turn>`,
        `<|im_end|>`, `<|eot_id|>`, `<|endoftext|>` found by text (`llama_vocab_is_eog`)."""
        return self._vocab.eog_ids

    @property
    def vocab_size(self) -> int:
        return len(self._vocab.tokens)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def add_bos(self) -> bool:
        return self._vocab.add_bos

    @property
    def add_eos(self) -> bool:
        return self._vocab.add_eos

    def hash(self) -> str:
        """SHA-256 hex digest of everything that decides token ids, for caching tokenized data.

        Covers the vocabulary, scores, merges, attributes after llama.cpp's overrides, special
        ids and flags, the pre-tokenizer's splits, and an implementation version bumped whenever
        this module would tokenize differently. The chat template is not included.
        """
        if self._hash is None:
            v = self._vocab
            h = hashlib.sha256()
            rules = {
                "impl": _IMPLEMENTATION_VERSION, "kind": v.kind, "pre": v.pre,
                "pre_type": dataclasses.asdict(v.pre_type) if v.pre_type else None,
                "bos": v.bos_id, "eos": v.eos_id, "unk": v.unk_id,
                "eog": sorted(v.eog_ids), "add_bos": v.add_bos, "add_eos": v.add_eos,
                "add_space_prefix": v.add_space_prefix, "clean_spaces": v.clean_spaces,
                "ignore_merges": v.ignore_merges, "escape_whitespaces": v.escape_whitespaces,
            }
            h.update(json.dumps(rules, sort_keys=True).encode())
            for block in (v.tokens, v.merges):
                h.update(len(block).to_bytes(8, "little"))
                h.update("\0".join(block).encode("utf-8", "surrogateescape"))
            h.update(v.attrs.astype("<i4").tobytes())
            h.update(v.scores.astype("<f4").tobytes())
            self._hash = h.hexdigest()
        return self._hash


def load_tokenizer(path) -> Tokenizer:
    """The tokenizer of any GGUF file, vocab-only files included."""
    gguf_file = read_gguf(path)
    try:
        return Tokenizer.from_metadata(gguf_file.metadata)
    finally:
        gguf_file.close()
