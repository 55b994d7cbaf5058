"""Ollama TEMPLATEs for the chat formats the workbench trains with.

The model's Jinja chat template (or, when the GGUF has none, the ChatML template training used:
app.engine.text.chat_template.DEFAULT_CHAT_TEMPLATE) is recognised as one of the common
families by its markers, and the family's Go template and stop strings are written. Ollama's
runner adds BOS itself, so templates never contain it. The Go template is then checked: it must
render sample conversations exactly as the Jinja template does (app.engine.export.gotemplate);
where it does not (a template that adds dates, tools or reasoning text), the export says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.engine.errors import ConfigError
from app.engine.export.gotemplate import render_go
from app.engine.text.chat_template import DEFAULT_CHAT_TEMPLATE, render_chat


@dataclass(frozen=True)
class Family:
    name: str
    markers: tuple[str, ...]            # all present in the Jinja source
    messages: str                        # Go template of the turns; {eos}: the model's EOS
    prompt: str                          # the generation prompt after them
    stops: tuple[str, ...]


_USER_FIRST_SYSTEM = '{{ if and $.System (eq $i 1) }}{{ $.System }}\n\n{{ end }}'
_DS_USER, _DS_ASSISTANT = "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>"
_DS_END = "<\uff5cend\u2581of\u2581sentence\uff5c>"
FAMILIES = (
    Family("ChatML", ("<|im_start|>",),
           "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}",
           "<|im_start|>assistant\n", ("<|im_start|>", "<|im_end|>")),
    Family("Gemma", ("<start_of_turn>",),
           '{{- range $i, $m := .Messages }}{{ if eq .Role "user" }}<start_of_turn>user\n'
           + _USER_FIRST_SYSTEM + "{{ .Content }}<end_of_turn>\n"
           '{{ else if eq .Role "assistant" }}<start_of_turn>model\n{{ .Content }}'
           "<end_of_turn>\n{{ end }}{{ end }}", "<start_of_turn>model\n", ("<end_of_turn>",)),
    Family("Llama 3", ("<|start_header_id|>",),
           "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n"
           "{{ .Content }}<|eot_id|>{{ end }}", "<|start_header_id|>assistant<|end_header_id|>\n\n",
           ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    Family("Phi", ("<|user|>", "<|end|>"),
           "{{- range .Messages }}<|{{ .Role }}|>\n{{ .Content }}<|end|>\n{{ end }}",
           "<|assistant|>\n", ("<|end|>", "<|user|>", "<|assistant|>")),
    Family("DeepSeek", ("\uff5cUser\uff5c",),
           '{{- .System }}{{ range .Messages }}{{ if eq .Role "user" }}' + _DS_USER
           + '{{ .Content }}{{ else if eq .Role "assistant" }}' + _DS_ASSISTANT
           + "{{ .Content }}" + _DS_END + "{{ end }}{{ end }}", _DS_ASSISTANT,
           (_DS_USER, _DS_ASSISTANT, _DS_END)),
    Family("Mistral", ("[INST]",),
           '{{- range $i, $m := .Messages }}{{ if eq .Role "user" }}[INST] '
           + _USER_FIRST_SYSTEM + '{{ .Content }} [/INST]{{ else if eq .Role "assistant" }}'
           "{{ .Content }}{eos}{{ end }}{{ end }}", "", ("[INST]", "[/INST]")),
)

PROBES = ([{"role": "user", "content": "Hi there"}],
          [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
          [{"role": "user", "content": "One"}, {"role": "assistant", "content": "Two"},
           {"role": "user", "content": "Three"}],
          [{"role": "system", "content": "S"}, {"role": "user", "content": "A"},
           {"role": "assistant", "content": "B"}, {"role": "user", "content": "C"}])


@dataclass
class OllamaTemplate:
    family: str | None
    template: str | None       # the Go TEMPLATE, None when no family was recognised
    stops: list[str]
    matches: bool              # renders every probe as the Jinja template does
    note: str                  # how it was chosen and checked, for the Modelfile and report


def family_of(chat_template: str) -> Family | None:
    for family in FAMILIES:
        if all(m in chat_template for m in family.markers):
            return family
    return None


def _render(chat_template: str, messages, eos: str, generation: bool = True) -> str:
    return render_chat(chat_template, list(messages), bos_token="", eos_token=eos,
                       add_generation_prompt=generation)


def _default_system(chat_template: str, eos: str) -> str | None:
    """The system prompt a ChatML template inserts when the chat has none (Qwen 2.5 does)."""
    text = _render(chat_template, PROBES[0], eos)
    head = "<|im_start|>system\n"
    if text.startswith(head) and "<|im_end|>" in text:
        return text[len(head):text.index("<|im_end|>")]
    return None


def _llama3_system_preamble(chat_template: str, eos: str) -> str | None:
    """Llama 3.1/3.2 templates open every chat with a system turn that starts with a preamble
    (knowledge cutoff, date; 3.2's date is the day it renders, so the export's): the Go
    template for that, or None."""
    head = "<|start_header_id|>system<|end_header_id|>\n\n"
    text = _render(chat_template, PROBES[1], eos)
    end = PROBES[1][0]["content"] + "<|eot_id|>"
    if not text.startswith(head) or end not in text:
        return None
    preamble = text[len(head):text.index(end)]
    if not preamble or "{{" in preamble:
        return None
    return (head + preamble + "{{ .System }}<|eot_id|>{{ range .Messages }}"
            '{{ if ne .Role "system" }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n'
            "{{ .Content }}<|eot_id|>{{ end }}{{ end }}")


def go_template(family: Family, chat_template: str, eos: str) -> str:
    """The family's Go template fitted to this Jinja template: its generation prompt (e.g.
    DeepSeek R1's `<think>`), Mistral's spacing, a ChatML default system prompt (Qwen 2.5), the
    system preamble of Llama 3.1/3.2."""
    template = family.messages.replace("{eos}", eos)
    with_prompt = _render(chat_template, PROBES[0], eos)
    without = _render(chat_template, PROBES[0], eos, generation=False)
    fits = with_prompt.startswith(without) and with_prompt != without
    generation = with_prompt[len(without):] if fits else family.prompt
    if family.name == "Mistral" and "[INST] " not in with_prompt:
        template = template.replace("[INST] ", "[INST]").replace(" [/INST]", "[/INST]")
    if family.name == "Llama 3":
        template = _llama3_system_preamble(chat_template, eos) or template
    if family.name == "ChatML":
        default = _default_system(chat_template, eos)
        if default is not None and "{{" not in default:
            template = ("{{- if not .System }}<|im_start|>system\n" + default
                        + "<|im_end|>\n{{ end }}" + template)
    return template + generation


def first_difference(chat_template: str, template: str, eos: str) -> str | None:
    """None when the Go template renders every probe conversation as the Jinja one does, else
    a description of the first that differs."""
    for messages in PROBES:
        try:
            want = _render(chat_template, messages, eos)
        except ConfigError as e:
            return f"the chat template fails on a sample conversation ({e.message})"
        got = render_go(template, messages)
        if got != want:
            roles = "/".join(m["role"] for m in messages)
            return f"a {roles} conversation renders {got!r} instead of {want!r}"
    return None


def ollama_template(chat_template: str | None, eos: str = "") -> OllamaTemplate:
    """The TEMPLATE and stop strings for the model's chat format (ChatML, the training
    template, when the GGUF has none), checked against the Jinja template."""
    source = "the GGUF's chat template"
    if not chat_template:
        chat_template, source = DEFAULT_CHAT_TEMPLATE, "ChatML, the template training used " \
                                                       "(the GGUF has none)"
    family = family_of(chat_template)
    if family is None:
        return OllamaTemplate(None, None, [], False,
                              f"{source} is not one of the families the workbench translates "
                              f"({', '.join(f.name for f in FAMILIES)})")
    template = go_template(family, chat_template, eos)
    diff = first_difference(chat_template, template, eos)
    if diff is None:
        note = f"{family.name}, from {source}; renders sample conversations exactly as it does"
    else:
        note = (f"{family.name}, from {source}; differs from it: {diff}")
    return OllamaTemplate(family.name, template, list(family.stops), diff is None, note)
