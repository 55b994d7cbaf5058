"""Reward functions for GRPO-style runs: built-in rewards and custom rewards in Python files.

A reward scores one sampled completion of one prompt row. A run combines several with weights:
the total is sum_k weight_k * r_k. `RewardSpec` describes one function (JSON-able, in the run's
config.json); `RewardScorer` evaluates a list of specs on a batch of completions.

Built-in rewards (the reference is the row's ``answer`` field, or the field the run names):

* ``exact``   1.0 when the completion equals the reference after whitespace normalisation
              (leading/trailing whitespace removed, inner runs of whitespace collapsed to one
              space; case and punctuation count), else 0.0. With ``tag=T`` the compared text is
              the content of the last ``<T>...</T>`` in the completion (0.0 without one).
              Deliberately strict: "The answer is 85." does NOT match "85" (use ``numeric`` for
              lenient number matching), so exact match also rewards answering in the reference's
              form.
* ``numeric`` 1.0 when the last number in the completion (or in its last ``<T>...</T>`` with
              ``tag=T``; thousands separators "1,234" allowed) is within ``tol`` (absolute,
              default 0) of the reference, which must be a number; else 0.0.
* ``regex``   1.0 when ``re.search(pattern, completion)`` finds a match, else 0.0.
* ``format``  1.0 when the completion holds ``<TAG>...</TAG>`` with non-blank content (TAG
              default ``answer``), else 0.0.
* ``length``  a length penalty in [-1, 0]: -max(0, n - target) / max(max_new_tokens - target, 1)
              where n is the number of generated tokens (the end-of-turn token included):
              0 up to ``target`` tokens (default 0), -1 at the generation limit.

Custom rewards: a Python file defining ``reward(prompt, completion, **row) -> float``. ``prompt``
is the prompt as the row wrote it (a plain prompt's text, or the content of a chat row's last
message: the whole conversation is in ``row["messages"]``), ``completion`` the generated text
(without the end-of-turn token), ``row`` every field of the JSONL row except ``prompt`` and
``completion``. The file runs in a separate Python process (one per run, started on first use,
in its own session so Ctrl-C does not reach it; its stdout goes to stderr so print() cannot
garble the replies), and every call has a timeout. An exception, a timeout, a crash of the
process, a return value that is not a real number (bool and str included) or is NaN/Inf, or a
file without the function, raises `RewardError` naming the function, the file, the row and its
line, with the function's traceback: the step fails, the worker process never does.

The separate process is NOT a sandbox: a reward file is ordinary Python running with the user's
own rights (files, network, other programs), like any script they run. Only trusted files run.
The trust rule: a file the user names for a new run themselves (``workbench grpo --reward
FILE.py``) is trusted by that act. A file named by a config from elsewhere (``--config X.json``,
a run directory to resume, a queued job, settings loaded in the window) runs only once the user
trusted it: ``--trust-reward-code`` on the command line, Yes to the window's question. Trust is
recorded per file in ``trusted-rewards.json`` in the user data folder (beside the job queue's
database), not in the run's config.json, where a shared config could carry it along: the sha256
of the file and of every local module it imports (`reward_code_files`: a module an import
statement names that its folder holds, recursively), so a file or a module changed since, or a
module it newly imports, needs trust again. Code loaded by a computed name (importlib, exec) is
not followed; the trust question says so (TRUST_SCOPE). `untrusted_reward_files`,
`trust_reward_files` and `check_reward_trust` are the one rule the CLI, the worker and the
window use.

CLI grammar (``--reward``, repeatable), a trailing ``:W`` is the weight (default 1):
``exact[:tag=T][:W]``, ``numeric[:tol=X][:tag=T][:W]``, ``regex:PATTERN[:W]``,
``format[:TAG][:W]``, ``length[:TARGET][:W]``, ``FILE.py[:W]`` (or ``file:FILE.py[:W]``).
A regex whose text ends in ``:<number>`` needs an explicit weight (``regex:a:1:1``).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import math
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from importlib import machinery
from pathlib import Path
from typing import Any, ClassVar, Iterable, Sequence

import numpy as np

from app.engine.errors import ConfigError, EngineError
from app.engine.runtime.files import atomic_write_json, read_json
from app.engine.runtime.inputs import check_input_file
from app.engine.runtime.paths import state_file, user_state_dir
from app.engine.runtime.schema import ANY, AT_LEAST_0, TEXT

REWARD_KINDS = ("exact", "numeric", "regex", "format", "length", "file")
DEFAULT_TIMEOUT_S = 10.0
REWARD_FILE_MAX_BYTES = 16 << 20   # Python source; a larger "reward file" is not one
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_SPACE = re.compile(r"\s+")


class RewardError(EngineError):
    """A reward function failed (raised, timed out, crashed, returned a non-finite number...)."""

    kind = "reward"


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class RewardSpec:
    """One reward function with its weight. `arg` is the regex pattern, the format tag, or the
    Python file; `tag` the answer tag exact/numeric read; `name` the label in events."""

    kind: str
    weight: float = 1.0
    arg: str = ""
    tag: str = ""
    tolerance: float = 0.0
    target: int = 0
    function: str = "reward"
    name: str = ""

    SCHEMA_RULES: ClassVar[dict] = dict(kind=REWARD_KINDS, weight=ANY, arg=TEXT, tag=TEXT,
                                        tolerance=AT_LEAST_0, target=AT_LEAST_0, function=TEXT,
                                        name=TEXT)

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.kind == "file":
            return Path(self.arg).stem
        return self.kind

    @property
    def needs_answer(self) -> bool:
        return self.kind in ("exact", "numeric")

    def validate(self) -> None:
        if self.kind not in REWARD_KINDS:
            raise ConfigError(f"Unknown reward '{self.kind}'.",
                              "Use one of: " + ", ".join(REWARD_KINDS) + " (or a .py file).")
        if not math.isfinite(self.weight):
            raise ConfigError(f"The weight of reward '{self.label}' must be a finite number.")
        if self.kind == "regex":
            if not self.arg:
                raise ConfigError("A regex reward needs a pattern (regex:PATTERN).")
            try:
                re.compile(self.arg)
            except re.error as e:
                raise ConfigError(f"The regex reward's pattern {self.arg!r} is invalid: {e}.") from None
        if self.kind == "file":
            if not os.path.lexists(self.arg):
                raise ConfigError(f"The reward file {self.arg!r} does not exist.",
                                  "Give the path of a Python file defining reward(prompt, "
                                  "completion, **row).")
            # a folder, a pipe (whose reading would block) or oversized: ConfigError
            check_input_file(self.arg, "reward file", max_bytes=REWARD_FILE_MAX_BYTES,
                             error=ConfigError)
            if not self.function.isidentifier():
                raise ConfigError(f"{self.function!r} is not a Python function name.")
        for tag in (self.tag, self.arg if self.kind == "format" else ""):
            if tag and not re.fullmatch(r"[\w.:-]+", tag):
                raise ConfigError(f"Invalid tag {tag!r}: use letters, digits, _ . : -")
        if self.tolerance < 0 or not math.isfinite(self.tolerance):
            raise ConfigError("The numeric reward's tolerance must be a non-negative number.")
        if self.target < 0:
            raise ConfigError("The length reward's target must not be negative.")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RewardSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, dict) or "kind" not in d or set(d) - known:
            extra = sorted(set(d) - known) if isinstance(d, dict) else []
            raise ConfigError(f"Invalid reward setting {d!r}"
                              + (f" (unknown keys: {', '.join(extra)})." if extra else "."),
                              'A reward is {"kind": "exact", "weight": 1.0, ...}.')
        return cls(**d)

    @classmethod
    def parse(cls, text: str) -> "RewardSpec":
        """A spec from the CLI grammar (see the module docstring)."""
        text = text.strip()
        low = text.lower()
        if low.startswith("regex:"):
            pattern, weight = _split_weight(text[6:])
            return cls("regex", weight, arg=pattern)
        if low.startswith("file:"):
            path, weight = _split_weight(text[5:])
            return cls("file", weight, arg=str(Path(path).expanduser()))
        path, weight = _split_weight(text)
        if path.endswith(".py"):
            return cls("file", weight, arg=str(Path(path).expanduser()))
        kind, *parts = text.split(":")
        kind = kind.strip().lower()
        if kind not in REWARD_KINDS or kind == "file":
            raise ConfigError(f"Unknown reward {text!r}.",
                              "Use exact, numeric, regex:PATTERN, format[:TAG], length[:TARGET] "
                              "or a .py file, each optionally followed by :WEIGHT.")
        options: dict[str, str] = {}
        positional: list[str] = []
        for part in parts:
            key, eq, value = part.partition("=")
            if eq:
                options[key.strip().lower()] = value.strip()
            else:
                positional.append(part.strip())
        spec: dict[str, Any] = {}
        weight = 1.0
        try:
            if kind == "length":             # length[:TARGET][:W]
                if "target" in options:
                    spec["target"] = int(options.pop("target"))
                elif positional:
                    spec["target"] = int(positional.pop(0))
            elif kind == "format":           # format[:TAG][:W]
                if "tag" in options:
                    spec["arg"] = options.pop("tag")
                elif positional and not _is_float(positional[0]):
                    spec["arg"] = positional.pop(0)
                else:
                    spec["arg"] = "answer"
            else:                            # exact / numeric [:tag=T][:tol=X][:W]
                if "tag" in options:
                    spec["tag"] = options.pop("tag")
                if kind == "numeric" and "tol" in options:
                    spec["tolerance"] = float(options.pop("tol"))
            if "name" in options:
                spec["name"] = options.pop("name")
            if len(positional) == 1 and _is_float(positional[0]):
                weight = float(positional.pop())
        except ValueError as e:
            raise ConfigError(f"Invalid reward {text!r}: {e}.") from None
        if positional or options:
            raise ConfigError(f"Invalid reward {text!r}: unexpected "
                              f"{', '.join(positional + list(options))}.",
                              "See `workbench grpo --help` for the reward syntax.")
        return cls(kind, weight, **spec)


def _split_weight(text: str) -> tuple[str, float]:
    """("PATTERN", W) from "PATTERN:W"; the weight is 1 without a trailing number."""
    head, sep, last = text.rpartition(":")
    if sep and head and _is_float(last.strip()):
        return head, float(last)
    return text, 1.0


def parse_reward(text: str) -> RewardSpec:
    """A validated spec from the CLI grammar."""
    spec = RewardSpec.parse(text)
    spec.validate()
    return spec


# ---- built-ins ---------------------------------------------------------------------------------

def normalize_text(text: str) -> str:
    """Whitespace-normalised text: stripped, inner whitespace runs collapsed to one space."""
    return _SPACE.sub(" ", text).strip()


def tag_content(text: str, tag: str) -> str | None:
    """The content of the last <tag>...</tag> in text, or None."""
    found = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.S)
    return found[-1] if found else None


def last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def parse_number(value) -> float | None:
    """A reference answer as a number (int, float or numeric string), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, str):
        text = value.strip().replace(",", "")
        try:
            number = float(text)
        except ValueError:
            return None
        return number if math.isfinite(number) else None
    return None


@dataclass(frozen=True)
class ScoreItem:
    """One completion to score: the prompt as written, the generated text (no end-of-turn
    token), the row's fields, where the row is (index among the file's rows, line) and how many
    tokens were generated."""

    prompt: str
    completion: str
    row: dict
    row_index: int
    line: int
    n_tokens: int
    max_new_tokens: int


def _builtin(spec: RewardSpec, item: ScoreItem, answer_field: str) -> float:
    text = item.completion
    if spec.kind in ("exact", "numeric") and spec.tag:
        text = tag_content(text, spec.tag)
        if text is None:
            return 0.0
    if spec.kind == "exact":
        return float(normalize_text(text) == normalize_text(str(item.row[answer_field])))
    if spec.kind == "numeric":
        got, want = last_number(text), parse_number(item.row[answer_field])
        return float(got is not None and want is not None and abs(got - want) <= spec.tolerance)
    if spec.kind == "regex":
        return float(re.search(spec.arg, text) is not None)
    if spec.kind == "format":
        content = tag_content(text, spec.arg or "answer")
        return float(content is not None and bool(content.strip()))
    if spec.kind == "length":
        room = max(item.max_new_tokens - spec.target, 1)
        return -max(0, item.n_tokens - spec.target) / room
    raise AssertionError(spec.kind)


# ---- custom rewards in a separate process (not a sandbox: see the module docstring) ---------------

_BOOTSTRAP = r'''
import importlib.util, json, math, numbers, os, sys, traceback
proto_in = os.fdopen(os.dup(0), "r", encoding="utf-8")
proto_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.dup2(2, 1)                      # print() in the reward goes to stderr, not the protocol
sys.stdout = sys.stderr
def send(obj):
    proto_out.write(json.dumps(obj) + "\n")
    proto_out.flush()
def user_tb(exc):
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    return "".join(traceback.format_exception(type(exc), exc, tb))
path, name = sys.argv[1], sys.argv[2]
try:
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    spec = importlib.util.spec_from_file_location("workbench_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
except BaseException as exc:
    send({"ok": False, "stage": "load", "error": user_tb(exc)})
    sys.exit(0)
fn = getattr(module, name, None)
if not callable(fn):
    send({"ok": False, "stage": "load", "error": f"{os.path.basename(path)} defines no function {name}()"
          + ("" if fn is None else f" ({name} is a {type(fn).__name__})")})
    sys.exit(0)
send({"ok": True, "stage": "load"})
for line in proto_in:
    req = json.loads(line)
    try:
        value = fn(req["prompt"], req["completion"], **req["row"])
    except BaseException as exc:
        send({"ok": False, "error": user_tb(exc)})
        continue
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        send({"ok": False, "bad_value": repr(value)[:200], "type": type(value).__name__})
        continue
    value = float(value)
    send({"ok": True, "value": value if math.isfinite(value) else repr(value)})
'''


class RewardProcess:
    """A custom reward function running in its own Python process (with the user's rights),
    one call at a time, each with a timeout. Start on first call; `close()` ends the process."""

    def __init__(self, path: str, function: str = "reward", timeout: float = DEFAULT_TIMEOUT_S,
                 label: str = ""):
        self.path = str(Path(path).resolve())
        self.function = function
        self.timeout = float(timeout)
        self.label = label or Path(path).stem
        self._proc: subprocess.Popen | None = None
        self._lines: queue.Queue = queue.Queue()
        self._stderr = None

    @property
    def what(self) -> str:
        return f"{self.function}() in {Path(self.path).name}"

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        try:
            self._stderr.flush()
            self._stderr.seek(0)
            text = self._stderr.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""
        return text[-2000:].strip()

    def _start(self) -> None:
        self._stderr = tempfile.TemporaryFile()
        try:
            self._proc = subprocess.Popen(
                # -B: no __pycache__/*.pyc beside the reward file or the modules it imports
                # (files the user did not name)
                [sys.executable, "-u", "-B", "-c", _BOOTSTRAP, self.path, self.function],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                cwd=os.path.dirname(self.path), start_new_session=(os.name == "posix"),
                env={**os.environ, "PYTHONIOENCODING": "utf-8"})
        except OSError as e:
            raise RewardError(f"Could not start a process for the reward {self.what}: {e}.") from e
        self._lines = queue.Queue()
        threading.Thread(target=self._read, args=(self._proc.stdout, self._lines),
                         name="reward-reader", daemon=True).start()
        reply = self._receive(max(self.timeout, 30.0), "while loading the file")
        if not reply.get("ok"):
            self.close()
            raise RewardError(f"The reward file {Path(self.path).name} could not be loaded:\n"
                              f"{reply.get('error', '').rstrip()}",
                              f"Fix {self.path}: it must define {self.function}(prompt, "
                              "completion, **row) returning a number.")

    @staticmethod
    def _read(stream, lines: queue.Queue) -> None:
        for raw in stream:
            lines.put(raw)
        lines.put(None)

    def _receive(self, timeout: float, where: str) -> dict:
        try:
            raw = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise RewardError(f"The reward {self.what} timed out after {timeout:g} s {where}.",
                              "Make the function faster, or raise the reward timeout.") from None
        if raw is None:
            code = self._proc.wait() if self._proc is not None else None
            tail = self._stderr_tail()
            self.close()
            raise RewardError(f"The reward process for {self.what} exited (code {code}) {where}"
                              + (f":\n{tail}" if tail else "."),
                              "The function crashed the interpreter or called exit().")
        return json.loads(raw)

    def __call__(self, prompt: str, completion: str, row: dict, where: str) -> float:
        """Score one completion; `where` names the row in error messages."""
        if self._proc is None:
            self._start()
        fields = {k: v for k, v in row.items() if k not in ("prompt", "completion")}
        request = json.dumps({"prompt": prompt, "completion": completion, "row": fields})
        try:
            self._proc.stdin.write(request.encode("utf-8") + b"\n")
            self._proc.stdin.flush()
        except OSError:
            pass  # the process died: _receive reports it with its stderr
        reply = self._receive(self.timeout, where)
        if reply.get("ok"):
            value = reply["value"]
            if isinstance(value, str):
                raise RewardError(f"The reward {self.what} returned {value} {where}.",
                                  "A reward must be a finite number.")
            return float(value)
        if "bad_value" in reply:
            raise RewardError(f"The reward {self.what} returned {reply['bad_value']} (a "
                              f"{reply['type']}, not a number) {where}.",
                              "A reward must return an int or a float.")
        raise RewardError(f"The reward {self.what} raised an exception {where}:\n"
                          f"{reply.get('error', '').rstrip()}",
                          "Fix the function (the traceback above is from the reward process).")

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None


# ---- trust: which reward files the user agreed to run ---------------------------------------------

TRUST_FILE = "trusted-rewards.json"
TRUST_SCOPE = ("Trust covers each reward file and the local modules it imports by name (import "
               "statements that find a file in its folder); code it loads any other way is not "
               "checked.")


class UntrustedRewardError(ConfigError):
    """A run names reward code the user has not trusted (or that changed since they did)."""

    kind = "untrusted_reward"


def trust_file_path() -> Path:
    """trusted-rewards.json in the user data folder: beside the job queue's database."""
    return user_state_dir() / TRUST_FILE


def _reward_files(specs: Iterable[RewardSpec]) -> list[str]:
    """The absolute paths of the custom reward files of `specs` that exist, each once."""
    paths = (str(Path(s.arg).expanduser().resolve()) for s in specs if s.kind == "file")
    return [p for p in dict.fromkeys(paths) if os.path.isfile(p)]


# A reward file runs with its own folder first on sys.path (_BOOTSTRAP), so the modules it imports
# from there are its code as much as the file is: trust covers them (reward_code_files).
_LOADERS = ((machinery.ExtensionFileLoader, machinery.EXTENSION_SUFFIXES),
            (machinery.SourceFileLoader, machinery.SOURCE_SUFFIXES),
            (machinery.SourcelessFileLoader, machinery.BYTECODE_SUFFIXES))


def _module_files(name: str, root: str) -> list[tuple[str, str, bool]]:
    """What `import name` loads from `root` (the reward file's folder): (file, module name,
    is a package) of each package on the way and of the module itself; [] when its top-level
    name is not in `root` (the standard library, site-packages). Fresh finders each time, so a
    module added a moment ago is seen."""
    found, locations, parts = [], [root], name.split(".")
    for i in range(len(parts)):
        qualname = ".".join(parts[:i + 1])
        spec = next((s for s in (machinery.FileFinder(loc, *_LOADERS).find_spec(qualname)
                                 for loc in locations) if s is not None), None)
        if spec is None:
            break
        if spec.has_location:         # a namespace package has no file of its own
            found.append((spec.origin, qualname, spec.submodule_search_locations is not None))
        if spec.submodule_search_locations is None:
            break
        locations = list(spec.submodule_search_locations)
    return found


def _imported_names(path: str, package: str) -> set[str]:
    """The module names the import statements of source file `path` name (anywhere in it,
    functions and try blocks included), relative ones resolved against `package` ("" for the
    reward file itself, which is no package's module). `from M import x` adds M.x, which may
    be a submodule. A file that cannot be read or parsed names none (it fails when it loads)."""
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                if not package:
                    continue
                base = package.rsplit(".", node.level - 1)[0]
                module = f"{base}.{module}" if module else base
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def reward_code_files(path: str) -> list[str]:
    """The reward file `path` (absolute) and the local modules it imports, recursively: each
    module an import statement names that Python finds in the file's folder (the reward
    process puts it first on sys.path), with the packages on the way. Imports by a computed
    name (importlib.import_module(x), __import__, exec) cannot be followed: TRUST_SCOPE."""
    root = os.path.dirname(path)
    files = {path: ""}                # file -> the package its relative imports start from
    todo = [path]
    while todo:
        current = todo.pop()
        for name in _imported_names(current, files[current]):
            for file, qualname, is_package in _module_files(name, root):
                if file not in files:
                    files[file] = qualname if is_package else qualname.rpartition(".")[0]
                    if file.endswith(".py"):
                        todo.append(file)
    return list(files)


def _sha256(path: str) -> str | None:
    """The file's sha256; None when it cannot be read (then it is never trusted)."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _code_hashes(path: str) -> dict[str, str | None]:
    """{file: sha256} of a reward file and its local modules (`reward_code_files`)."""
    return {file: _sha256(file) for file in reward_code_files(path)}


def _trusted() -> dict:
    """The trust list; {} (nothing trusted: the user is asked) for a missing, corrupt or odd
    file (read_json: a FIFO or a huge file there neither hangs nor fills memory)."""
    try:
        trusted = read_json(trust_file_path(), what="trusted reward list", missing_ok=True)
    except EngineError:
        return {}
    return trusted if isinstance(trusted, dict) else {}


def _trusted_code(trusted: dict, path: str) -> dict:
    """{file: sha256} the user trusted for reward file `path`: the record maps each reward
    file to the hashes of its code files; a plain hash (an older record) covers the file only."""
    record = trusted.get(path)
    return {path: record} if isinstance(record, str) else \
        record if isinstance(record, dict) else {}


def untrusted_reward_files(specs: Iterable[RewardSpec]) -> list[str]:
    """The custom reward code of `specs` the user has not trusted as it is now: a reward file
    never trusted or changed since, or else each local module it imports that changed or is
    new since its trust, named "MODULE (imported by FILE)"."""
    trusted = _trusted()
    out = []
    for path in _reward_files(specs):
        then = _trusted_code(trusted, path)
        changed = [f for f, h in _code_hashes(path).items() if h is None or then.get(f) != h]
        out += [path] if path in changed else \
            [f"{f} (imported by {os.path.basename(path)})" for f in changed]
    return out


def trust_reward_files(specs: Iterable[RewardSpec]) -> None:
    """Record that the user trusts the custom reward files of `specs`, and the local modules
    they import, as they are now. StorageError (DiskFullError) when the record cannot be
    written."""
    files = _reward_files(specs)
    if not files:
        return
    trusted = {**_trusted(), **{p: _code_hashes(p) for p in files}}
    atomic_write_json(state_file(trust_file_path()), trusted)


def check_reward_trust(specs: Iterable[RewardSpec], hint: str, trust: bool = False) -> None:
    """Raise UntrustedRewardError (with `hint`, how to trust) when a custom reward file of
    `specs` is not trusted as it is now; `trust`: the user trusts them now (record it first)."""
    specs = list(specs)
    if trust:
        trust_reward_files(specs)
    files = untrusted_reward_files(specs)
    if files:
        raise UntrustedRewardError(
            f"This run uses reward code from {', '.join(files)}, which you have not trusted "
            "(or which changed since you did). A reward file runs as Python with your rights. "
            + TRUST_SCOPE, hint)


# ---- the scorer -------------------------------------------------------------------------------------

class RewardScorer:
    """Scores completions with a list of reward specs: `score(items)` -> (n, K) raw values.

    Use as a context manager (or call `close()`) so custom reward processes end.
    """

    def __init__(self, specs: Sequence[RewardSpec], answer_field: str = "answer",
                 timeout: float = DEFAULT_TIMEOUT_S, source: str = "prompts"):
        if not specs:
            raise ConfigError("A GRPO run needs at least one reward function.",
                              "Add --reward exact (or regex:..., a .py file, ...).")
        for spec in specs:
            spec.validate()
        self.specs = tuple(specs)
        self.answer_field = answer_field
        self.source = source
        labels = []
        for spec in self.specs:          # unique labels: exact, exact#2, ...
            label, n = spec.label, 2
            while label in labels:
                label, n = f"{spec.label}#{n}", n + 1
            labels.append(label)
        self.names = tuple(labels)
        self.weights = np.array([s.weight for s in self.specs], np.float64)
        self._custom = {i: RewardProcess(s.arg, s.function, timeout, self.names[i])
                      for i, s in enumerate(self.specs) if s.kind == "file"}

    def check_row(self, row: dict) -> str | None:
        """Why a row cannot be scored (a missing or non-numeric reference), or None."""
        field = self.answer_field
        for spec in self.specs:
            if spec.needs_answer and row.get(field) is None:
                return f'no "{field}" field (the {spec.label} reward compares with it)'
            if spec.kind == "numeric" and parse_number(row[field]) is None:
                return f'"{field}" is {row[field]!r}, not a number (the numeric reward needs one)'
            if spec.kind == "exact" and isinstance(row[field], (dict, list)):
                return f'"{field}" must be a string or a number'
        return None

    def score(self, items: Sequence[ScoreItem]) -> np.ndarray:
        """Raw values (n, K) of every function on every item (the total is values @ weights)."""
        out = np.zeros((len(items), len(self.specs)), np.float64)
        for k, spec in enumerate(self.specs):
            custom = self._custom.get(k)
            for i, item in enumerate(items):
                where = f"on row {item.row_index} (line {item.line} of {self.source})"
                if custom is not None:
                    out[i, k] = custom(item.prompt, item.completion, item.row, where)
                else:
                    out[i, k] = _builtin(spec, item, self.answer_field)
        return out

    def close(self) -> None:
        for custom in self._custom.values():
            custom.close()

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
