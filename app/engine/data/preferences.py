"""Preference data: chosen/rejected pairs (DPO, IPO, ORPO, SimPO) and unpaired rows (KTO).

Row forms (detected per row; a file is "preference" when most of its first rows have
``chosen`` and ``rejected``, "kto" when they have ``completion`` and a boolean ``label``):

* TRL, explicit prompt: ``{"prompt", "chosen", "rejected"}``, each a string, or the prompt a
  list of messages and chosen/rejected lists of assistant messages (a string beside a message
  list is one assistant message, or the prompt one user message).
* TRL, implicit prompt: ``{"chosen", "rejected"}`` without a prompt, both whole conversations
  (message lists) sharing their first messages: the shared messages are the prompt. Two strings
  share their longest common prefix, cut as TRL's ``extract_prompt`` cuts it (a space that
  starts the difference goes to the completions).
* LLaMA-Factory: ``{"instruction", "input"?, "system"?, "chosen", "rejected"}`` (alpaca, chosen
  and rejected strings) and ``{"conversations", "system"?, "chosen", "rejected"}`` (ShareGPT,
  chosen and rejected ``{"from": "gpt", "value": ...}`` objects or strings).
* KTO, unpaired: ``{"prompt", "completion", "label": true|false}`` (strings or message lists as
  above); true is a desirable completion. A KTO run also takes a paired file: each pair becomes
  a desirable and an undesirable row (TRL's ``unpair_preference_dataset``).

Each completion becomes an SFT example (`app.engine.data.formats.Example`) of the prompt plus
that completion, and is tokenized by the SFT encoder (`app.engine.data.loss_masks.Encoder`): the
same chat template, BOS/EOS rules and loss mask, so only the completion's tokens (with its
end-of-turn marker) are counted in its log-probability. String rows are joined as they are
(``completion_as_chat``: a user and an assistant turn), as SFT's completion rows are.

Rejected rows (each with its 1-based line and reason, never an exception): bad JSON, missing or
mistyped keys, an empty chosen or rejected completion, chosen identical to rejected (nothing to
prefer), a prompt with no completion after it, and a pair whose longer sequence does not fit
the context (context + 1 tokens: a pair is never cut, as a cut completion would not be the one
the user rated). The tokenized pairs are kept in memory (a few numbers per token); the SFT
token cache is not used.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from app.engine.data.dataset import DataConfig, split_rows
from app.engine.data.formats import (EMPTY, MISSING_KEY, SHAREGPT_ROLES, WRONG_TYPE, Example,
                                     Rejection, RejectionLog, _Bad, _openai_messages, _string,
                                     _type_name, iter_lines, parse_line, sharegpt_messages)
from app.engine.data.lint import _example, lint_tokenizer   # the SFT report's pieces
from app.engine.data.loss_masks import Encoded, Encoder
from app.engine.errors import DatasetError
from app.engine.runtime.inputs import NEVER
from app.engine.text.tokenizer import Tokenizer

PREFERENCE, KTO = "preference", "kto"
PREFERENCE_FORMATS = (PREFERENCE, KTO)
IDENTICAL = "identical"
TOO_LONG = "too_long"
DETECT_ROWS = 200


# ---- rows -> (prompt, completions) --------------------------------------------------------------

def row_preference_format(obj: dict) -> str | None:
    """"preference", "kto" or None by a row's keys."""
    if "chosen" in obj and "rejected" in obj:
        return PREFERENCE
    if "completion" in obj and isinstance(obj.get("label"), bool):
        return KTO
    return None


def detect_preference_format(path, stop: Callable[[], None] = NEVER) -> str | None:
    """"preference" or "kto" when most of the file's first object rows are such rows, else
    None (an SFT dataset, or no dataset at all: the SFT reader says which)."""
    counts: Counter = Counter()
    objects = 0
    for line, raw in iter_lines(path, stop=stop):
        obj = parse_line(line, raw)
        if isinstance(obj, dict):
            objects += 1
            counts[row_preference_format(obj)] += 1
            if objects >= DETECT_ROWS:
                break
    if not objects:
        return None
    fmt, n = max(counts.items(), key=lambda kv: (kv[1], kv[0] is not None))
    return fmt if n * 2 > objects else None


def _messages_or_text(value, key: str):
    """A string stays a string; a list is checked as OpenAI messages; a single message object
    (LLaMA-Factory's ShareGPT completions) becomes a one-message list."""
    if isinstance(value, str):
        if not value.strip():
            raise _Bad(EMPTY, f'"{key}" is empty')
        return value
    if isinstance(value, dict) and "from" in value:
        source = _string(value, "from", f' in "{key}"')
        mapped = SHAREGPT_ROLES.get(source.lower())
        if mapped != "assistant":
            raise _Bad(WRONG_TYPE, f'"{key}" must come from the assistant (gpt), not "{source}"')
        text = _string(value, "value", f' in "{key}"')
        if not text.strip():
            raise _Bad(EMPTY, f'"{key}" is empty')
        return [{"role": "assistant", "content": text}]
    if isinstance(value, list):
        return _openai_messages(value, key)[0]
    if value is None:
        raise _Bad(MISSING_KEY, f'missing key "{key}"')
    raise _Bad(WRONG_TYPE, f'"{key}" must be a string or a list of messages, got '
                           f"{_type_name(value)}")


def _as_messages(value, role: str) -> list[dict]:
    return value if isinstance(value, list) else [{"role": role, "content": value}]


def _check_completion(messages: list[dict], key: str) -> None:
    if not messages or any(m["role"] != "assistant" for m in messages):
        raise _Bad(WRONG_TYPE, f'"{key}" must be assistant messages only')
    if not any(m["content"].strip() for m in messages):
        raise _Bad(EMPTY, f'"{key}" is empty')


def _implicit_prompt_text(chosen: str, rejected: str) -> tuple[str, str, str]:
    """TRL's extract_prompt for strings: the longest common prefix, minus a final space."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if idx and chosen[idx - 1] == " ":
                idx -= 1
            break
    else:
        idx = min(len(chosen), len(rejected))
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _prompt_of_row(obj: dict):
    """The prompt of a row: a string, a message list, or None (implicit prompt)."""
    if "instruction" in obj:                                    # LLaMA-Factory alpaca
        instruction = _string(obj, "instruction")
        extra = _string(obj, "input", required=False)
        system = _string(obj, "system", required=False)
        user = f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction
        return ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}]
    if "conversations" in obj:                                  # LLaMA-Factory ShareGPT
        return sharegpt_messages(obj)[0]
    if "prompt" in obj:
        return _messages_or_text(obj["prompt"], "prompt")
    return None


def row_completions(obj: dict, fmt: str):
    """(prompt, [completions]) of a row: the prompt a string or a message list (or "" with
    message completions), each completion a string or a list of assistant messages, all of one
    kind. Paired rows give [chosen, rejected], KTO rows [completion]. Raises _Bad."""
    if fmt == KTO:
        keys = ("completion",)
        if not isinstance(obj.get("label"), bool):
            raise _Bad(WRONG_TYPE if "label" in obj else MISSING_KEY,
                       '"label" must be true or false' if "label" in obj
                       else 'missing key "label"')
    else:
        keys = ("chosen", "rejected")
    for k in keys:
        if k not in obj:
            raise _Bad(MISSING_KEY, f'missing key "{k}"')
    prompt = _prompt_of_row(obj)
    outs = [_messages_or_text(obj[k], k) for k in keys]
    if prompt is None:                                          # implicit prompt
        if fmt == KTO:
            raise _Bad(MISSING_KEY, 'missing key "prompt"')
        c, r = outs
        if isinstance(c, str) and isinstance(r, str):
            prompt, c, r = _implicit_prompt_text(c, r)
        elif isinstance(c, list) and isinstance(r, list):
            n = 0
            while n < min(len(c), len(r)) and c[n] == r[n]:
                n += 1
            while n and c[n - 1]["role"] == "assistant":   # the completions start at a reply
                n -= 1
            prompt, c, r = c[:n], c[n:], r[n:]
            if not prompt:
                raise _Bad(MISSING_KEY, 'missing key "prompt" (chosen and rejected share no '
                                        "first messages)")
        else:
            raise _Bad(WRONG_TYPE, '"chosen" and "rejected" must both be strings or both '
                                   "message lists")
        outs = [c, r]
    chat = isinstance(prompt, list) or any(isinstance(o, list) for o in outs)
    if chat:
        prompt = _as_messages(prompt, "user") if prompt else []
        outs = [_as_messages(o, "assistant") for o in outs]
        for k, o in zip(keys, outs):
            _check_completion(o, k)
    else:
        for k, o in zip(keys, outs):
            if not o.strip():
                raise _Bad(EMPTY, f'"{k}" is empty')
    if fmt != KTO and outs[0] == outs[1]:
        raise _Bad(IDENTICAL, "chosen and rejected are identical: nothing to prefer")
    return prompt, outs


def completion_example(prompt, completion, line: int, row: int, as_chat: bool) -> Example:
    """The SFT example of prompt + completion with only the completion trained."""
    if isinstance(completion, list):
        messages = tuple(list(prompt) + completion)
        return Example(line=line, row=row, messages=messages,
                       trained=tuple(range(len(prompt), len(messages))))
    if as_chat:
        return Example(line=line, row=row, messages=(
            {"role": "user", "content": prompt}, {"role": "assistant", "content": completion}),
            trained=(1,))
    return Example(line=line, row=row, segments=((prompt, False), (completion, True))
                   if prompt else ((completion, True),))


# ---- the file, tokenized ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Sequence:
    """One completion with its prompt: ids (n,) int32, trained (n,) bool (target tokens)."""

    ids: np.ndarray
    trained: np.ndarray

    @property
    def completion_tokens(self) -> int:
        return int(self.trained[1:].sum())


@dataclass(frozen=True)
class PreferenceItem:
    """A usable row: a pair (chosen, rejected) or a KTO row (chosen = its completion,
    rejected None, label its desirability). digest: the row's hash (the held-out split)."""

    line: int
    chosen: Sequence
    rejected: Sequence | None
    label: bool | None
    digest: int


@dataclass
class PreferenceData:
    """The usable rows of a preference file and the rejected ones."""

    path: str
    format: str
    n_rows: int
    items: list[PreferenceItem]
    rejections: RejectionLog = field(default_factory=RejectionLog)

    @property
    def paired(self) -> bool:
        return self.format == PREFERENCE

    def split(self, fraction: float, seed: int) -> tuple[list[PreferenceItem], list[PreferenceItem]]:
        """(training rows, held-out rows): the seeded hash split of SFT datasets
        (app.engine.data.dataset.split_rows)."""
        if not self.items:
            return [], []
        val = split_rows(np.array([it.digest for it in self.items], np.uint64), fraction, seed)
        return ([it for it, v in zip(self.items, val) if not v],
                [it for it, v in zip(self.items, val) if v])


def unpaired(items: list[PreferenceItem]) -> list[PreferenceItem]:
    """KTO rows of pairs: each pair's chosen (desirable) then its rejected (undesirable)."""
    out = []
    for it in items:
        if it.rejected is None:
            out.append(it)
        else:
            out.append(PreferenceItem(it.line, it.chosen, None, True, it.digest))
            out.append(PreferenceItem(it.line, it.rejected, None, False, it.digest))
    return out


def _sequence(encoded: Encoded | Rejection) -> Sequence | Rejection:
    if isinstance(encoded, Rejection):
        return encoded
    return Sequence(np.asarray(encoded.ids, np.int32), np.asarray(encoded.trained, bool))


def load_preferences(path, tokenizer: Tokenizer, *, context: int, fmt: str = "auto",
                     chat_template: str | None = None, completion_as_chat: bool = False,
                     add_eos: bool = True, stop: Callable[[], None] = NEVER) -> PreferenceData:
    """Read and tokenize a preference file (`fmt`: auto, preference or kto). Rows whose longer
    sequence has more than context + 1 tokens are rejected (TOO_LONG). Raises DatasetError when
    the file is not a preference file."""
    name = os.path.basename(os.fspath(path))
    if fmt == "auto":
        fmt = detect_preference_format(path, stop)
        if fmt is None:
            raise DatasetError(f"{name} is not a preference dataset: its first rows have no "
                               '"chosen" and "rejected" (nor "completion" with a true/false '
                               '"label").',
                               'Use rows {"prompt", "chosen", "rejected"} (DPO, ORPO, SimPO, '
                               'KTO) or {"prompt", "completion", "label"} (KTO).')
    encoder = Encoder(tokenizer, chat_template=chat_template, add_eos=add_eos)
    log = RejectionLog()
    items, n_rows = [], 0
    for row, (line, raw) in enumerate(iter_lines(path, stop=stop)):
        n_rows += 1
        obj = parse_line(line, raw)
        if isinstance(obj, Rejection):
            log.add(obj)
            continue
        try:
            prompt, outs = row_completions(obj, fmt)
        except _Bad as bad:
            looks = row_preference_format(obj)
            extra = (f" (the row looks like the {looks} format; the dataset is {fmt})"
                     if bad.kind == MISSING_KEY and looks not in (None, fmt) else "")
            log.add(Rejection(line, bad.kind, bad.reason + extra))
            continue
        seqs = [_sequence(e) for e in encoder.encode(
            [completion_example(prompt, o, line, row, completion_as_chat) for o in outs])]
        bad = next((s for s in seqs if isinstance(s, Rejection)), None)
        if bad is not None:
            log.add(bad)
            continue
        longest = max(len(s.ids) for s in seqs)
        if longest > context + 1:
            log.add(Rejection(line, TOO_LONG, f"{longest} tokens with its prompt: more than the "
                                              f"context allows ({context + 1})"))
            continue
        if fmt == PREFERENCE and np.array_equal(seqs[0].ids, seqs[1].ids):
            log.add(Rejection(line, IDENTICAL, "chosen and rejected are identical after "
                                               "tokenizing: nothing to prefer"))
            continue
        digest = int.from_bytes(hashlib.blake2b(raw.strip(), digest_size=8).digest(), "little")
        items.append(PreferenceItem(line, seqs[0], seqs[1] if fmt == PREFERENCE else None,
                                    obj["label"] if fmt == KTO else None, digest))
    log.kept.sort(key=lambda r: r.line)
    return PreferenceData(os.fspath(path), fmt, n_rows, items, log)


# ---- the linter's report ----------------------------------------------------------------------------

def preference_report(data: PreferenceData, tokenizer: Tokenizer, context: int) -> dict:
    """The linter's facts of a preference file: pairs (or KTO rows by label), rejected rows by
    line and kind (identical and empty completions among them), sequence lengths against the
    context, and one row shown with its completions marked."""
    lengths = np.array([len(s.ids) for it in data.items
                        for s in (it.chosen, it.rejected) if s is not None], np.int64)
    comp = np.array([s.completion_tokens for it in data.items
                     for s in (it.chosen, it.rejected) if s is not None], np.int64)
    kinds = dict(sorted(data.rejections.kinds.items()))
    out = {"path": data.path, "format": data.format, "rows": data.n_rows,
           "accepted": len(data.items), "context": context,
           "rejected_count": data.rejections.total, "rejected_by_kind": kinds,
           "rejected": [r.to_dict() for r in data.rejections.kept[:1000]],
           "identical": kinds.get(IDENTICAL, 0), "empty": kinds.get(EMPTY, 0),
           "too_long": kinds.get(TOO_LONG, 0)}
    if data.paired:
        out["pairs"] = len(data.items)
    else:
        out["desirable"] = sum(bool(it.label) for it in data.items)
        out["undesirable"] = len(data.items) - out["desirable"]
    if len(lengths):
        out["lengths"] = {"min": int(lengths.min()), "mean": round(float(lengths.mean()), 2),
                          "max": int(lengths.max()), "fits_up_to": context + 1}
        out["completion_tokens"] = {"min": int(comp.min()),
                                    "mean": round(float(comp.mean()), 2), "max": int(comp.max())}
    if data.items:
        it = data.items[0]
        out["example"] = {
            "line": it.line, "label": it.label,
            "chosen": _example(tokenizer, it.line, it.chosen.ids, it.chosen.trained),
            "rejected": None if it.rejected is None else
            _example(tokenizer, it.line, it.rejected.ids, it.rejected.trained)}
    out["trains"] = bool(data.items)
    return out


def preference_report_text(r: dict) -> str:
    name = os.path.basename(r["path"])
    what = (f"{r['pairs']} pairs" if "pairs" in r else
            f"{r['desirable']} desirable and {r['undesirable']} undesirable rows")
    how = "detected" if r.get("format_detected", True) else "as chosen"
    out = [f"{name}: {r['format']} format ({how}), context {r['context']} positions",
           f"rows: {what} accepted, {r['rejected_count']} rejected (of {r['rows']}); "
           f"identical pairs {r['identical']}, empty completions {r['empty']}, longer than the "
           f"context {r['too_long']}"]
    if r["rejected"]:
        out.append("rejected rows:")
        out += [f"  line {x['line']}: {x['reason']}" for x in r["rejected"][:20]]
        if r["rejected_count"] > 20:
            out.append(f"  ... and {r['rejected_count'] - 20} more (--json lists up to 1000)")
    if "lengths" in r:
        L, C = r["lengths"], r["completion_tokens"]
        out.append(f"sequence lengths (prompt + completion): min {L['min']}, mean {L['mean']:g}, "
                   f"max {L['max']} (fits up to {L['fits_up_to']})")
        out.append(f"completion tokens: min {C['min']}, mean {C['mean']:g}, max {C['max']}")
    ex = r.get("example")
    if ex:
        for key in ("chosen", "rejected"):
            e = ex[key]
            if e is None:
                continue
            label = key if ex["label"] is None else ("desirable" if ex["label"] else "undesirable")
            out.append(f"example (line {ex['line']}), {label}, {e['trained_tokens']} completion "
                       "tokens marked \u27e6 \u27e7:")
            out += ["  " + line for line in e["marked"][:2000].split("\n")]
    if not r["trains"]:
        out.append("nothing would train: no usable row")
    return "\n".join(out)


def lint_preference_file(data_path, model_path, config: DataConfig, context: int | None,
                         fmt: str = "auto") -> dict | None:
    """`workbench lint` of a preference file: the report (its "text" the printed form), or None
    when `fmt` is auto and the file is not a preference file (the SFT linter's turn)."""
    detected = fmt == "auto"
    if detected:
        fmt = detect_preference_format(data_path)
        if fmt is None:
            return None
    tokenizer, ctx, notes = lint_tokenizer(model_path, config, context)
    data = load_preferences(data_path, tokenizer, context=ctx, fmt=fmt,
                            chat_template=config.chat_template,
                            completion_as_chat=config.completion_as_chat)
    report = preference_report(data, tokenizer, ctx)
    report["format_detected"], report["notes"] = detected, notes
    report["text"] = preference_report_text(report) + "".join(f"\nnote: {n}" for n in notes)
    return report
