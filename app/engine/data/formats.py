"""JSONL dataset rows -> examples: reading line by line, detecting the format, rejecting bad rows.

A dataset is a file with one JSON object per line. Five row formats are understood:

* ``text``:       ``{"text": ...}``; loss on every token.
* ``completion``: ``{"prompt": ..., "completion": ...}`` (or ``"response"``/``"output"`` instead
  of ``"completion"``); loss on the completion only. The two strings are joined as they are (no
  separator is added). When both are lists of chat messages (TRL's conversational form), the row
  is a chat whose completion messages are trained.
* ``chat``:       ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ...}]}``
  (OpenAI chat); loss on the assistant turns. A message may carry ``"weight": 0`` (or
  ``"train": false``) to keep that turn out of the loss; a row may carry ``"tools"``, which the
  chat template receives. ``content`` may also be a list of ``{"type": "text", "text": ...}`` parts.
* ``alpaca``:     ``{"instruction", "input"?, "output", "system"?}`` -> system?, user, assistant.
* ``sharegpt``:   ``{"conversations": [{"from", "value"}], "system"?}`` with ``from`` one of
  human/user, gpt/assistant/model/chatgpt/bing/bard, system, tool/function/observation (and
  function_call, an assistant turn).

Any row may carry a reward weight (``"weight"``, else ``"reward"``; see `app.engine.data.row_weights`) and an
``"id"`` (a string or an integer) that a separate weights file can refer to.

The format is detected from the first rows (the most common one among them) unless the user
chooses it; a row in another format is rejected as such ("missing key "messages" (the row looks
like the text format; the dataset is chat)").

Only role and content of a message reach the template: assistant tool calls without text
content are not supported yet (such rows are rejected with the reason), and other keys of a
message are ignored.

The reader never holds more than one line in memory and never raises on a bad row: each bad row
becomes a `Rejection` with its 1-based line number, a stable ``kind`` and a plain reason. Blank
lines are ignored; a UTF-8 byte-order mark on the first line and CRLF line ends are accepted.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from app.engine.errors import DatasetError
from app.engine.runtime.files import loads_json
from app.engine.runtime.inputs import NEVER, open_input

FORMATS = ("text", "completion", "chat", "alpaca", "sharegpt")
ROLES = ("system", "user", "assistant", "tool")
COMPLETION_KEYS = ("completion", "response", "output")
SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "model": "assistant", "chatgpt": "assistant",
    "bing": "assistant", "bard": "assistant", "function_call": "assistant",
    "system": "system",
    "tool": "tool", "function": "tool", "observation": "tool",
}
MAX_LINE_BYTES = 64 << 20      # a longer line is rejected without being read into memory
DETECT_ROWS = 200              # rows looked at to detect the format
DETECT_LINES = 5000            # ... within at most this many lines
MAX_KEPT_REJECTIONS = 10_000   # rejected rows kept with their reasons (all are counted)

# Rejection kinds (stable tags for the GUI and --json).
NOT_UTF8 = "not_utf8"
INVALID_JSON = "invalid_json"
NOT_OBJECT = "not_object"
MISSING_KEY = "missing_key"
WRONG_TYPE = "wrong_type"
EMPTY = "empty"
UNKNOWN_ROLE = "unknown_role"
NO_ASSISTANT = "no_assistant"
TEMPLATE = "template"
BAD_WEIGHT = "bad_weight"
NEGATIVE_WEIGHT = "negative_weight"
NO_WEIGHT = "no_weight"
LINE_TOO_LONG = "line_too_long"
NOTHING_TO_TRAIN = "nothing_to_train"


@dataclass(frozen=True)
class Rejection:
    """A row that is not used, and why. `line` is 1-based."""

    line: int
    kind: str
    reason: str

    def to_dict(self) -> dict:
        return {"line": self.line, "kind": self.kind, "reason": self.reason}

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


class RejectionLog:
    """Rejections of a file: the first `limit` in full (line, kind, reason), all counted by kind,
    so a file of a million bad rows costs a few MB, not gigabytes."""

    def __init__(self, limit: int | None = None):
        self.limit = MAX_KEPT_REJECTIONS if limit is None else limit
        self.kept: list[Rejection] = []
        self.kinds: Counter[str] = Counter()

    def add(self, rejection: Rejection) -> None:
        self.kinds[rejection.kind] += 1
        if len(self.kept) < self.limit:
            self.kept.append(rejection)

    def extend(self, rejections) -> RejectionLog:
        for r in rejections:
            self.add(r)
        self.kept.sort(key=lambda r: r.line)
        return self

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    def summary(self, listed: int = 5) -> str:
        """'skipped 3 rows: line 4 (missing key "text"), line 9 (...), ...': the first `listed`."""
        lines = ", ".join(f"line {r.line} ({r.reason})" for r in self.kept[:listed])
        more = f", and {self.total - listed} more" if self.total > listed else ""
        return f"skipped {self.total} row{'s' * (self.total != 1)}: {lines}{more}"


@dataclass(frozen=True)
class Example:
    """One accepted row, in one of two shapes.

    segments: ((text, trained), ...) joined as they are (text and completion rows), or None.
    messages: chat messages ({"role", "content"}), or None; `trained` says which of them are in
    the loss (assistant messages only). extra: template variables (e.g. "tools").
    row: 0-based index among the file's non-blank lines (a plain weights file is aligned on it).
    weight: the row's own reward weight, or None. row_id: its "id" as a string, or None.
    digest: a 64-bit hash of the row's text (the train/validation split is decided by it).
    """

    line: int
    row: int
    segments: tuple[tuple[str, bool], ...] | None = None
    messages: tuple[dict, ...] | None = None
    trained: tuple[int, ...] = ()
    extra: tuple[tuple[str, Any], ...] = ()
    weight: float | None = None
    row_id: str | None = None
    digest: int = 0


class _Bad(Exception):
    """A row problem, raised inside the converters and turned into a Rejection."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind, self.reason = kind, reason


# ---- lines ----------------------------------------------------------------------------------------

def iter_lines(path, max_line_bytes: int | None = None,
               progress: Callable[[int], None] | None = None, *, what: str = "dataset",
               stop: Callable[[], None] = NEVER) -> Iterator[tuple[int, bytes | None]]:
    """(line number, the line's bytes without its line end) for every non-blank line; None for a
    line longer than `max_line_bytes` (default MAX_LINE_BYTES; its bytes are skipped, not kept).
    The file must be a regular file (`open_input`: `what` names it in the error). `progress(bytes
    read)` is called every few MB; `stop()` (a `StopCheck`) at every line and every MB of a long
    line, so a stop request is heard within its interval whatever the lines look like."""
    max_line_bytes = max_line_bytes or MAX_LINE_BYTES
    with open_input(path, what) as f:
        number, done, reported = 0, 0, 0
        while True:
            stop()
            raw = f.readline(max_line_bytes + 1)
            if not raw:
                break
            number += 1
            done += len(raw)
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):   # skip the rest of the long line
                    stop()
                    raw = f.readline(1 << 20)
                    done += len(raw)
                yield number, None
                continue
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            raw = raw.rstrip(b"\r\n")
            if raw.strip():
                yield number, raw
            if progress is not None and done - reported >= 4 << 20:
                progress(done)
                reported = done
        if progress is not None:
            progress(done)


def as_float(value: int | float) -> float:
    """A JSON number as a float; an integer beyond the float range becomes +-inf."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def parse_line(line: int, raw: bytes | None) -> dict | Rejection:
    """The JSON object on a line, or why there is none."""
    if raw is None:
        return Rejection(line, LINE_TOO_LONG, f"line longer than {MAX_LINE_BYTES >> 20} MB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Rejection(line, NOT_UTF8, f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at "
                                         f"column {exc.start + 1})")
    try:
        obj = loads_json(text)
    except json.JSONDecodeError as exc:
        return Rejection(line, INVALID_JSON, f"invalid JSON: {exc.msg} (column {exc.colno})")
    except ValueError as exc:
        return Rejection(line, INVALID_JSON, f"invalid JSON: {exc}")
    if not isinstance(obj, dict):
        return Rejection(line, NOT_OBJECT, f"expected a JSON object, got {_type_name(obj)}")
    return obj


def _type_name(value) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


# ---- formats --------------------------------------------------------------------------------------

def row_format(obj: dict) -> str | None:
    """The format a row looks like, by its keys (None: none of them)."""
    if "messages" in obj:
        return "chat"
    if "conversations" in obj:
        return "sharegpt"
    if "instruction" in obj:
        return "alpaca"
    if "prompt" in obj and any(k in obj for k in COMPLETION_KEYS):
        return "completion"
    if "text" in obj:
        return "text"
    return None


def detect_format(path, stop: Callable[[], None] = NEVER) -> str:
    """The most common row format among the first rows (ties: chat, sharegpt, alpaca,
    completion, text). Raises DatasetError when no row there is in a known format."""
    counts: Counter[str] = Counter()
    objects, keys = 0, Counter()
    for line, raw in iter_lines(path, stop=stop):
        obj = parse_line(line, raw)
        if isinstance(obj, dict):
            objects += 1
            keys.update(obj.keys())
            fmt = row_format(obj)
            if fmt is not None:
                counts[fmt] += 1
            if objects >= DETECT_ROWS:
                break
        if line >= DETECT_LINES:
            break
    if counts:
        best = max(counts.values())
        return next(f for f in ("chat", "sharegpt", "alpaca", "completion", "text")
                    if counts[f] == best)
    name = os.path.basename(os.fspath(path))
    if not objects:
        raise DatasetError(f"{name} has no JSON object in its first lines: it is not a JSONL dataset.",
                           "Each line must be one JSON object, e.g. {\"text\": \"...\"}.")
    seen = ", ".join(k for k, _ in keys.most_common(6))
    raise DatasetError(
        f"Cannot tell the format of {name}: its rows have the keys {seen}.",
        'Use "text", "prompt"+"completion", "messages", "instruction"+"output" or '
        '"conversations" rows, or choose the format explicitly.')


def _string(obj: dict, key: str, where: str = "", required: bool = True) -> str | None:
    if key not in obj or obj[key] is None:
        if required:
            raise _Bad(MISSING_KEY, f'missing key "{key}"{where}')
        return None
    value = obj[key]
    if not isinstance(value, str):
        raise _Bad(WRONG_TYPE, f'"{key}"{where} must be a string, got {_type_name(value)}')
    _check_unicode(value, key, where)
    return value


def _check_unicode(value: str, key: str, where: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _Bad(NOT_UTF8, f'"{key}"{where} contains an unpaired UTF-16 surrogate '
                             "(a \\ud800-\\udfff escape)") from None


def _content(message: dict, where: str) -> str:
    """A message's content: a string, or the concatenated text of OpenAI content parts."""
    if "content" not in message:
        raise _Bad(MISSING_KEY, f'missing key "content"{where}')
    content = message["content"]
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise _Bad(WRONG_TYPE, f'"content"{where} has a part that is not '
                                       '{"type": "text", "text": ...}')
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise _Bad(WRONG_TYPE, f'"content"{where} must be a string, got {_type_name(content)}')
    _check_unicode(content, "content", where)
    return content


def _message_trained(message: dict, where: str) -> bool:
    for key in ("weight", "train"):
        if key in message:
            value = message[key]
            if key == "train" and isinstance(value, bool):
                return value
            if key == "weight" and not isinstance(value, bool) and value in (0, 1):
                return bool(value)
            raise _Bad(WRONG_TYPE, f'"{key}"{where} must be ' +
                       ("true or false" if key == "train" else "0 or 1 (use the row's "
                        '"weight" for reward weights)'))
    return True


def _chat(messages: list[dict], trained: list[bool], chat_loss: str, extra: tuple = ()) -> dict:
    """Example fields of a chat: the messages and the indices of the trained assistant ones."""
    picked = [i for i, m in enumerate(messages) if m["role"] == "assistant" and trained[i]]
    if not any(m["role"] == "assistant" for m in messages):
        raise _Bad(NO_ASSISTANT, "no assistant message to train on")
    if chat_loss == "last":
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        picked = [i for i in picked if i == last]
    if not picked:
        raise _Bad(NOTHING_TO_TRAIN, "every assistant message is excluded from the loss")
    for i in picked:
        if not messages[i]["content"].strip():
            raise _Bad(EMPTY, f"message {i + 1} (assistant) is empty")
    return {"messages": tuple(messages), "trained": tuple(picked), "extra": extra}


def _openai_messages(value, key: str) -> tuple[list[dict], list[bool]]:
    if not isinstance(value, list):
        raise _Bad(WRONG_TYPE, f'"{key}" must be a list of messages, got {_type_name(value)}')
    if not value:
        raise _Bad(EMPTY, f'"{key}" is empty')
    messages, trained = [], []
    for i, m in enumerate(value):
        where = f" in message {i + 1}"
        if not isinstance(m, dict):
            raise _Bad(WRONG_TYPE, f"message {i + 1} must be an object, got {_type_name(m)}")
        role = m.get("role")
        if role is None:
            raise _Bad(MISSING_KEY, f'missing key "role"{where}')
        if not isinstance(role, str):
            raise _Bad(WRONG_TYPE, f'"role"{where} must be a string, got {_type_name(role)}')
        if role not in ROLES:
            raise _Bad(UNKNOWN_ROLE, f'unknown role "{role}"{where} (expected '
                                     + ", ".join(ROLES) + ")")
        messages.append({"role": role, "content": _content(m, where)})
        trained.append(_message_trained(m, where))
    return messages, trained


def _from_chat(obj: dict, chat_loss: str) -> dict:
    messages, trained = _openai_messages(obj["messages"], "messages")
    extra = ()
    tools = obj.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _Bad(WRONG_TYPE, f'"tools" must be a list, got {_type_name(tools)}')
        extra = (("tools", tools),)
    return _chat(messages, trained, chat_loss, extra)


def _from_sharegpt(obj: dict, chat_loss: str) -> dict:
    return _chat(*sharegpt_messages(obj), chat_loss)


def sharegpt_messages(obj: dict) -> tuple[list[dict], list[bool]]:
    """(messages, trained) of a ShareGPT row's "system" and "conversations" (SFT rows, and
    the prompt of LLaMA-Factory's preference rows). Raises _Bad."""
    turns = obj["conversations"]
    if not isinstance(turns, list):
        raise _Bad(WRONG_TYPE, f'"conversations" must be a list, got {_type_name(turns)}')
    if not turns:
        raise _Bad(EMPTY, '"conversations" is empty')
    messages, trained = [], []
    system = _string(obj, "system", required=False)
    if system:
        messages.append({"role": "system", "content": system})
        trained.append(True)
    for i, turn in enumerate(turns):
        where = f" in turn {i + 1}"
        if not isinstance(turn, dict):
            raise _Bad(WRONG_TYPE, f"turn {i + 1} must be an object, got {_type_name(turn)}")
        source = _string(turn, "from", where)
        role = SHAREGPT_ROLES.get(source.lower())
        if role is None:
            raise _Bad(UNKNOWN_ROLE, f'unknown role "{source}"{where} (expected human, gpt, '
                                     "system or tool)")
        messages.append({"role": role, "content": _string(turn, "value", where)})
        trained.append(_message_trained(turn, where))
    return messages, trained


def _from_alpaca(obj: dict, chat_loss: str) -> dict:
    instruction = _string(obj, "instruction")
    extra_input = _string(obj, "input", required=False)
    output = _string(obj, "output")
    if not instruction.strip():
        raise _Bad(EMPTY, '"instruction" is empty')
    if not output.strip():
        raise _Bad(EMPTY, '"output" is empty')
    system = _string(obj, "system", required=False)
    user = f"{instruction}\n\n{extra_input}" if extra_input and extra_input.strip() else instruction
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}, {"role": "assistant", "content": output}]
    return _chat(messages, [True] * len(messages), chat_loss)


def _from_completion(obj: dict, chat_loss: str, as_chat: bool) -> dict:
    key = next((k for k in COMPLETION_KEYS if k in obj), None)
    if "prompt" not in obj or key is None:
        missing = "prompt" if "prompt" not in obj else "completion"
        raise _Bad(MISSING_KEY, f'missing key "{missing}"')
    prompt, completion = obj["prompt"], obj[key]
    if isinstance(prompt, list) and isinstance(completion, list):   # conversational
        first, _ = _openai_messages(prompt, "prompt")
        second, trained = _openai_messages(completion, key)
        messages = first + second
        return _chat(messages, [False] * len(first) + trained, chat_loss)
    prompt, completion = _string(obj, "prompt"), _string(obj, key)
    if not completion.strip():
        raise _Bad(EMPTY, f'"{key}" is empty')
    if as_chat:
        system = _string(obj, "system", required=False)
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        return _chat(messages, [True] * len(messages), chat_loss)
    return {"segments": ((prompt, False), (completion, True)) if prompt else ((completion, True),)}


def _from_text(obj: dict, chat_loss: str) -> dict:
    text = _string(obj, "text")
    if not text.strip():
        raise _Bad(EMPTY, '"text" is empty')
    return {"segments": ((text, True),)}


def _weight(obj: dict, weight_field: str | None) -> float | None:
    key = weight_field or ("weight" if "weight" in obj else "reward")
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Bad(BAD_WEIGHT, f'"{key}" must be a number, got {_type_name(value)}')
    value = as_float(value)
    if not math.isfinite(value):
        raise _Bad(BAD_WEIGHT, f'"{key}" must be a finite number, got {value}')
    return value


def _row_id(obj: dict) -> str | None:
    value = obj.get("id")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None
    return str(value)


_REQUIRED = {"text": "text", "chat": "messages", "sharegpt": "conversations", "alpaca": "instruction"}
_CONVERTERS = {"text": _from_text, "chat": _from_chat, "sharegpt": _from_sharegpt, "alpaca": _from_alpaca}


def to_example(obj: dict, line: int, row: int, raw: bytes, fmt: str, *,
               chat_loss: str = "assistant", completion_as_chat: bool = False,
               weight_field: str | None = None) -> Example | Rejection:
    """Convert one parsed row in the dataset's format `fmt`."""
    try:
        if fmt == "completion":
            body = _from_completion(obj, chat_loss, completion_as_chat)
        else:
            key = _REQUIRED[fmt]
            if key not in obj:
                raise _Bad(MISSING_KEY, f'missing key "{key}"')
            body = _CONVERTERS[fmt](obj, chat_loss)
        weight = _weight(obj, weight_field)
    except _Bad as bad:
        reason = bad.reason
        looks = row_format(obj)
        if bad.kind == MISSING_KEY and looks is not None and looks != fmt:
            reason += f" (the row looks like the {looks} format; the dataset is {fmt})"
        return Rejection(line, bad.kind, reason)
    digest = int.from_bytes(hashlib.blake2b(raw.strip(), digest_size=8).digest(), "little")
    return Example(line=line, row=row, weight=weight, row_id=_row_id(obj), digest=digest, **body)


def read_examples(path, fmt: str, *, chat_loss: str = "assistant", completion_as_chat: bool = False,
                  weight_field: str | None = None,
                  progress: Callable[[int], None] | None = None,
                  stop: Callable[[], None] = NEVER) -> Iterator[Example | Rejection]:
    """Every non-blank line of a JSONL file as an Example or a Rejection, streaming (`stop`:
    see `iter_lines`)."""
    for row, (line, raw) in enumerate(iter_lines(path, progress=progress, stop=stop)):
        obj = parse_line(line, raw)
        if isinstance(obj, Rejection):
            yield obj
            continue
        yield to_example(obj, line, row, raw, fmt, chat_loss=chat_loss,
                         completion_as_chat=completion_as_chat, weight_field=weight_field)
