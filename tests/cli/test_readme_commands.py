"""The README's "Start the app (fresh machine)" commands, read from README.md so that they
cannot drift, run as a new user runs them (issue 28, point 1): a fresh HOME, no XDG_*
variables, no WORKBENCH_QUEUE, so the app finds no state folder and must make its own.

- The start line (`python3 -m venv .venv && . .venv/bin/activate && pip install -e . &&
  workbench`): the venv and the install are not redone here (the suite runs in that venv);
  the test checks that the line installs this project and ends in `workbench`, that
  `workbench` is this project's entry point, and that it opens the window (offscreen) in the
  fresh HOME, which then holds the queue it made.
- The first run: every `workbench ...` line of the block under it, whole (the training takes
  about 10 s on 2 cores), in a folder holding `sample_data` as the README's paths expect; the
  run must then be in `workbench runs list`, and the generation must answer as the README's
  comment line says it does (its first word, "Sure!": the style chat.jsonl teaches).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

README = REPO / "README.md"
SECTION = "## Start the app (fresh machine)"
TIMEOUT = 300


def readme_blocks(heading: str = SECTION) -> list[list[str]]:
    """The ```bash blocks of README.md's section `heading`, each as its lines with the
    continuation lines (a trailing backslash) joined."""
    text = README.read_text(encoding="utf-8")
    section = text.split(heading + "\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return [block.replace("\\\n", " ").splitlines() for block in blocks]


def first_run_block() -> list[str]:
    return next(b for b in readme_blocks() if any(l.startswith("workbench train") for l in b))


def fresh_user(home: Path) -> dict[str, str]:
    """The environment of a new user whose home is `home` (made here, empty)."""
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("XDG_") and k not in ("WORKBENCH_QUEUE", "WORKBENCH_CACHE_DIR")}
    return {**env, "HOME": str(home)}


def workbench(line: str) -> list[str]:
    """A README line `workbench ARGS` as this interpreter's `python -m app ARGS` (the same
    program: the README says so, and this venv's script may not be on PATH)."""
    words = shlex.split(line)
    assert words[0] == "workbench", line
    return [sys.executable, "-m", "app", *words[1:]]


def test_the_readme_is_parsed_as_the_user_reads_it():
    start = readme_blocks()[0]
    assert start == ["python3 -m venv .venv && . .venv/bin/activate && pip install -e . && "
                     "workbench"]
    train = shlex.split(next(l for l in first_run_block() if l.startswith("workbench train")))
    assert train[train.index("--alpha") + 1] == "16" and train[-2:] == ["-o", "runs/first"]


@pytest.mark.slow
def test_the_readme_start_line_opens_the_window_for_a_new_user(tmp_path):
    steps = readme_blocks()[0][0].split(" && ")
    assert "pip install -e ." in steps and steps[-1] == "workbench"
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^\[project\.scripts\]\nworkbench = "app\.__main__:main"$', pyproject, re.M)
    home = tmp_path / "home"
    env = {**fresh_user(home), "QT_QPA_PLATFORM": "offscreen"}
    window = subprocess.Popen(workbench(steps[-1]), cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    queue = home / ".local" / "share" / "gguf-workbench" / "queue.sqlite3"
    try:
        deadline = time.monotonic() + TIMEOUT
        while not queue.exists() and window.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)       # the window's first second after it opened its queue
        assert window.poll() is None, window.stdout.read()
    finally:
        window.kill()
        output = window.communicate(timeout=60)[0]
    assert queue.exists() and "Traceback" not in output, output


@pytest.mark.slow
def test_the_readme_first_run_trains_is_listed_and_generates_for_a_new_user(tmp_path):
    env = fresh_user(tmp_path / "home")
    work = tmp_path / "work"
    work.mkdir()
    (work / "sample_data").symlink_to(REPO / "sample_data")
    block = first_run_block()
    expected = next(l for l in block if l.startswith("# ")).split()[1]     # "Sure!"
    outputs = []
    for line in (l for l in block if l.startswith("workbench ")):
        done = subprocess.run(workbench(line), cwd=work, env=env, capture_output=True,
                              text=True, timeout=TIMEOUT)
        assert done.returncode == 0, f"{line}\n{done.stderr}"
        outputs.append(done.stdout)
    assert outputs[-1].startswith(expected), outputs[-1]
    listed = subprocess.run(workbench("workbench runs list"), cwd=work, env=env,
                            capture_output=True, text=True, timeout=TIMEOUT)
    row = next(l for l in listed.stdout.splitlines() if l.startswith("first "))
    assert "chat.jsonl" in row and row.endswith("done"), listed.stdout
