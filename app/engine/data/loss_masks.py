"""Examples -> token ids and loss masks, with the model's tokenizer and chat template.

The mask says which tokens are training *targets*: ``trained[j]`` is True when the model is
taught to produce token j (the windows turn it into label ``ids[j]`` at position ``j - 1``).

* Text and completion rows: the segments are joined and tokenized as one text (special-token
  texts stay plain text unless `parse_special`), and a token is trained when any character it
  covers belongs to a trained segment. A token that straddles the prompt/completion boundary is
  therefore trained: it is what the model has to write after the prompt.
* Chat rows: the conversation is rendered with `render_chat_spans` (the model's template, its BOS
  and EOS texts, and its end-of-generation pieces as stop texts), the rendered text is tokenized
  with special tokens parsed, and the trained characters are each trained assistant message's
  content plus its end-of-turn marker (e.g. ``<|im_end|>``); role headers, the other messages
  and the text between turns are not trained. Character spans map onto tokens through the
  tokenizer's offsets (a token is trained when it overlaps a span), never by guessing.

BOS and EOS, the same for every format:

* BOS is put first when the tokenizer adds one (``add_bos``) and the text did not already start
  with it (templates that write ``{{ bos_token }}`` do). It is never a target.
* EOS is appended, as a trained target, after text and completion rows when the tokenizer has
  an EOS token and the text does not already end with it (`add_eos=False` turns this off, e.g.
  for continued pre-training on fragments). After a chat it is appended only when the template
  leaves the final assistant message open (no end-of-turn marker after it), again unless
  `add_eos=False`; otherwise the marker the template wrote is the end of the turn. A tokenizer whose ``add_eos`` flag is set
  always gets its EOS at the end, as llama.cpp tokenizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from app.engine.text.chat_template import render_chat_spans
from app.engine.errors import ConfigError
from app.engine.data.formats import NOTHING_TO_TRAIN, TEMPLATE, Example, Rejection
from app.engine.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class Encoded:
    """An example as tokens: ids (n,) int32 and trained (n,) bool (token j is a target).
    plain_special: the text of a special token (e.g. "<|im_end|>") found in a text/completion
    row, where it stayed plain text because special tokens are not parsed; else None."""

    example: Example
    ids: np.ndarray
    trained: np.ndarray
    plain_special: str | None = None


@dataclass(frozen=True)
class _Prepared:
    """An example ready for the tokenizer: its text, trained character spans, parse mode and
    whether an EOS target must follow."""

    example: Example
    text: str
    spans: tuple[tuple[int, int], ...]
    parse_special: bool
    eos_after: bool
    plain_special: str | None = None


def encode_with_offsets(tokenizer: Tokenizer, texts: Sequence[str],
                        parse_special: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids (n,) int32, offsets (n, 2) int64 character [start, end)) of each text, as
    `tokenizer.encode(text, add_special=False, parse_special=...)` tokenizes it."""
    return tokenizer.encode_batch_with_offsets(texts, parse_special=parse_special)


def trained_tokens(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """(n,) bool: the tokens whose character range [start, end) overlaps a span; a zero-width
    token counts when its position lies inside one."""
    start, end = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(offsets), dtype=bool)
    for a, b in spans:
        if b > a:
            mask |= (start < b) & ((end > a) | ((end == start) & (start >= a)))
    return mask


class Encoder:
    """Turns examples into `Encoded` (or a `Rejection` when the template fails on a row)."""

    def __init__(self, tokenizer: Tokenizer, *, chat_template: str | None = None,
                 parse_special: bool = False, add_eos: bool = True):
        self.tokenizer = tokenizer
        self.template = chat_template if chat_template is not None else tokenizer.chat_template
        self.parse_special = parse_special
        self.add_eos = add_eos
        tok = tokenizer
        self.bos_text = tok.token_to_piece(tok.bos_id) if tok.bos_id is not None else ""
        self.eos_text = tok.token_to_piece(tok.eos_id) if tok.eos_id is not None else ""
        self.stop_texts = frozenset({tok.token_to_piece(i) for i in tok.eot_ids} |
                                    ({self.eos_text} if self.eos_text else set()))
        self.marker_texts = tuple(t for t in self.stop_texts | {self.bos_text} if len(t) > 2)

    # -- one example -> text and spans --
    def _prepare(self, example: Example) -> _Prepared | Rejection:
        if example.segments is not None:
            spans, pos = [], 0
            for text, trained in example.segments:
                if trained:
                    spans.append((pos, pos + len(text)))
                pos += len(text)
            text = "".join(t for t, _ in example.segments)
            plain = None if self.parse_special else next(
                (m for m in self.marker_texts if m in text), None)
            return _Prepared(example, text, tuple(spans), self.parse_special,
                             self.add_eos and example.segments[-1][1], plain)
        try:
            chat = render_chat_spans(self.template, list(example.messages),
                                     bos_token=self.bos_text, eos_token=self.eos_text,
                                     stop_texts=self.stop_texts, **dict(example.extra))
        except ConfigError as exc:
            return Rejection(example.line, TEMPLATE, exc.message)
        picked = set(example.trained)
        spans = tuple((s.content[0], s.end_marker[1]) for s in chat.assistant_spans
                      if s.message_index in picked)
        last = chat.assistant_spans[-1] if chat.assistant_spans else None
        open_end = (last is not None and last.message_index == len(example.messages) - 1
                    and last.message_index in picked and last.end_marker[0] == last.end_marker[1])
        return _Prepared(example, chat.text, spans, True, open_end and self.add_eos)

    # -- batches --
    def prepare(self, items: Sequence[Example | Rejection]) -> list[_Prepared | Rejection]:
        """Render a block (Python: templates); rejections pass through."""
        return [x if isinstance(x, Rejection) else self._prepare(x) for x in items]

    def tokenize(self, prepared: Sequence[_Prepared | Rejection]) -> list[Encoded | Rejection]:
        """Tokenize a prepared block (one parallel batch per parse mode; the tokenizer releases
        the GIL, so this can run in a thread while the next block is rendered)."""
        out: list[Encoded | Rejection] = list(prepared)
        for parse in (False, True):
            idx = [i for i, p in enumerate(prepared) if isinstance(p, _Prepared)
                   and p.parse_special == parse]
            if not idx:
                continue
            results = encode_with_offsets(self.tokenizer, [prepared[i].text for i in idx], parse)
            for i, (ids, offsets) in zip(idx, results):
                out[i] = self._finish(prepared[i], ids, offsets)
        return out

    def encode(self, items: Sequence[Example | Rejection]) -> list[Encoded | Rejection]:
        """Examples -> Encoded rows (or Rejections), in order."""
        return self.tokenize(self.prepare(items))

    def _finish(self, p: _Prepared, ids: np.ndarray, offsets: np.ndarray) -> Encoded | Rejection:
        tok = self.tokenizer
        trained = trained_tokens(offsets, p.spans)
        if tok.add_bos and tok.bos_id is not None and (len(ids) == 0 or ids[0] != tok.bos_id):
            ids = np.concatenate([np.array([tok.bos_id], np.int32), ids])
            trained = np.concatenate([[False], trained])
        eos = tok.eos_id
        if eos is not None and (p.eos_after or tok.add_eos) and (len(ids) == 0 or ids[-1] != eos):
            ids = np.concatenate([ids, np.array([eos], np.int32)])
            trained = np.concatenate([trained, [p.eos_after or bool(trained[-1:].any())]])
        if len(ids) < 2 or not trained[1:].any():
            return Rejection(p.example.line, NOTHING_TO_TRAIN,
                             "no token to train on after tokenizing" if len(ids) >= 2 else
                             "too short: a single token, nothing to predict")
        return Encoded(p.example, ids, trained, p.plain_special)
