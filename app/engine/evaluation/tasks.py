"""Multiple-choice task files, read as llama.cpp's `llama-perplexity` reads them
(tools/perplexity/perplexity.cpp), plus a JSONL form.

Every task becomes a `ChoiceTask`: one full text per choice (the shared context and that
choice, tokenized later with BOS as `common_tokenize(ctx, text, true)`), the gold choice(s) and
where it came from. The texts are built exactly as llama.cpp builds them:

* **HellaSwag** (`hellaswag_score`): 6 lines a task: the context, the gold ending's index
  (0-3), four endings. Choice text = context + " " + ending.
* **WinoGrande** (`load_winogrande_from_csv`): CSV rows `index,sentence,option1,option2,answer`
  (answer 1 or 2), the sentence holding one `_`; a sentence field in double quotes loses them
  (nothing inside is unescaped, as llama.cpp). Choice text = the sentence with `_` replaced by
  the option (no space added); `base` = the text up to and including the option (the partial
  score starts after it). llama.cpp skips lines it cannot read (a header among them); here the
  first line is skipped when its answer is not a number (a header), any other bad line is an
  error with its number.
* **Multiple choice** (`multiple_choice_score`, the binary files of MMLU, ARC, TruthfulQA made
  for llama.cpp): little-endian uint32 n_task, uint32 byte offsets of the n tasks, then per task
  a string question and two answer sets mc1 (single correct answer, the one scored) and mc2
  (ignored, as llama.cpp); a string is uint32 length + bytes, an answer set is uint32 n (at most
  100), n strings, n int32 labels (1 = correct). Choice text = question + " " + answer.
* **JSONL** (the workbench's own): one object a line, `{"question": str, "choices": [str, ...],
  "answer": i}` with an optional `"context": str` put before the question on its own line.
  Choice text = prompt + " " + choice, as the multiple-choice format. A chat model's question
  is `"messages": [{"role", "content"}, ...]` instead of "question": the model's chat template
  renders it with the generation prompt (special tokens parsed, as generation does) and each
  choice's tokens follow as the assistant's answer.

A file that does not read as its format is a DatasetError naming the line (the task and byte
offset for the binary format) and what is wrong.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from app.engine.errors import DatasetError
from app.engine.runtime.inputs import open_input

TASK_FILE_LIMIT = 256 << 20       # bytes read from one task file
MAX_ANSWERS = 100                 # llama.cpp's bound on one task's answers
FORMATS = ("hellaswag", "winogrande", "mc", "jsonl")


@dataclass
class ChoiceTask:
    """One multiple-choice question: the full text of each choice and the correct choice(s)."""
    texts: list[str]
    correct: set[int]                   # indices into texts (mc may mark several)
    gold: int                           # the first correct index (what records show)
    where: str                          # "line 7", "task 3": for messages
    base: list[str] = field(default_factory=list)   # winogrande: text up to the option
    messages: list[dict] | None = None    # JSONL chat rows: the prompt (texts: the choices)


def _read(path: str | os.PathLike) -> bytes:
    with open_input(Path(path), "task file") as f:
        raw = f.read(TASK_FILE_LIMIT + 1)
    if len(raw) > TASK_FILE_LIMIT:
        raise DatasetError(f"{path} is larger than {TASK_FILE_LIMIT >> 20} MB.",
                           "Split the task file.")
    return raw


def _text(path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise DatasetError(f"{path}, line {line}: not UTF-8 text.",
                           "Save the task file as UTF-8.") from None


def _lines(text: str) -> list[str]:
    """Lines as std::getline splits them (a final newline adds no empty line), without a
    trailing carriage return (a file saved on Windows reads the same)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [s[:-1] if s.endswith("\r") else s for s in lines]


def _rows(path):
    """(line number, line) of each non-blank line (CSV and JSONL rows)."""
    for n, line in enumerate(_lines(_text(path, _read(path))), 1):
        if line.strip():
            yield n, line


def read_hellaswag(path) -> list[ChoiceTask]:
    lines = _lines(_text(path, _read(path)))
    if not lines:
        raise DatasetError(f"{path} has no tasks.", "A HellaSwag task is 6 lines: the context, "
                           "the gold ending's index (0-3) and four endings.")
    if len(lines) % 6:
        raise DatasetError(f"{path} has {len(lines)} lines, not a multiple of 6: the last task "
                           f"(from line {len(lines) - len(lines) % 6 + 1}) is incomplete.",
                           "A HellaSwag task is 6 lines: the context, the gold ending's index "
                           "(0-3) and four endings.")
    tasks = []
    for i in range(0, len(lines), 6):
        context, label = lines[i], lines[i + 1].strip()
        if label not in ("0", "1", "2", "3"):
            raise DatasetError(f"{path}, line {i + 2}: the gold ending's index must be 0, 1, 2 "
                               f"or 3, not {lines[i + 1][:40]!r}.",
                               "A HellaSwag task is 6 lines: the context, the gold index, "
                               "four endings.")
        endings = lines[i + 2:i + 6]
        gold = int(label)
        tasks.append(ChoiceTask([context + " " + e for e in endings], {gold}, gold,
                                f"line {i + 1}"))
    return tasks


def _csv_commas(line: str) -> list[int]:
    """The positions of the first four commas outside double quotes (llama.cpp's scan)."""
    commas, quoted = [], False
    for i, c in enumerate(line):
        if quoted:
            quoted = c != '"'
        elif c == ",":
            commas.append(i)
            if len(commas) == 4:
                break
        elif c == '"':
            quoted = True
    return commas


def read_winogrande(path) -> list[ChoiceTask]:
    hint = ("A WinoGrande row is index,sentence,option1,option2,answer with one _ in the "
            "sentence and answer 1 or 2.")
    tasks = []
    for n, line in _rows(path):
        c = _csv_commas(line)
        if len(c) != 4:
            raise DatasetError(f"{path}, line {n}: {len(c) + 1} fields, not 5.", hint)
        if line[c[0] + 1:c[0] + 2] == '"':
            sentence = line[c[0] + 2:c[1] - 1]
        else:
            sentence = line[c[0] + 1:c[1]]
        options = [line[c[1] + 1:c[2]], line[c[2] + 1:c[3]]]
        answer = line[c[3] + 1:].strip()
        if answer not in ("1", "2"):
            if n == 1 and not answer.lstrip("-").isdigit():
                continue                                    # a header row
            raise DatasetError(f"{path}, line {n}: the answer must be 1 or 2, not "
                               f"{answer[:20]!r}.", hint)
        where = sentence.find("_")
        if where < 0:
            raise DatasetError(f"{path}, line {n}: the sentence has no _ to fill.", hint)
        first, second = sentence[:where], sentence[where + 1:]
        gold = int(answer) - 1
        tasks.append(ChoiceTask([first + o + second for o in options], {gold}, gold,
                                f"line {n}", [first + o for o in options]))
    if not tasks:
        raise DatasetError(f"{path} has no tasks.", hint)
    return tasks


class _Reader:
    def __init__(self, path, raw: bytes):
        self.path, self.raw, self.pos = path, raw, 0

    def fail(self, what: str) -> DatasetError:
        return DatasetError(f"{self.path}: {what}.", "Multiple-choice files are llama.cpp's "
                            "binary format (see the user guide); write your own tasks as JSONL.")

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > len(self.raw):
            raise self.fail(f"the file ends inside {what} (byte {self.pos})")
        out = self.raw[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def string(self, what: str) -> str:
        data = self.take(self.u32(what), what)
        return data.decode("utf-8", errors="replace")

    def answers(self, what: str) -> tuple[list[str], list[int]]:
        n = self.u32(what)
        if n > MAX_ANSWERS:
            raise self.fail(f"{what} has {n} answers (at most {MAX_ANSWERS}, as llama.cpp)")
        answers = [self.string(what) for _ in range(n)]
        labels = list(struct.unpack(f"<{n}i", self.take(4 * n, what)))
        return answers, labels


def read_mc(path) -> list[ChoiceTask]:
    r = _Reader(path, _read(path))
    n_task = r.u32("the task count")
    if n_task == 0:
        raise r.fail("no tasks")
    if 4 * (n_task + 1) > len(r.raw):
        raise r.fail(f"{n_task} tasks announced but the file has only {len(r.raw)} bytes")
    r.take(4 * n_task, "the task offsets")   # all tasks are read in order, as llama.cpp does
    tasks = []
    for i in range(1, n_task + 1):
        what = f"task {i} of {n_task}"
        start = r.pos
        question = r.string(what)
        answers, labels = r.answers(what)
        r.answers(what)                                       # mc2: not scored (llama.cpp)
        if not question or not answers or any(not a for a in answers):
            raise r.fail(f"{what} (byte {start}) has an empty question or answer")
        correct = {j for j, label in enumerate(labels) if label == 1}
        gold = min(correct) if correct else -1
        tasks.append(ChoiceTask([question + " " + a for a in answers], correct, gold, what))
    return tasks


def read_jsonl(path) -> list[ChoiceTask]:
    hint = ('One object a line: {"question": "...", "choices": ["...", "..."], "answer": 0} '
            'with an optional "context".')
    tasks = []
    for n, line in _rows(path):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}, line {n}: not JSON ({e.msg}).", hint) from None
        if not isinstance(row, dict):
            raise DatasetError(f"{path}, line {n}: not a JSON object.", hint)
        question, choices, answer = row.get("question"), row.get("choices"), row.get("answer")
        context, messages = row.get("context", ""), row.get("messages")
        if messages is not None:
            if (not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str) for m in messages)):
                raise DatasetError(f"{path}, line {n}: \"messages\" must be a non-empty list "
                                   'of {"role", "content"} objects with text values.', hint)
        elif not isinstance(question, str) or not isinstance(context, str):
            raise DatasetError(f"{path}, line {n}: \"question\" (and \"context\") must be "
                               "text.", hint)
        if (not isinstance(choices, list) or not 2 <= len(choices) <= MAX_ANSWERS
                or not all(isinstance(c, str) and c for c in choices)):
            raise DatasetError(f"{path}, line {n}: \"choices\" must be a list of 2 to "
                               f"{MAX_ANSWERS} non-empty texts.", hint)
        if isinstance(answer, bool) or not isinstance(answer, int) or not (
                0 <= answer < len(choices)):
            raise DatasetError(f"{path}, line {n}: \"answer\" must be the index of the right "
                               f"choice (0 to {len(choices) - 1}).", hint)
        if messages is not None:
            tasks.append(ChoiceTask(list(choices), {answer}, answer, f"line {n}",
                                    messages=messages))
            continue
        prompt = f"{context}\n{question}" if context else question
        tasks.append(ChoiceTask([prompt + " " + c for c in choices], {answer}, answer,
                                f"line {n}"))
    if not tasks:
        raise DatasetError(f"{path} has no tasks.", hint)
    return tasks


READERS = {"hellaswag": read_hellaswag, "winogrande": read_winogrande, "mc": read_mc,
           "jsonl": read_jsonl}


def read_tasks(fmt: str, path, limit: int | None = None) -> list[ChoiceTask]:
    """The tasks of `path` in format `fmt` (FORMATS), the first `limit` of them (in file order:
    never a random pick, so runs compare task by task)."""
    tasks = READERS[fmt](path)
    return tasks if limit is None else tasks[:limit]


def write_mc(path, tasks: list[tuple[str, list[str], list[int]]]) -> None:
    """Write (question, answers, labels) tasks in llama.cpp's binary multiple-choice format
    (mc2 left empty): for tests and for converting your own questions."""
    def string(s: str) -> bytes:
        data = s.encode("utf-8")
        return struct.pack("<I", len(data)) + data

    bodies = []
    for question, answers, labels in tasks:
        body = string(question) + struct.pack("<I", len(answers))
        body += b"".join(string(a) for a in answers) + struct.pack(f"<{len(labels)}i", *labels)
        bodies.append(body + struct.pack("<I", 0))
    offset = 4 * (len(bodies) + 1)
    offsets = []
    for body in bodies:
        offsets.append(offset)
        offset += len(body)
    Path(path).write_bytes(struct.pack(f"<I{len(offsets)}I", len(offsets), *offsets)
                           + b"".join(bodies))
