"""Chat templates: the real templates in tests/data/templates, the sandbox, HF's helpers, spans."""

from __future__ import annotations


import pytest

from app.engine.text.chat_template import (DEFAULT_CHAT_TEMPLATE, chat_prompt_ids,
                                           generation_prompt_ids, render_chat, render_chat_spans)
from app.engine.errors import ConfigError, TemplateError
from app.engine.io.gguf import read_gguf
from app.engine.text.tokenizer import Tokenizer, load_tokenizer
from tests.conftest import TEMPLATES, VOCAB

TEMPLATES = TEMPLATES
TEMPLATE_NAMES = sorted(p.stem for p in TEMPLATES.glob("*.jinja"))
VOCAB = VOCAB

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is 6."},
]

# The end-of-turn text each template puts after an assistant message, and the stop texts that
# identify it when the defaults (eos_token "</s>" and llama.cpp's end-of-generation texts) do not
# (in use they come from the model's tokenizer). None: the template leaves the final assistant
# message open (a prefill), so only the earlier turn has a marker.
MARKERS = {
    "Apertus-8B-Instruct": ("<|assistant_end|>", {"<|assistant_end|>"}, None),
    "ByteDance-Seed-OSS": ("<seed:eos>", {"<seed:eos>"}, ...),
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use":
        ("<|END_RESPONSE|><|END_OF_TURN_TOKEN|>", {"<|END_OF_TURN_TOKEN|>"}, ...),
    "GigaChat3-10B-A1.8B": ("<|message_sep|>", {"<|message_sep|>"}, ...),
    "Kimi-K2-Instruct": ("<|im_end|>", None, ...),
    "LFM2-8B-A1B": ("<|im_end|>", None, ...),
    "MiMo-VL": ("<|im_end|>", None, ...),
    "MiniMax-M3": ("[e~[", None, ...),
    "NVIDIA-Nemotron-Nano-v2": ("\n<SPECIAL_12>", {"<SPECIAL_12>"}, ...),
    "Qwen-QwQ-32B": ("<|im_end|>", None, ...),
    "Qwen-Qwen2.5-7B-Instruct": ("<|im_end|>", None, ...),
    "Qwen3-Coder": ("<|im_end|>", None, ...),
    "Spark2.5": ("<｜end▁of▁sentence｜>", None, ...),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("<｜end▁of▁sentence｜>", None, ...),
    "deepseek-ai-DeepSeek-V4-Flash-0731": ("<｜end▁of▁sentence｜>", None, ...),
    "google-gemma-2-2b-it": ("<end_of_turn>", None, ...),
    "ibm-granite-granite-3.3-2B-Instruct": ("<|end_of_text|>", None, ...),
    "inclusionai-ling-3.0-flash": ("<|role_end|>", {"<|role_end|>"}, ...),
    "meetkai-functionary-medium-v3.1": ("<|eot_id|>", None, ...),
    "meta-llama-Llama-3.1-8B-Instruct": ("<|eot_id|>", None, ...),
    "meta-llama-Llama-3.2-3B-Instruct": ("<|eot_id|>", None, ...),
    "microsoft-Phi-3.5-mini-instruct": ("<|end|>", None, ...),
    "mistralai-Ministral-3-14B-Reasoning-2512": ("</s>", None, ...),
    "mistralai-Mistral-Nemo-Instruct-2407": ("</s>", None, ...),
    "muse-glimmer": ("<|eot|>", {"<|eot|>"}, ...),
    "poolside-Laguna-S-2.1": ("</assistant>", {"</assistant>"}, ...),
    "tencent-Hy3": ("<｜hy_eos:opensource｜>", {"<｜hy_eos:opensource｜>"}, None),
    "upstage-Solar-Open-100B": ("<|end|>", None, ...),
}


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def test_every_template_is_covered():
    assert sorted(MARKERS) == TEMPLATE_NAMES


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_every_template_renders_a_system_user_assistant_chat(name):
    text = render_chat(template(name), CONVERSATION, bos_token="<s>", eos_token="</s>")
    for message in CONVERSATION[1:]:
        assert message["content"] in text
    prompt = render_chat(template(name), CONVERSATION[:4], bos_token="<s>", eos_token="</s>",
                         add_generation_prompt=True)
    assert "And 3+3?" in prompt and "It is 6." not in prompt
    # Mistral-Nemo puts the system prompt into the last user turn only, so a conversation that
    # ends with the assistant has none: the template's own choice, kept as is.
    assert "You are terse." in (prompt if name == "mistralai-Mistral-Nemo-Instruct-2407" else text)


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_every_template_gives_assistant_spans(name):
    marker, stop_texts, last_marker = MARKERS[name]
    extra = {"stop_texts": stop_texts | {"</s>"}} if stop_texts else {}
    chat = render_chat_spans(template(name), CONVERSATION, bos_token="<s>", eos_token="</s>", **extra)
    assert chat.text == render_chat(template(name), CONVERSATION, bos_token="<s>", eos_token="</s>")
    first, last = chat.assistant_spans
    assert (first.message_index, last.message_index) == (2, 4)
    assert chat.text[slice(*first.content)] == "4"
    assert chat.text[slice(*last.content)] == "It is 6."
    assert first.end_marker[0] == first.content[1] and last.end_marker[0] == last.content[1]
    assert chat.text[slice(*first.end_marker)] == marker
    assert chat.text[slice(*last.end_marker)] == (marker if last_marker is ... else "")


def test_system_prompt_is_merged_when_the_template_rejects_it():
    gemma = template("google-gemma-2-2b-it")
    with pytest.raises(ConfigError, match="System role not supported"):
        render_chat(gemma, [{"role": "system", "content": "Be terse."}])  # nothing to merge into
    chat = render_chat_spans(gemma, CONVERSATION, bos_token="<bos>")
    assert chat.text == (
        "<bos><start_of_turn>user\nYou are terse.\n\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n4<end_of_turn>\n"
        "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n"
        "<start_of_turn>model\nIt is 6.<end_of_turn>\n")
    assert [s.message_index for s in chat.assistant_spans] == [2, 4]


def test_template_errors_carry_the_templates_message():
    alternate = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
                 "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
                 "{{ m.content }}{% endfor %}")
    with pytest.raises(ConfigError, match="Conversation roles must alternate"):
        render_chat(alternate, [{"role": "assistant", "content": "hi"}])
    with pytest.raises(ConfigError, match="does not compile"):
        render_chat("{% for x in %}", CONVERSATION)


# ---- the default template ----------------------------------------------------------------------

def test_default_template_is_llamacpps_chatml():
    text = render_chat(None, CONVERSATION[:2], add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert render_chat(DEFAULT_CHAT_TEMPLATE, CONVERSATION[:2]) == text.removesuffix(
        "<|im_start|>assistant\n")


def test_default_template_spans():
    chat = render_chat_spans(None, CONVERSATION)
    first = chat.text.index("4<|im_end|>")
    assert chat.assistant_spans[0].content == (first, first + 1)
    assert chat.assistant_spans[0].end_marker == (first + 1, first + 1 + len("<|im_end|>"))
    last = chat.text.index("It is 6.")
    assert chat.assistant_spans[1].content == (last, last + 8)
    assert chat.text[slice(*chat.assistant_spans[1].end_marker)] == "<|im_end|>"


def test_spans_with_a_models_own_template_and_tokenizer():
    """The data pipeline's use: the GGUF's template, tokens and end-of-generation texts."""
    tok = load_tokenizer(VOCAB / "ggml-vocab-phi-3.gguf")
    messages = CONVERSATION[1:]
    chat = render_chat_spans(tok.chat_template, messages,
                             bos_token=tok.token_to_piece(tok.bos_id),
                             eos_token=tok.token_to_piece(tok.eos_id),
                             stop_texts={tok.token_to_piece(i) for i in tok.eot_ids})
    assert chat.text.startswith("<s><|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n4<|end|>\n")
    assert [chat.text[slice(*s.end_marker)] for s in chat.assistant_spans] == ["<|end|>", "<|end|>"]
    ids = tok.encode(chat.text, add_special=False, parse_special=True)
    assert ids.count(32007) == 4  # <|end|> became one control token per turn


def _phi3_adding_eos() -> Tokenizer:
    """phi-3's tokenizer (BOS added; its template writes the BOS too) with add_eos_token set."""
    meta = dict(read_gguf(VOCAB / "ggml-vocab-phi-3.gguf").metadata)
    meta["tokenizer.ggml.add_eos_token"] = True
    return Tokenizer.from_metadata(meta)


def test_generation_prompts_get_a_bos_and_never_an_eos():
    tok = _phi3_adding_eos()
    bos, eos = tok.bos_id, tok.eos_id
    assert tok.add_bos and tok.add_eos and tok.encode("Hello")[-1] == eos  # the flag is on
    assert generation_prompt_ids(tok, "Hello") == [bos] + tok.encode("Hello", add_special=False)
    chat = chat_prompt_ids(tok, "Hello")
    assert chat == generation_prompt_ids(tok, [{"role": "user", "content": "Hello"}])
    assert chat[0] == bos and chat.count(bos) == 1 and eos not in chat  # the template's BOS only
    plain_tok = load_tokenizer(VOCAB / "ggml-vocab-qwen2.gguf")         # adds no BOS
    assert not plain_tok.add_bos
    assert generation_prompt_ids(plain_tok, "Hi") == plain_tok.encode("Hi", add_special=False)
    # special-token texts of a plain prompt stay text unless parse_special
    assert generation_prompt_ids(tok, "<|end|>") != [bos, 32007]
    assert generation_prompt_ids(tok, "<|end|>", parse_special=True) == [bos, 32007]


def test_spans_skip_text_the_template_adds_before_the_content():
    think = ("{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}<think></think>"
             "{% endif %}{{ m.content | trim }}</{{ m.role }}>\n{% endfor %}"
             "{% if add_generation_prompt %}<assistant>{% endif %}")
    chat = render_chat_spans(think, [{"role": "user", "content": "Say think"},
                                     {"role": "assistant", "content": " think \n"}],
                             stop_texts={"</assistant>"})
    assert chat.text == "<user>Say think</user>\n<assistant><think></think>think</assistant>\n"
    span = chat.assistant_spans[0]
    assert chat.text[slice(*span.content)] == "think"
    assert span.content[0] == chat.text.index("</think>") + len("</think>")
    assert chat.text[slice(*span.end_marker)] == "</assistant>"


@pytest.mark.parametrize("name, marker", [("Qwen-Qwen2.5-7B-Instruct", "<|im_end|>"),
                                          ("poolside-Laguna-S-2.1", "</assistant>")])
def test_spans_when_contents_look_like_markup(name, marker):
    """Contents equal to role names or to pieces of the markers must not confuse the spans."""
    messages = [{"role": "user", "content": "user"}, {"role": "assistant", "content": "assistant"},
                {"role": "user", "content": "end"}, {"role": "assistant", "content": "  user\n"},
                {"role": "user", "content": "im"}, {"role": "assistant", "content": "<|im_end|>"}]
    chat = render_chat_spans(template(name), messages, eos_token="</s>")
    assert [chat.text[slice(*s.content)] for s in chat.assistant_spans] == \
        ["assistant", "user", "<|im_end|>"]
    assert {chat.text[slice(*s.end_marker)].strip() for s in chat.assistant_spans} == {marker}


def test_spans_reject_a_template_that_rewrites_the_content():
    shout = "{% for m in messages %}{{ m.content | upper }}{% endfor %}"
    with pytest.raises(ConfigError, match="assistant message 1"):
        render_chat_spans(shout, [{"role": "user", "content": "hi"},
                                  {"role": "assistant", "content": "hello"}])


# ---- the sandbox and HF's template environment -------------------------------------------------

@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages.append(1) }}",
    "{{ (messages | first).update({'role': 'x'}) }}",
])
def test_sandbox_refuses_escapes_and_mutation(source):
    with pytest.raises(ConfigError, match="unsafe"):
        render_chat(source, [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("source", ["{{ 'x' * 100000000 }}", "{{ 9 ** 99999 }}"])
def test_sandbox_refuses_huge_values(source):  # more in test_template_budget.py
    with pytest.raises(TemplateError, match="exceeded its budget"):
        render_chat(source, [{"role": "user", "content": "hi"}])


def test_hf_template_environment():
    messages = [{"role": "user", "content": "<é>"}]
    assert render_chat("{{ messages[0] | tojson }}", messages) == '{"role": "user", "content": "<é>"}'
    assert render_chat("{{ {'b': 1, 'a': [2]} | tojson(indent=2, sort_keys=True) }}", messages) == \
        '{\n  "a": [\n    2\n  ],\n  "b": 1\n}'
    assert len(render_chat("{{ strftime_now('%Y-%m-%d') }}", messages)) == 10
    assert render_chat("{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}"
                       "{% endfor %}", messages) == "012"
    # trim_blocks drops the newline after a tag, lstrip_blocks the indentation before one
    assert render_chat("{% if true %}\n    {% if true %}\nx\n    {% endif %}\n{% endif %}", messages) == "x\n"
    assert render_chat("{% generation %}{{ messages[0].content }}{% endgeneration %}", messages) == "<é>"
    assert render_chat("{{ tools is none }} {{ documents is none }} {{ add_generation_prompt }}",
                       messages) == "True True False"
    assert render_chat("{{ bos_token }}{{ enable_thinking }}", messages, bos_token="<s>",
                       enable_thinking=False) == "<s>False"


def test_a_chat_template_file_is_read_checked_and_named_in_its_errors(tmp_path):
    """`train --chat-template FILE` and New run's Chat template (issue 29 item 4)."""
    from app.engine.text.chat_template import read_chat_template
    good = tmp_path / "t.jinja"
    good.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert read_chat_template(good) == good.read_text()
    for name, content, words in (("open.jinja", b"{% for m in messages %}", "does not compile"),
                                 ("latin1.jinja", b"caf\xe9", "not UTF-8"),
                                 ("empty.jinja", b"  \n", "is empty")):
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ConfigError) as e:
            read_chat_template(path)
        assert words in e.value.message and name in e.value.message
    with pytest.raises(ConfigError, match="folder"):
        read_chat_template(tmp_path)
