"""Reward functions: the CLI grammar, the built-ins, the process for custom Python rewards, and
which reward files are trusted."""

from __future__ import annotations

import os
import textwrap
import time

import pytest

from app.engine.errors import ConfigError, EngineError
from app.engine.training.reward_functions import (RewardError, RewardProcess, RewardScorer,
                                                  RewardSpec, ScoreItem, UntrustedRewardError,
                                                  check_reward_trust, last_number, normalize_text,
                                                  parse_reward, reward_code_files, trust_file_path,
                                                  trust_reward_files, untrusted_reward_files)

ROW = {"messages": [{"role": "user", "content": "What is 47 + 38?"}], "answer": "85"}


def item(completion, row=ROW, n_tokens=3, max_new=8, index=4, line=5):
    return ScoreItem("What is 47 + 38?", completion, row, index, line, n_tokens, max_new)


def score(spec, *completions, **kw):
    with RewardScorer([spec] if isinstance(spec, RewardSpec) else spec) as scorer:
        return scorer.score([item(c, **kw) for c in completions])[:, 0].tolist()


@pytest.mark.parametrize("text, want", [
    ("exact", RewardSpec("exact")),
    ("exact:2", RewardSpec("exact", 2.0)),
    ("exact:tag=answer:0.5", RewardSpec("exact", 0.5, tag="answer")),
    ("numeric:tol=0.5:3", RewardSpec("numeric", 3.0, tolerance=0.5)),
    ("regex:^\\d+$", RewardSpec("regex", 1.0, arg="^\\d+$")),
    ("regex:a:b:2", RewardSpec("regex", 2.0, arg="a:b")),
    ("format", RewardSpec("format", 1.0, arg="answer")),
    ("format:ans:2", RewardSpec("format", 2.0, arg="ans")),
    ("length:8", RewardSpec("length", 1.0, target=8)),
    ("length:8:0.5", RewardSpec("length", 0.5, target=8)),
    ("exact:name=strict", RewardSpec("exact", name="strict")),
])
def test_cli_grammar(text, want):
    assert parse_reward(text) == want


def test_cli_grammar_files_and_errors(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def reward(prompt, completion, **row):\n    return 1.0\n")
    spec = parse_reward(f"{f}:0.25")
    assert (spec.kind, spec.arg, spec.weight, spec.label) == ("file", str(f), 0.25, "my_reward")
    assert parse_reward(f"file:{f}") == RewardSpec("file", arg=str(f))
    for bad in ("nonsense", "exact:foo", "regex:(", "numeric:tol=x", str(tmp_path / "no.py")):
        with pytest.raises(ConfigError):
            parse_reward(bad)
    assert RewardSpec.from_dict(spec.to_dict()) == spec


def test_exact_normalises_whitespace_and_is_strict_otherwise():
    assert score(RewardSpec("exact"), "85", " 85 \n", "8 5", "85.", "The answer is 85") == \
        [1.0, 1.0, 0.0, 0.0, 0.0]
    assert normalize_text("  a \n\t b ") == "a b"
    tagged = RewardSpec("exact", tag="answer")
    assert score(tagged, "so <answer> 85 </answer>", "85", "<answer>9</answer><answer>85</answer>") \
        == [1.0, 0.0, 1.0]
    assert score(RewardSpec("exact"), "85", row={"answer": 85}) == [1.0]    # numbers as text


def test_numeric_takes_the_last_number_with_tolerance():
    assert score(RewardSpec("numeric"), "47 + 38 = 85", "85.0", "84", "none", "1,085") == \
        [1.0, 1.0, 0.0, 0.0, 0.0]
    assert score(RewardSpec("numeric", tolerance=1.0), "84", "83") == [1.0, 0.0]
    assert score(RewardSpec("numeric"), "it is 1,234.5", row={"answer": "1234.5"}) == [1.0]
    assert last_number("-3 and 2.5e3") == 2500.0


def test_regex_format_and_length():
    assert score(RewardSpec("regex", arg=r"^\d+$"), "85", "x85") == [1.0, 0.0]
    assert score(RewardSpec("format", arg="answer"), "<answer>85</answer>", "<answer> </answer>",
                 "85") == [1.0, 0.0, 0.0]
    length = RewardSpec("length", target=2)
    with RewardScorer([length]) as s:
        got = s.score([item("x", n_tokens=n, max_new=10) for n in (1, 2, 6, 10)])[:, 0]
    assert got.tolist() == [0.0, 0.0, -0.5, -1.0]


def test_weighted_total_and_unique_labels():
    specs = [RewardSpec("exact", 2.0), RewardSpec("numeric", 0.5), RewardSpec("exact", 1.0)]
    with RewardScorer(specs) as s:
        raw = s.score([item("85"), item("= 85!")])
        assert s.names == ("exact", "numeric", "exact#2")
        assert (raw @ s.weights).tolist() == [3.5, 0.5]


def test_rows_without_a_usable_reference_are_named():
    s = RewardScorer([RewardSpec("numeric")])
    assert "no \"answer\" field" in s.check_row({"prompt": "x"})
    assert "not a number" in s.check_row({"prompt": "x", "answer": "eighty"})
    assert s.check_row(ROW) is None
    assert RewardScorer([RewardSpec("regex", arg="x")]).check_row({"prompt": "x"}) is None


# ---- custom rewards in their own process -----------------------------------------------------------

def write(tmp_path, body, name="my_reward.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_custom_reward_gets_prompt_completion_and_row(tmp_path):
    path = write(tmp_path, """
        import helper                      # the file's folder is importable
        def reward(prompt, completion, **row):
            print("noise on stdout must not break the protocol")
            return helper.BONUS + float(completion.strip() == row["answer"]) + len(prompt) * 0
    """)
    (tmp_path / "helper.py").write_text("BONUS = 0.5\n")
    spec = RewardSpec("file", 2.0, arg=path)
    with RewardScorer([spec]) as s:
        raw = s.score([item("85"), item("86"), item("85", row={**ROW, "prompt": "clash"})])
    assert raw[:, 0].tolist() == [1.5, 0.5, 1.5]


def test_custom_reward_numpy_and_int_returns(tmp_path):
    path = write(tmp_path, """
        import numpy as np
        def reward(prompt, completion, **row):
            return np.float32(0.25) if completion == "a" else 3
    """)
    with RewardScorer([RewardSpec("file", arg=path)]) as s:
        assert s.score([item("a"), item("b")])[:, 0].tolist() == [0.25, 3.0]


def test_exception_fails_with_the_functions_traceback(tmp_path):
    path = write(tmp_path, """
        def helper(x):
            return {}[x]
        def reward(prompt, completion, **row):
            return helper(completion)
    """)
    with RewardScorer([RewardSpec("file", arg=path)], source="prompts.jsonl") as s:
        with pytest.raises(RewardError) as e:
            s.score([item("oops", index=7, line=8)])
    msg = e.value.message
    assert "reward() in my_reward.py raised an exception on row 7 (line 8 of prompts.jsonl)" in msg
    assert "KeyError: 'oops'" in msg and "in helper" in msg and "return {}[x]" in msg
    assert "<string>" not in msg                           # the bootstrap's own frame is trimmed
    assert isinstance(e.value, EngineError) and e.value.kind == "reward"


def test_timeout_kills_the_process(tmp_path):
    path = write(tmp_path, """
        import time
        def reward(prompt, completion, **row):
            if completion == "slow":
                time.sleep(60)
            return 1.0
    """)
    r = RewardProcess(path, timeout=1.0)
    assert r("p", "fast", {}, "on row 0") == 1.0
    pid = r._proc.pid
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"timed out after 1 s on row 3"):
        r("p", "slow", {}, "on row 3")
    assert time.monotonic() - t0 < 5
    assert r._proc is None
    with pytest.raises(ProcessLookupError):
        for _ in range(50):                                # killed and reaped
            os.kill(pid, 0)
            time.sleep(0.05)
    assert r("p", "fast", {}, "on row 4") == 1.0           # a new process on the next call
    r.close()


@pytest.mark.parametrize("value, message", [
    ("'high'", "returned 'high' (a str, not a number)"),
    ("None", "returned None (a NoneType, not a number)"),
    ("True", "returned True (a bool, not a number)"),
    ("float('nan')", "returned nan on row 4"),
    ("float('inf')", "returned inf on row 4"),
])
def test_non_numeric_and_non_finite_returns(tmp_path, value, message):
    path = write(tmp_path, f"def reward(prompt, completion, **row):\n    return {value}\n")
    with RewardScorer([RewardSpec("file", arg=path)]) as s:
        with pytest.raises(RewardError, match=message.replace("(", r"\(").replace(")", r"\)")):
            s.score([item("x")])


def test_files_that_cannot_be_used(tmp_path):
    no_fn = write(tmp_path, "def score(prompt, completion, **row):\n    return 1\n", "a.py")
    with pytest.raises(RewardError, match=r"a.py defines no function reward\(\)"):
        RewardProcess(no_fn)("p", "c", {}, "on row 0")
    broken = write(tmp_path, "import nonexistent_module_xyz\n", "b.py")
    with pytest.raises(RewardError, match="could not be loaded(.|\n)*ModuleNotFoundError"):
        RewardProcess(broken)("p", "c", {}, "on row 0")
    syntax = write(tmp_path, "def reward(:\n", "c.py")
    with pytest.raises(RewardError, match="SyntaxError"):
        RewardProcess(syntax)("p", "c", {}, "on row 0")


def test_a_crashing_function_does_not_take_the_caller_down(tmp_path):
    path = write(tmp_path, """
        import os, sys
        def reward(prompt, completion, **row):
            sys.stderr.write("about to die\\n")
            os._exit(3)
    """)
    with pytest.raises(RewardError, match=r"exited \(code 3\) on row 0(.|\n)*about to die"):
        RewardProcess(path)("p", "c", {}, "on row 0")


# ---- trust -------------------------------------------------------------------------------------------

def test_reward_files_run_only_once_trusted_as_they_are(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_QUEUE", str(tmp_path / "state" / "queue.sqlite3"))
    a = write(tmp_path, "def reward(prompt, completion, **row):\n    return 1\n", "a.py")
    b = write(tmp_path, "def reward(prompt, completion, **row):\n    return 2\n", "b.py")
    specs = [RewardSpec("exact"), RewardSpec("file", arg=a), RewardSpec("file", 0.5, arg=a),
             RewardSpec("file", arg=b), RewardSpec("file", arg=str(tmp_path / "missing.py"))]
    assert untrusted_reward_files(specs) == [a, b]      # each once; a missing file cannot run
    with pytest.raises(UntrustedRewardError, match=f"reward code from {a}, {b}") as e:
        check_reward_trust(specs, "the hint")
    assert e.value.kind == "untrusted_reward" and e.value.hint == "the hint"
    trust_reward_files(specs[:2])
    assert untrusted_reward_files(specs) == [b]
    assert trust_file_path() == tmp_path / "state" / "trusted-rewards.json"
    check_reward_trust(specs, "", trust=True)           # trusting now records them
    assert untrusted_reward_files(specs) == []
    with open(b, "a") as f:                             # changed since: trust again
        f.write("# edited\n")
    assert untrusted_reward_files(specs) == [b]
    trust_file_path().write_text("not json")            # an unreadable record trusts nothing
    assert untrusted_reward_files(specs) == [a, b]


def _reward_with_modules(folder):
    """main_rew.py importing helper.py, a package with a relative import, and the stdlib."""
    write(folder, "import json\nimport helper\nfrom pkg import sub\n\n"
                  "def reward(prompt, completion, **row):\n"
                  "    return helper.value() + sub.value()\n", "main_rew.py")
    write(folder, "def value():\n    return 1\n", "helper.py")
    (folder / "pkg").mkdir()
    write(folder / "pkg", "", "__init__.py")
    write(folder / "pkg", "from . import deep\n\ndef value():\n    return deep.VALUE\n", "sub.py")
    write(folder / "pkg", "VALUE = 2\n", "deep.py")
    return str(folder / "main_rew.py")


def test_trust_covers_the_local_modules_a_reward_file_imports(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_QUEUE", str(tmp_path / "state" / "queue.sqlite3"))
    main = _reward_with_modules(tmp_path)
    assert sorted(reward_code_files(main)) == sorted(
        str(tmp_path / f) for f in ("main_rew.py", "helper.py", "pkg/__init__.py", "pkg/sub.py",
                                    "pkg/deep.py"))           # json: not a local module
    specs = [RewardSpec("file", arg=main)]
    assert untrusted_reward_files(specs) == [main]
    trust_reward_files(specs)
    assert untrusted_reward_files(specs) == []
    assert RewardProcess(main)("p", "c", {}, "on row 0") == 3.0
    helper = tmp_path / "helper.py"
    helper.write_text("def value():\n    return 100\n")       # replaced beside a trusted file
    with pytest.raises(UntrustedRewardError) as e:
        check_reward_trust(specs, "the hint")
    assert f"reward code from {helper} (imported by main_rew.py)" in e.value.message
    assert "the local modules it imports by name" in e.value.message
    check_reward_trust(specs, "", trust=True)
    (tmp_path / "pkg" / "deep.py").write_text("VALUE = 5\n")  # two imports away, relative
    assert untrusted_reward_files(specs) == [f"{tmp_path / 'pkg' / 'deep.py'} "
                                             "(imported by main_rew.py)"]
    trust_reward_files(specs)
    helper.write_text("import extra\n\ndef value():\n    return extra.VALUE\n")
    write(tmp_path, "VALUE = 7\n", "extra.py")                # a module it newly imports
    assert untrusted_reward_files(specs) == [f"{helper} (imported by main_rew.py)",
                                             f"{tmp_path / 'extra.py'} (imported by main_rew.py)"]


def test_a_trust_record_of_the_file_alone_does_not_cover_its_modules(tmp_path, monkeypatch):
    import hashlib
    import json

    monkeypatch.setenv("WORKBENCH_QUEUE", str(tmp_path / "state" / "queue.sqlite3"))
    main = _reward_with_modules(tmp_path)
    trust_file_path().parent.mkdir()
    trust_file_path().write_text(json.dumps(                  # as an older workbench wrote it
        {main: hashlib.sha256(open(main, "rb").read()).hexdigest()}))
    assert str(tmp_path / "helper.py") + " (imported by main_rew.py)" in \
        untrusted_reward_files([RewardSpec("file", arg=main)])


def test_a_full_disk_while_trusting_is_a_clear_error(tmp_path, monkeypatch):
    from app.engine.runtime import files
    from app.engine.runtime.files import DiskFullError
    from tests.engine.runs.test_rundir import _full_disk_os

    monkeypatch.setenv("WORKBENCH_QUEUE", str(tmp_path / "state" / "queue.sqlite3"))
    trust_file = trust_file_path()
    specs = [RewardSpec("file", arg=_reward_with_modules(tmp_path))]
    monkeypatch.setattr(files, "os", _full_disk_os())
    with pytest.raises(DiskFullError, match="no space left in") as e:
        check_reward_trust(specs, "the hint", trust=True)
    assert "Free some space" in e.value.hint
    monkeypatch.undo()
    assert not trust_file.exists()


def test_resume_asks_again_when_a_module_of_a_trusted_reward_changed(tmp_path, monkeypatch,
                                                                       capsys):
    from app.cli.main import run_cli
    from app.engine.runs.rundir import RunDir
    from app.engine.training.grpo import GrpoConfig
    from tests.conftest import SAMPLE_DATA

    monkeypatch.setenv("WORKBENCH_QUEUE", str(tmp_path / "state" / "queue.sqlite3"))
    main = _reward_with_modules(tmp_path)
    rewards = (RewardSpec("file", arg=main),)
    config = GrpoConfig(model=str(SAMPLE_DATA / "tiny-moe.gguf"),
                        prompts=str(SAMPLE_DATA / "addition.jsonl"), rewards=rewards, max_steps=1)
    run = RunDir.create(tmp_path / "run", config.to_dict())
    trust_reward_files(rewards)                               # as `workbench grpo --reward` does
    (tmp_path / "helper.py").write_text("def value():\n    return 100\n")
    assert run_cli(["resume", str(run.path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'helper.py'} (imported by main_rew.py)" in err
    assert "--trust-reward-code" in err and not run.metrics()


def test_loading_a_reward_writes_no_bytecode_beside_it(tmp_path, monkeypatch):
    """Probe finding 10: `-r myrew.py` left __pycache__/myrew.cpython-311.pyc (and one for each
    module it imports) beside the file, a file the user did not name."""
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    path = write(tmp_path, """
        import helper
        def reward(prompt, completion, **row):
            return helper.BONUS
    """)
    (tmp_path / "helper.py").write_text("BONUS = 0.5\n")
    before = sorted(os.listdir(tmp_path))
    with RewardScorer([RewardSpec("file", 1.0, arg=path)]) as s:
        assert s.score([item("85")])[:, 0].tolist() == [0.5]
    assert sorted(os.listdir(tmp_path)) == before
