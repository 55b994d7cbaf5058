"""Chat templates under a budget: runaway templates fail fast and clearly (in `render_chat`, in
`workbench generate --chat` and `workbench lint` on a model file carrying one), real templates
stay far inside it, and random templates render or raise an EngineError, nothing else."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.engine.text import chat_template as ct
from app.engine.text.chat_template import render_chat
from app.engine.errors import ConfigError, EngineError, TemplateError
from app.engine.io.gguf import read_gguf, write_gguf
from tests.conftest import GOLDEN, REPO
from tests.fuzz import fuzz, fuzz_settings

ROOT = REPO
TEMPLATES = ROOT / "tests" / "data" / "templates"
HI = [{"role": "user", "content": "hi"}]

NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HUGE = {  # each would build about 2 GB (or a 2-gigabit integer) in one operation
    "center filter": "{{ 'a'|center(2000000000) }}",
    "printf width": "{{ '%2000000000d' % 1 }}",
    "printf star width": "{{ '%*d' % (2000000000, 1) }}",
    "printf precision": "{{ '%.2000000000f' % 1.0 }}",
    "str.center": "{{ 'a'.center(2000000000) }}",
    "str.format width": "{{ '{:>2000000000}'.format(1) }}",
    "nested format width": "{{ '{:>{w}}'.format(1, w=2000000000) }}",
    "string repeat": "{{ 'a' * 2000000000 }}",
    "list repeat": "{{ ['a'] * 2000000000 }}",
    "join of a huge list": "{{ (['x' * 8000000] * 1000) | join }}",
    "replace": "{{ ('x' * 1000000) | replace('x', 'y' * 1000000) }}",
    "indent": "{{ 'a\\n' | indent(2000000000) }}",
    "batch": "{{ [1] | batch(2000000000, 0) | list }}",
    "tojson indent": "{{ {'a': 1} | tojson(indent=2000000000) }}",
    "expandtabs": "{{ 'a\\tb'.expandtabs(2000000000) }}",
    "to_bytes": "{{ (1).to_bytes(2000000000, 'big') }}",
    "power": "{{ 2 ** 2000000000 }}",
    "filter by name": "{{ ['a'] | map('center', 2000000000) | list }}",
    "doubling with ~": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}"
                       "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "doubling with +": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}"
                       "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
    "squaring": "{% set ns = namespace(x=3) %}{% for i in range(60) %}"
                "{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x }}",
}
SLOW = {
    "nested loops": NESTED_LOOPS,
    "nested loops into a block": "{% set x %}" + NESTED_LOOPS.replace("{% endfor %}",
                                                                      "text{% endfor %}", 1)
                                 + "{% endset %}",
    "exponential macro": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
                         "{% endmacro %}{{ f(60) }}",
}


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


@pytest.mark.parametrize("source", HUGE.values(), ids=HUGE.keys())
def test_huge_values_are_refused_before_they_are_built(source):
    tracemalloc.start()
    try:
        with pytest.raises(TemplateError, match="exceeded its budget") as caught:
            render_chat(source, HI)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200 << 20  # bytes: nothing near the 2 GB asked for
    err = caught.value
    assert err.kind == "template" and "the cap is" in err.message
    assert err.message.startswith("The chat template '") or err.message.startswith(
        'The chat template "')  # names the template by its source
    assert "tokenizer.chat_template" in err.hint


@pytest.mark.parametrize("source", SLOW.values(), ids=SLOW.keys())
def test_runaway_loops_stop_within_the_budget(source):
    start = time.monotonic()
    with pytest.raises(TemplateError, match="more than .*(steps|s of rendering)"):
        render_chat(source, HI)
    assert time.monotonic() - start < ct.RENDER_DEADLINE_S + 1.0


def test_a_budget_error_is_not_retried_with_the_system_prompt_merged():
    """The system-prompt fallback renders again on a ConfigError; a runaway template must not
    be given a second budget."""
    calls = []
    real = ct._Budget

    class Counting(real):
        def __init__(self):
            super().__init__()
            calls.append(self)

    ct._Budget = Counting
    try:
        with pytest.raises(TemplateError):
            render_chat(NESTED_LOOPS, [{"role": "system", "content": "s"},
                                       {"role": "user", "content": "u"}])
    finally:
        ct._Budget = real
    assert len(calls) == 1


def _long_chat(n_messages: int = 2000, words: int = 800) -> list[dict]:
    """About 8 MB of text: some 2M tokens, beyond any context a run trains on."""
    roles = ["user", "assistant"] * (n_messages // 2)
    return [{"role": "system", "content": "S" * 4000}] + [
        {"role": role, "content": f"message {i} " + "word " * words} for i, role in enumerate(roles)]


def test_real_templates_stay_far_inside_the_budget():
    """The budgets' margins: every template of tests/data/templates on an 8 MB chat. Measured
    (2 cores): at most 0.1 s, 19,025 steps and 44M characters (NVIDIA-Nemotron-Nano-v2)."""
    used, seconds = [], []
    real = ct._Budget

    class Recording(real):
        def __init__(self):
            super().__init__()
            used.append(self)

    chat = _long_chat()
    ct._Budget = Recording
    try:
        for path in sorted(TEMPLATES.glob("*.jinja")):
            start = time.monotonic()
            render_chat(path.read_text(), chat, bos_token="<s>", eos_token="</s>")
            seconds.append(time.monotonic() - start)
    finally:
        ct._Budget = real
    assert max(seconds) < ct.RENDER_DEADLINE_S / 5
    assert max(b.steps for b in used) < ct.MAX_STEPS / 50
    assert max(b.chars for b in used) < ct.MAX_CHARS / 4


# ---- the command line, on a model file that carries the template ------------------------------

def _model_with_template(tmp_path: Path, source: str) -> Path:
    f = read_gguf(GOLDEN / "llama-f32.gguf")
    meta = {**f.metadata, "tokenizer.chat_template": source}
    path = tmp_path / "hostile.gguf"
    write_gguf(path, meta, {n: (f.raw(n), i.ggml_type) for n, i in f.tensors.items()},
               f.value_types)
    return path


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # bytes


def _workbench(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "app", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, preexec_fn=_limit_memory,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    return proc, time.monotonic() - start


@pytest.mark.parametrize("source", [NESTED_LOOPS, HUGE["center filter"], HUGE["printf width"]],
                         ids=["nested loops", "center", "printf"])
def test_generate_and_lint_stop_on_a_runaway_template(tmp_path, source):
    model = _model_with_template(tmp_path, source)
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                             {"role": "assistant", "content": "a"}]}) + "\n")
    for args in (["generate", "-m", str(model), "-p", "hi", "--chat", "-n", "1"],
                 ["lint", str(data), "-m", str(model)]):
        proc, seconds = _workbench(*args)
        assert proc.returncode == 2, proc.stderr
        assert "exceeded its budget" in proc.stderr and "hint:" in proc.stderr
        assert "Traceback" not in proc.stderr and "MemoryError" not in proc.stderr
        assert seconds < 30  # the interpreter's start and the model's load included


# ---- random templates --------------------------------------------------------------------------

_NUMBERS = st.sampled_from([0, 1, 3, 40, 1000, 100000, 2000000000])
_STRINGS = st.sampled_from(["'a'", "'ab\\n'", "'\\t'", "'%5d'", "'{:>9}'", "''"])


def _expressions() -> st.SearchStrategy[str]:
    leaves = st.one_of(_STRINGS, _NUMBERS.map(str), st.just("ns.s"), st.just("messages"),
                       _NUMBERS.map(lambda n: f"range({n})"))

    def grow(inner):
        return st.one_of(
            st.tuples(inner, _NUMBERS).map(lambda t: f"({t[0]} * {t[1]})"),
            st.tuples(inner, inner).map(lambda t: f"({t[0]} ~ {t[1]})"),
            st.tuples(inner, inner).map(lambda t: f"({t[0]} + {t[1]})"),
            st.tuples(inner, _NUMBERS).map(lambda t: f"({t[0]} ** {t[1]})"),
            st.tuples(inner, inner).map(lambda t: f"({t[0]} % {t[1]})"),
            st.tuples(inner, _NUMBERS).map(lambda t: f"({t[0]} | center({t[1]}))"),
            st.tuples(inner, _NUMBERS).map(lambda t: f"({t[0]} | indent({t[1]}))"),
            st.tuples(inner, inner).map(lambda t: f"({t[0]} | join({t[1]}))"),
            st.tuples(inner, inner).map(lambda t: f"({t[0]} | replace('a', {t[1]}))"),
            st.tuples(inner, _NUMBERS).map(lambda t: f"({t[0]} | batch({t[1]}, 0) | list)"),
            st.tuples(inner, _NUMBERS).map(lambda t: f"{t[0]}.ljust({t[1]})"),
            st.tuples(inner, inner).map(lambda t: f"'{{}}{{:>{{}}}}'.format({t[0]}, {t[1]})"),
            inner.map(lambda e: f"({e} | tojson)"), inner.map(lambda e: f"({e} | list)"))

    return st.recursive(leaves, grow, max_leaves=6)


def _statements() -> st.SearchStrategy[str]:
    expr = _expressions()
    simple = st.one_of(expr.map(lambda e: f"{{{{ {e} }}}}"),
                       expr.map(lambda e: f"{{% set ns.s = {e} %}}"), st.just("text"))

    def grow(inner):
        body = st.lists(inner, min_size=1, max_size=3).map("".join)
        return st.tuples(_NUMBERS, body).map(
            lambda t: f"{{% for i in range({t[0]}) %}}{t[1]}{{% endfor %}}")

    return st.recursive(simple, grow, max_leaves=5)


_SMALL_BUDGET = {"MAX_STEPS": 20_000, "RENDER_DEADLINE_S": 1.0, "MAX_LEN": 1 << 20,
                 "MAX_CHARS": 1 << 23}  # smaller caps, the same code: many examples a second


@fuzz
@fuzz_settings(100)
@given(st.lists(_statements(), min_size=1, max_size=3).map(
    lambda parts: "{% set ns = namespace(s='x') %}" + "".join(parts)))
def test_random_templates_render_or_raise_an_engine_error_within_the_budget(source):
    with pytest.MonkeyPatch.context() as mp:
        for name, value in _SMALL_BUDGET.items():
            mp.setattr(ct, name, value)
        start = time.monotonic()
        try:
            text = render_chat(source, HI)
        except TemplateError:
            pass
        except ConfigError as e:  # the template's own error (a type error, a bad format)
            assert not isinstance(e.__cause__, (MemoryError, RecursionError)), e.message
        else:
            assert len(text) <= _SMALL_BUDGET["MAX_CHARS"]
        assert time.monotonic() - start < _SMALL_BUDGET["RENDER_DEADLINE_S"] + 1.0


def test_a_budget_error_stops_the_caller_instead_of_skipping_a_row():
    """What the property test relies on: a budget error is an EngineError, not a ConfigError
    (the data pipeline skips a row on a ConfigError, and would pay the budget on every row)."""
    assert issubclass(TemplateError, EngineError) and not issubclass(TemplateError, ConfigError)
