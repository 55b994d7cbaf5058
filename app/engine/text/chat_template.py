"""Chat templates: render a model's `tokenizer.chat_template` the way HF transformers does.

A chat template is Jinja code taken from a model file, i.e. untrusted input. It runs in
`jinja2.sandbox.ImmutableSandboxedEnvironment` (no access to `_`-attributes, no mutation of the
lists and dicts we pass in), with the environment HF's `apply_chat_template` gives templates:
`trim_blocks` and `lstrip_blocks`, the loop-controls extension (`break`/`continue`), a
`{% generation %}` block, the globals `raise_exception` and `strftime_now`, HF's `tojson` (no
HTML escaping, non-ASCII kept, `indent`/`separators`/`sort_keys`), and the variables `messages`,
`tools`, `documents` (None unless given), `add_generation_prompt`, `bos_token`, `eos_token` and
any extra keyword (e.g. `enable_thinking`). Any failure while compiling or rendering a template
is the template's fault, so it surfaces as a `ConfigError` carrying the template's message.

Budgets: a template is code that can loop 10^10 times (`range` nested in `range`) or ask for a
2 GB string in one operation (`'a'|center(2000000000)`, `'%2000000000d' % 1`). Every render runs
under the budget below: each loop iteration, call, filter, intercepted operator (`* ** + %`),
`~` and output expression is a step that checks the step count, the characters produced so
far and a wall-clock deadline; operations that can build a value much larger than their inputs
(widths, repeats, joins, replacements, printf and format widths, big integers) are refused
before they allocate. A render over budget raises `TemplateError`, which stops the caller (a
run, `lint`, `generate`) instead of being charged again on the next row.

System prompts: some templates reject a system message or demand strictly alternating roles
(Gemma raises "System role not supported"). When rendering raises and the conversation starts
with a system message followed by a user message, we render again with the system text merged
into that user message (system, blank line, user), which is what those models are trained to
read. If that fails as well, the original error is raised.
"""

from __future__ import annotations

import json
import re
import string
import time
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache, wraps
from typing import Any, Iterable

import jinja2
from jinja2 import nodes, pass_context
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from app.engine.errors import ConfigError, TemplateError
from app.engine.runtime.inputs import open_input
from app.engine.text.tokenizer import END_OF_GENERATION_TEXTS

DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}"
)
"""ChatML, used when a model file has no `tokenizer.chat_template`.

Why ChatML: it is exactly the template llama.cpp falls back to for such models (`CHATML_TEMPLATE_SRC`
in common/chat.cpp), so an adapter trained with it is prompted the same way when the model is
served by llama.cpp; its role markers are plain text that any vocabulary can encode; and it is the
most widely used format (Qwen, many fine-tunes), so it is what users expect a default to be.
"""

_HINT = "The chat template in the model file is broken or does not support this conversation."

# ---- the budget -------------------------------------------------------------------------------
# Per render. Measured on the real templates in tests/data/templates (2 shared cores): a
# 5-message chat takes at most 0.7 ms and 64 steps; a 2,001-message chat of 8 MB (about 2M
# tokens, beyond any context a run trains on) at most 0.1 s, 19,025 steps and 44M characters
# built (test_template_budget.py checks the margins). MAX_LEN holds about 4M tokens of text.
RENDER_DEADLINE_S = 3.0    # wall clock per render
MAX_STEPS = 2_000_000      # loop iterations + calls + filters + operators + outputs
MAX_LEN = 1 << 24          # longest string (characters) or list (items) one operation may build
MAX_CHARS = 1 << 28        # characters built by all operations and outputs of one render
MAX_INT_BITS = 1 << 16     # largest integer an operation may build
MAX_INDENT = 64            # tojson's indent (characters per level)


class _OverBudget(Exception):
    """Raised inside a render that exceeds a budget; `_render` turns it into a TemplateError.
    (While compiling, Jinja's constant folding swallows it and leaves the node to the render.)"""


class _Budget:
    def __init__(self) -> None:
        self.deadline = time.monotonic() + RENDER_DEADLINE_S
        self.steps = 0
        self.chars = 0

    def step(self, chars: int) -> None:
        self.steps += 1
        self.chars += chars
        if self.steps > MAX_STEPS:
            raise _OverBudget(f"more than {MAX_STEPS:,} steps (loop iterations, calls, "
                              "filters and operators)")
        if self.chars > MAX_CHARS:
            raise _OverBudget(f"more than {MAX_CHARS:,} characters of text built in all")
        if time.monotonic() > self.deadline:
            raise _OverBudget(f"more than {RENDER_DEADLINE_S:g} s of rendering")


_BUDGET: ContextVar[_Budget | None] = ContextVar("chat_template_budget", default=None)


def _charge(chars: int = 0) -> None:
    """One step that built `chars` characters (a no-op outside a render: compile time)."""
    budget = _BUDGET.get()
    if budget is not None:
        budget.step(chars)


def _cap(size: Any, what: str) -> None:
    """Refuse, before it is built, a value of `size` characters or items."""
    if isinstance(size, int) and size > MAX_LEN:
        raise _OverBudget(f"{what} of {size:,} (the cap is {MAX_LEN:,})")


def _cap_bits(bits: int, what: str) -> None:
    if bits > MAX_INT_BITS:
        raise _OverBudget(f"{what} of about {bits:,} bits (the cap is {MAX_INT_BITS:,})")


def _produced(value: Any) -> Any:
    """Charge an operation's result: its length for strings and containers."""
    if isinstance(value, int):
        _cap_bits(value.bit_length(), "an integer")
    size = len(value) if isinstance(value, (str, bytes, list, tuple, dict, set)) else 0
    _cap(size, "a value")
    _charge(size)
    return value


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _joined(sep: str, items: Iterable) -> list[str]:
    """`items` as strings, refused as soon as joining them with `sep` would exceed the cap."""
    parts, size = [], 0
    for item in items:
        part = item if isinstance(item, (str, bytes)) else str(item)
        size += len(part) + len(sep)
        _cap(size, "a joined string")
        parts.append(part)
    return parts


def _replaced_len(s: str, old: str, new: str, count: Any = -1) -> int:
    """Length of `s.replace(old, new, count)`, computed without building it."""
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * (len(new) - len(old))


_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_widths(numbers: Iterable[str], values: Iterable[Any], what: str) -> None:
    """Widths and precisions written in a format (`numbers`), or taken from its arguments
    (`values`, when the format takes them from there)."""
    for n in numbers:
        _cap(int(n) if len(n) <= 18 else 10 ** 18, what)  # int() refuses 4,300 digits
    for value in values:
        _cap(value, what)


def _check_printf(fmt: str, args: Any) -> None:
    fields = _PRINTF_FIELD.findall(fmt)
    numbers = [n for field in fields for n in field if n.isdigit()]
    starred = any("*" in field for field in fields)
    values = (args if isinstance(args, tuple) else (args,)) if starred else ()
    _check_widths(numbers, values, "a printf width")


def _check_format(fmt: str, args: tuple, kwargs: dict) -> None:
    """str.format / format_map: widths in the format specs, or in the arguments of nested
    fields (`{:{width}}`)."""
    specs = [spec for _, _, spec, _ in string.Formatter().parse(fmt) if spec]
    nested = any("{" in spec for spec in specs)
    values = [*args, *kwargs.values(), *(v for a in args if isinstance(a, dict)
                                         for v in a.values())] if nested else ()
    _check_widths(re.findall(r"\d+", "".join(specs)), values, "a format width")


def _check_str_method(s: str | bytes, name: str, args: tuple, kwargs: dict) -> tuple:
    """Refuse a str/bytes method whose result would exceed the cap; returns the arguments (a
    join's items turned into strings)."""
    if name in ("center", "ljust", "rjust", "zfill"):
        _cap(_arg(args, kwargs, 0, "width", 0), f"a {name} width")
    elif name == "expandtabs":
        tab = "\t" if isinstance(s, str) else b"\t"
        _cap(len(s) + s.count(tab) * _arg(args, kwargs, 0, "tabsize", 8), "expanded tabs")
    elif name == "replace" and len(args) >= 2:
        _cap(_replaced_len(s, *args[:3]), "a replaced string")
    elif name == "join" and args:
        args = (_joined(s, args[0]), *args[1:])
    elif name in ("format", "format_map") and isinstance(s, str):
        _check_format(s, args, kwargs)
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        _cap(len(s) * longest, "a translated string")
    return args


def _check_call(func: Any, args: tuple, kwargs: dict) -> tuple:
    target = getattr(func, "__wrapped__", func)  # the sandbox wraps str.format
    owner, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
    if isinstance(owner, (str, bytes)):
        return _check_str_method(owner, name, args, kwargs)
    if isinstance(owner, int) and name == "to_bytes":
        _cap(_arg(args, kwargs, 0, "length", 1), "to_bytes length")
    return args


def _check_binop(operator: str, left: Any, right: Any) -> None:
    ints = isinstance(left, int) and isinstance(right, int)
    if operator == "**" and ints and right > 0 and abs(left) > 1:
        _cap_bits((left.bit_length() - 1) * right, "an integer power")
    elif operator == "*" and ints:
        _cap_bits(left.bit_length() + right.bit_length() - 1, "an integer product")
    elif operator == "*":
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(count, int):
                _cap(len(seq) * count, "a repetition")
    elif operator == "+" and isinstance(left, (str, bytes, list, tuple)) \
            and isinstance(right, (str, bytes, list, tuple)):
        _cap(len(left) + len(right), "a concatenation")
    elif operator == "%" and isinstance(left, str):
        _check_printf(left, right)


# Filters that can build much more than they are given; each check has the filter's signature
# (after any context argument) and returns the value the filter is to get.
def _center(value, width=80):
    _cap(width, "a center width")
    return value


def _indent(s, width=4, first=False, blank=False):
    per_line = len(width) if isinstance(width, str) else width
    if isinstance(per_line, int):
        _cap(len(str(s)) + per_line * (str(s).count("\n") + 1), "an indented string")
    return s


def _format(value, *args, **kwargs):
    if isinstance(value, str):
        _check_printf(value, kwargs or args)
    return value


def _replace(s, old, new, count=None):
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        _cap(_replaced_len(s, old, new, -1 if count is None else count), "a replaced string")
    return s


def _join(value, d="", attribute=None):
    return value if attribute is not None else _joined(str(d), value)


def _count(value, count, fill_with=None):
    _cap(count, "a batch or slice count")
    return value


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    width = len(indent) if isinstance(indent, str) else indent
    if isinstance(width, int) and width > MAX_INDENT:
        raise _OverBudget(f"a tojson indent of {width:,} (the cap is {MAX_INDENT})")
    return value


def _wordwrap(s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
    if isinstance(width, int) and isinstance(wrapstring, str):
        _cap(len(s) + (len(s) // max(width, 1) + 1) * len(wrapstring), "a wrapped string")
    return s


_FILTER_CHECKS = {"center": _center, "indent": _indent, "format": _format, "replace": _replace,
                  "join": _join, "batch": _count, "slice": _count, "tojson": _tojson,
                  "wordwrap": _wordwrap}


def _budgeted_filter(name: str, func):
    """`func` (a filter) charged to the budget, with its size check when it has one."""
    check = _FILTER_CHECKS.get(name)
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0  # context argument

    @wraps(func)  # keeps jinja_pass_arg
    def budgeted(*args, **kwargs):
        if check is not None and len(args) > skip:
            args = (*args[:skip], check(*args[skip:], **kwargs), *args[skip + 1:])
        return _produced(func(*args, **kwargs))

    return budgeted


@pass_context  # never folded at compile time
def _budgeted_loop(context, iterable, static_chars: int):
    """A `for` loop's iterable: each iteration is a step that may output the loop body's
    template text (`static_chars`)."""
    for item in iterable:
        _charge(static_chars)
        yield item


@pass_context
def _budgeted_concat(context, parts: list) -> str:
    """The `~` operator: the parts joined, refused before it would exceed the cap."""
    return _produced("".join(_joined("", parts)))


def _finalize(value: Any) -> str:
    """Every `{{ ... }}` output (as text, which Jinja would make of it anyway) is a step."""
    text = str(value)
    _charge(len(text))
    return text


class _Instrument(NodeTransformer):
    """Routes every `for` iterable and every `~` through the budgeted filters above."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        static = sum(len(data.data) for stmt in node.body
                     for data in stmt.find_all(nodes.TemplateData))
        node.iter = nodes.Filter(node.iter, "_budgeted_loop", [nodes.Const(static)], [], None,
                                 None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        self.generic_visit(node)
        return nodes.Filter(nodes.List(node.nodes, lineno=node.lineno), "_budgeted_concat", [],
                            [], None, None, lineno=node.lineno)


class _BudgetedCodeGenerator(CodeGenerator):
    def visit_Template(self, node: nodes.Template, frame=None) -> None:
        super().visit_Template(_Instrument().visit(node), frame)


# ---- the sandbox ------------------------------------------------------------------------------

class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: HF marks assistant text with it; renders its body
    in its own scope, as HF's `AssistantTracker` does."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller) -> str:
        return caller()


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with every call and the operators that can build big values
    checked and charged to the render's budget (and loops and `~`, by the code generator)."""

    code_generator_class = _BudgetedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context, operator, left, right):
        _check_binop(operator, left, right)
        return _produced(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's signature
        args = _check_call(__obj, args, kwargs)
        return _produced(super().call(__context, __obj, *args, **kwargs))


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _hf_tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """HF's `tojson`: plain `json.dumps`, unlike Jinja's HTML-escaping built-in filter."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols],
                   finalize=_finalize)
    env.filters["tojson"] = _hf_tojson
    env.filters = {name: _budgeted_filter(name, f) for name, f in env.filters.items()}
    env.filters["_budgeted_loop"] = _budgeted_loop
    env.filters["_budgeted_concat"] = _budgeted_concat
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    del env.globals["lipsum"]  # lipsum(n, min, max) builds text of any size
    return env


_ENV = _environment()


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateError as exc:
        raise ConfigError(f"The chat template does not compile: {exc}", _HINT) from exc


MAX_TEMPLATE_BYTES = 1 << 20   # a chat template file (the largest models' are ~10 KB)


def read_chat_template(path) -> str:
    """The chat template in the file `path` (UTF-8 Jinja, as a model's tokenizer.chat_template),
    checked to compile: what a run's data_config.chat_template holds instead of the model's
    (`workbench train --chat-template FILE`, New run's Chat template). A ConfigError names what
    is wrong: not a readable regular file, over 1 MiB, not UTF-8, not a template."""
    with open_input(path, "chat template", max_bytes=MAX_TEMPLATE_BYTES,
                    error=ConfigError) as f:
        data = f.read(MAX_TEMPLATE_BYTES + 1)
    try:
        source = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"The chat template {path} is not UTF-8 text (byte {exc.start}).",
                          "Save the template as UTF-8.") from None
    if not source.strip():
        raise ConfigError(f"The chat template {path} is empty.",
                          "Give a Jinja chat template, e.g. one from a model's "
                          "tokenizer_config.json.")
    try:
        _compile(source)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc.message}", "Fix the template file (Jinja, as in a "
                          "model's tokenizer_config.json).") from None
    return source


# ---- rendering --------------------------------------------------------------------------------

_BUDGET_HINT = ("A chat template is code from the model file, and this one runs away. Fix the "
                "model's tokenizer.chat_template, or give the run another template "
                "(data_config.chat_template in its config).")


def _describe(source: str | None) -> str:
    """How errors name a template: the default, or the start of its source."""
    if source is None:
        return "The default ChatML template"
    head = source.strip()[:60]
    return f"The chat template {head!r}" + ("..." if len(source.strip()) > 60 else "")


def _render(template: jinja2.Template, source: str | None, messages: list[dict],
            context: dict[str, Any], add_generation_prompt: bool) -> str:
    """One render under a fresh budget."""
    budget = _BUDGET.set(_Budget())
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **context)
    except _OverBudget as exc:
        raise TemplateError(f"{_describe(source)} exceeded its budget: {exc}.",
                            _BUDGET_HINT) from exc
    except Exception as exc:  # template code is untrusted input: any failure is the template's
        raise ConfigError(f"The chat template failed: {exc}", _HINT) from exc
    finally:
        _BUDGET.reset(budget)


def _merge_system_prompt(messages: list[dict]) -> list[dict] | None:
    """The conversation with a leading system message folded into the first user message, or
    None when there is no such pair to merge."""
    if len(messages) < 2 or messages[0].get("role") != "system" or messages[1].get("role") != "user":
        return None
    system, user = messages[0].get("content"), messages[1].get("content")
    if not isinstance(system, str) or not isinstance(user, str):
        return None
    return [{**messages[1], "content": f"{system}\n\n{user}"}, *messages[2:]]


@dataclass(frozen=True)
class _Conversation:
    """What a template is actually given: the messages (maybe with the system prompt merged) and
    the index each of them has in the caller's list."""

    template: jinja2.Template
    source: str | None            # None: the default template
    messages: list[dict]
    origin: list[int]
    context: dict[str, Any]

    def render(self, upto: int | None = None, add_generation_prompt: bool = False) -> str:
        return _render(self.template, self.source, self.messages[:upto], self.context,
                       add_generation_prompt)

    def replace_content(self, j: int, content: str) -> _Conversation:
        messages = [*self.messages[:j], {**self.messages[j], "content": content}, *self.messages[j + 1:]]
        return _Conversation(self.template, self.source, messages, self.origin, self.context)


def _conversation(template: str | None, messages: list[dict], bos_token: str, eos_token: str,
                  add_generation_prompt: bool, extra: dict[str, Any]) -> tuple[_Conversation, str]:
    """Render the whole conversation, applying the system-prompt fallback if the template raises."""
    compiled = _compile(template if template is not None else DEFAULT_CHAT_TEMPLATE)
    context = {"tools": None, "documents": None, **extra, "bos_token": bos_token, "eos_token": eos_token}
    conv = _Conversation(compiled, template, list(messages), list(range(len(messages))), context)
    try:
        return conv, conv.render(add_generation_prompt=add_generation_prompt)
    except ConfigError as first:
        merged = _merge_system_prompt(conv.messages)
        if merged is None:
            raise
        conv = _Conversation(compiled, template, merged, list(range(1, len(messages))), context)
        try:
            return conv, conv.render(add_generation_prompt=add_generation_prompt)
        except ConfigError:
            raise first from first.__cause__


def render_chat(template: str | None, messages: list[dict], *, bos_token: str = "",
                eos_token: str = "", add_generation_prompt: bool = False, **extra) -> str:
    """Render `messages` ([{"role": ..., "content": ...}, ...]) with a chat template.

    `template=None` uses `DEFAULT_CHAT_TEMPLATE`. Extra keywords become template variables
    (`tools`, `documents`, `enable_thinking`, ...). Raises ConfigError when the template fails,
    TemplateError when it exceeds its budget.
    """
    return _conversation(template, messages, bos_token, eos_token, add_generation_prompt, extra)[1]


# ---- assistant spans --------------------------------------------------------------------------

@dataclass(frozen=True)
class AssistantSpan:
    """Where one assistant message landed in the rendered text; spans are [start, end) offsets."""

    message_index: int            # index in the caller's `messages`
    content: tuple[int, int]      # the message's content as the template rendered it
    end_marker: tuple[int, int]   # end-of-turn text right after it, e.g. "<|im_end|>"; may be empty


@dataclass(frozen=True)
class RenderedChat:
    text: str
    assistant_spans: tuple[AssistantSpan, ...]


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix (binary search: slices compare in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


_SENTINEL = "\ue000\ue001"  # private-use characters: no template adds, trims or recases them


def _pinned_content(conv: _Conversation, text: str, j: int) -> tuple[int, int] | None:
    """Where message j's content (stripped of surrounding whitespace) is in `text`, found by
    rendering the conversation again with that content replaced by a sentinel: the template
    puts the sentinel exactly where it put the content, after any header or empty think block.
    None if the template treats the sentinel differently (it branches on the content)."""
    content = conv.messages[j].get("content")
    if not isinstance(content, str):
        return None
    needle = content.strip()
    probe = conv.replace_content(j, _SENTINEL).render()
    pos = probe.find(_SENTINEL)
    if pos < 0 or probe[:pos] != text[:pos]:
        return None
    for offset in (0, len(content) - len(content.lstrip())):  # trimmed or verbatim
        if text.startswith(needle, pos + offset):
            return pos + offset, pos + offset + len(needle)
    return None


def _content_span(conv: _Conversation, text: str, j: int) -> tuple[int, int] | None:
    """Assistant message j's content: pinned by the sentinel, or else its first occurrence after
    the point where the model starts writing the turn (where `text` stops matching `messages[:j]`
    rendered with the generation prompt)."""
    pinned = _pinned_content(conv, text, j)
    content = conv.messages[j].get("content")
    if pinned is not None or not isinstance(content, str):
        return pinned
    start = _common_prefix(text, conv.render(j, add_generation_prompt=True))
    pos = text.find(content.strip(), start)
    return (pos, pos + len(content.strip())) if pos >= 0 else None


def _next_content_start(conv: _Conversation, text: str, j: int, end: int) -> int:
    """A bound for turn j's end marker: where the next message's content starts (or the end)."""
    if j + 1 < len(conv.messages):
        following = _pinned_content(conv, text, j + 1)
        if following is not None and following[0] >= end:
            return following[0]
    return len(text)


def _first_stop_end(text: str, start: int, bound: int, stop_texts: Iterable[str]) -> int | None:
    """End of the earliest stop text in text[start:bound] (the longest of those starting at the
    same place), or None."""
    hits = []
    for stop in stop_texts:
        pos = text.find(stop, start, bound) if stop else -1
        if pos >= 0:
            hits.append((pos, -len(stop)))
    if not hits:
        return None
    pos, minus_len = min(hits)
    return pos - minus_len


def _assistant_span(conv: _Conversation, text: str, j: int,
                    stop_texts: Iterable[str]) -> AssistantSpan:
    """Span of assistant message j (see `render_chat_spans`)."""
    content = _content_span(conv, text, j)
    if content is None:
        raise ConfigError(
            f"Cannot find assistant message {conv.origin[j]} in the rendered chat: the template "
            "changes its text.", "Use a dataset format that does not rely on the chat template.")
    end = content[1]
    bound = _next_content_start(conv, text, j, end)
    marker_end = _first_stop_end(text, end, bound, stop_texts)
    if marker_end is None:  # no known stop text: whatever the template closes this turn with
        turn_end = min(bound, _common_prefix(text, conv.render(j + 1)))
        marker_end = end + len(text[end:turn_end].rstrip()) if turn_end > end else end
    return AssistantSpan(conv.origin[j], content, (end, marker_end))


def render_chat_spans(template: str | None, messages: list[dict], *, bos_token: str = "",
                      eos_token: str = "", add_generation_prompt: bool = False,
                      stop_texts: Iterable[str] | None = None, **extra) -> RenderedChat:
    """`render_chat` plus the character spans of each assistant message and its end marker.

    Loss masks should come from these spans, not from guessed token boundaries. They are found
    by rendering the conversation again, so they work with any template that inserts message
    contents as they are (possibly trimmed):

    * the content (stripped of surrounding whitespace) is where the template puts it: rendering
      with that message's content replaced by a sentinel shows the position, after any header
      or empty think block the template adds (fallback: the first occurrence after the point
      where `messages[:j]` rendered with the generation prompt stops matching the text);
    * the end marker runs from the content to the end of the first stop text, looked for only
      before the next message's content. Stop texts are what ends generation: pass the
      tokenizer's end-of-generation pieces (`token_to_piece` of `eot_ids`); by default they are
      `eos_token` and llama.cpp's end-of-generation texts ("<|im_end|>", "<end_of_turn>",
      "<|eot_id|>", "<|end|>", "</s>", ...). Text alone cannot tell "<|end|>" from the
      "<|user|>" that follows it, hence stop texts. With no stop text in reach, the marker is
      what the template appends to the turn when it is the last message (whitespace trimmed),
      found by rendering `messages[:j+1]`; it is empty for templates that leave a final
      assistant message open as a prefill, and the caller then has to append EOS itself.

    Raises ConfigError when the template fails or alters an assistant message's text.
    """
    conv, text = _conversation(template, messages, bos_token, eos_token, add_generation_prompt, extra)
    if stop_texts is None:
        stop_texts = {eos_token, *END_OF_GENERATION_TEXTS}
    spans = tuple(_assistant_span(conv, text, j, stop_texts) for j, m in enumerate(conv.messages)
                  if m.get("role") == "assistant")
    return RenderedChat(text, spans)


def generation_prompt_ids(tokenizer, prompt: str | list[dict],
                          parse_special: bool = False) -> list[int]:
    """Token ids for the model to continue: `prompt` a list of chat messages, rendered with the
    model's template (ChatML when it has none) plus the generation prompt, special-token texts
    parsed; or a plain text, tokenized as it is (special-token texts parsed with parse_special).

    BOS goes first when the tokenizer adds one and the ids do not already start with it (the
    template may write it). Never EOS, whatever the tokenizer's add_eos_token says: the model is
    to continue the prompt, not to see it ended.
    """
    tok = tokenizer
    if isinstance(prompt, str):
        ids = tok.encode(prompt, add_special=False, parse_special=parse_special)
    else:
        bos = tok.token_to_piece(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.token_to_piece(tok.eos_id) if tok.eos_id is not None else ""
        text = render_chat(tok.chat_template, prompt, bos_token=bos, eos_token=eos,
                           add_generation_prompt=True)
        ids = tok.encode(text, add_special=False, parse_special=True)
    if tok.add_bos and tok.bos_id is not None and ids[:1] != [tok.bos_id]:
        ids = [tok.bos_id] + ids
    return ids


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """`generation_prompt_ids` of a one-turn chat: the user's `prompt`."""
    return generation_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
