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

System prompts: some templates reject a system message or demand strictly alternating roles
(Gemma raises "System role not supported"). When rendering raises and the conversation starts
with a system message followed by a user message, we render again with the system text merged
into that user message (system, blank line, user), which is what those models are trained to
read. If that fails as well, the original error is raised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, Iterable

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from app.engine.errors import ConfigError
from app.engine.tokenizer import END_OF_GENERATION_TEXTS

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

_MAX_REPEAT = 1_000_000  # longest string/list a template may build with `*`
_HINT = "The chat template in the model file is broken or does not support this conversation."


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
    """The immutable sandbox, plus a cap on `*` and `**` so a template cannot exhaust memory."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
            raise SecurityError("exponent too large in chat template")
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int) \
                        and len(seq) * count > _MAX_REPEAT:
                    raise SecurityError("repetition too large in chat template")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """HF's `tojson`: plain `json.dumps`, unlike Jinja's HTML-escaping built-in filter."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateError as exc:
        raise ConfigError(f"The chat template does not compile: {exc}", _HINT) from exc


# ---- rendering --------------------------------------------------------------------------------

def _render(template: jinja2.Template, messages: list[dict], context: dict[str, Any],
            add_generation_prompt: bool) -> str:
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **context)
    except Exception as exc:  # template code is untrusted input: any failure is the template's
        raise ConfigError(f"The chat template failed: {exc}", _HINT) from exc


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
    messages: list[dict]
    origin: list[int]
    context: dict[str, Any]

    def render(self, upto: int | None = None, add_generation_prompt: bool = False) -> str:
        return _render(self.template, self.messages[:upto], self.context, add_generation_prompt)

    def replace_content(self, j: int, content: str) -> _Conversation:
        messages = [*self.messages[:j], {**self.messages[j], "content": content}, *self.messages[j + 1:]]
        return _Conversation(self.template, messages, self.origin, self.context)


def _conversation(template: str | None, messages: list[dict], bos_token: str, eos_token: str,
                  add_generation_prompt: bool, extra: dict[str, Any]) -> tuple[_Conversation, str]:
    """Render the whole conversation, applying the system-prompt fallback if the template raises."""
    compiled = _compile(template if template is not None else DEFAULT_CHAT_TEMPLATE)
    context = {"tools": None, "documents": None, **extra, "bos_token": bos_token, "eos_token": eos_token}
    conv = _Conversation(compiled, list(messages), list(range(len(messages))), context)
    try:
        return conv, conv.render(add_generation_prompt=add_generation_prompt)
    except ConfigError as first:
        merged = _merge_system_prompt(conv.messages)
        if merged is None:
            raise
        conv = _Conversation(compiled, merged, list(range(1, len(messages))), context)
        try:
            return conv, conv.render(add_generation_prompt=add_generation_prompt)
        except ConfigError:
            raise first from first.__cause__


def render_chat(template: str | None, messages: list[dict], *, bos_token: str = "",
                eos_token: str = "", add_generation_prompt: bool = False, **extra) -> str:
    """Render `messages` ([{"role": ..., "content": ...}, ...]) with a chat template.

    `template=None` uses `DEFAULT_CHAT_TEMPLATE`. Extra keywords become template variables
    (`tools`, `documents`, `enable_thinking`, ...). Raises ConfigError when the template fails.
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
