"""Exports: GGUF LoRA adapters, merged GGUF models, Ollama Modelfiles, run directories, the CLI,
and verification that flags a bad export. Round trips on every golden architecture; the golden
llama.cpp logits are the reference for what llama.cpp would compute with our files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from app.cli.main import run_cli
from app.engine.export import exporter as ex
from app.engine.errors import ConfigError, UnsupportedModelError
from app.engine.export.exporter import (ExportSource, export, import_adapter, ollama_template,
                                        parse_modelfile, source_from_adapter, source_from_run,
                                        verify_gguf_lora)
from app.engine.io.gguf import dequantize, quantize, read_gguf, write_gguf
from app.engine.model.lora import LoraAdapter, load_adapter
from app.engine.model.transformer import load_model
from app.engine.export.verify import ExportReport, engine_logits, llamacpp_python
from tests.conftest import GOLDEN, GOLDEN_MODELS, TEMPLATES
from tests.llamacpp_parity import assert_within, logit_bound
MOE = ("mixtral", "qwen2moe", "qwen3moe", "olmoe", "deepseek")


def _ref(name):
    return np.load(GOLDEN / f"{name}.npz")


def _source(name, qtype="f32"):
    return source_from_adapter(GOLDEN / f"{name}-lora.gguf", GOLDEN / f"{name}-{qtype}.gguf")


def _export(source, to, out, name, **kw):
    kw.setdefault("llamacpp", False)
    return export(source, to, out, prompt_tokens=_ref(name)["tokens"], **kw)


# ---- GGUF LoRA adapters ------------------------------------------------------------------------

@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_gguf_adapter_export_gives_llamacpp_golden_logits(tmp_path, name):
    """The golden adapter re-exported, and re-exported with scale 0.5 folded into alpha, gives
    llama.cpp's logits at user scale 1 (llama.cpp's adapter loader reads the same fields)."""
    ref, model = _ref(name), load_model(GOLDEN / f"{name}-f32.gguf")
    source = _source(name)
    for scale, key in ((1.0, "logits_f32_lora"), (0.5, "logits_f32_lora_half")):
        out = tmp_path / f"a-{scale}.gguf"
        report = _export(source, "gguf-lora", out, name, scale=scale)
        assert report.ok, report.to_text()
        assert report.max_abs_logit_diff < 1e-5
        f = read_gguf(out)
        assert f.metadata["general.type"] == "adapter" and f.metadata["adapter.type"] == "lora"
        assert f.metadata["general.architecture"] == model.config.arch
        assert f.value_types["adapter.lora.alpha"] == (6, None)          # FLOAT32
        assert f.metadata["adapter.lora.alpha"] == pytest.approx(8.0 * scale)
        assert {t.ggml_type for t in f.tensors.values()} == {0}
        f.close()
        reread = load_adapter(out)
        got = model.logits(ref["tokens"], adapter=reread, adapter_scale=1.0)
        assert_within(got, ref[key], logit_bound(model, ref["tokens"], reread), key)


@pytest.mark.parametrize("adapter_type", ["f16", "bf16", "q8_0"])
@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_gguf_adapter_types(tmp_path, name, adapter_type):
    source = _source(name)
    out = tmp_path / "a.gguf"
    report = _export(source, "gguf-lora", out, name, adapter_type=adapter_type)
    assert report.ok, report.to_text()
    f = read_gguf(out)
    want = {"f16": 1, "bf16": 30, "q8_0": 8}[adapter_type]
    for tname, info in f.tensors.items():
        if ".ffn_gate_inp." in tname:
            assert info.ggml_type == 0                        # routers stay F32
        elif adapter_type == "q8_0" and info.shape[-1] % 32:
            assert info.ggml_type == 1                        # rank-4 rows: F16 fallback
        else:
            assert info.ggml_type == want
    f.close()
    if adapter_type == "q8_0":
        assert any("instead of Q8_0" in w for w in report.warnings)
    drift = next(c for c in report.checks if c.name == "drift")
    assert drift.ok is None and drift.data["median_position_max_diff"] < 0.3
    reread = load_adapter(out)
    for tname, (a, b) in source.adapter.tensors.items():
        ra, rb = reread.tensors[tname]
        rel = {"f16": 1e-3, "bf16": 8e-3, "q8_0": 1e-2}[adapter_type]
        assert np.abs(ra - a).max() <= rel * np.abs(a).max() + 1e-7
        assert np.abs(rb - b).max() <= rel * np.abs(b).max() + 1e-7


def test_scale_folding_rules():
    a, b = np.ones((2, 4), np.float32), np.ones((3, 2), np.float32)
    ad = LoraAdapter(8.0, {"x": (a, b)})
    assert ex.fold_scale(ad, 0.5).alpha == 4.0
    zero = LoraAdapter(0.0, {"x": (a, b)})                     # alpha 0: scale = user scale
    assert ex.fold_scale(zero, 0.5).scale("x") == pytest.approx(zero.scale("x", 0.5))
    mixed = LoraAdapter(0.0, {"x": (a, b), "y": (np.ones((3, 4), np.float32),
                                                 np.ones((3, 3), np.float32))})
    folded = ex.fold_scale(mixed, 0.5)
    for n in mixed.tensors:
        np.testing.assert_allclose(folded.scale(n) * folded.tensors[n][1],
                                   mixed.scale(n, 0.5) * mixed.tensors[n][1])
    with pytest.raises(ConfigError):
        ex.fold_scale(ad, 0.0)


def test_rslora_run_alpha_is_folded(tmp_path):
    """rsLoRA: scale alpha/sqrt(r); the GGUF alpha must make llama.cpp's alpha/r equal it."""
    from app.engine.training.config import TrainConfig
    from app.engine.training.session import TrainSession

    model = load_model(GOLDEN / "qwen2moe-f32.gguf")
    session = TrainSession(model, TrainConfig(mode="lora", lora_rank=4, lora_alpha=8, rslora=True,
                                              lora_targets=("attention", "experts")))
    for a, b in session.adapter.tensors.values():
        b[...] = np.random.default_rng(0).normal(0, 0.1, b.shape)
    report = export(ex.source_from_session(session), "gguf-lora", tmp_path / "a.gguf",
                    llamacpp=False)
    assert report.ok, report.to_text()
    reread = load_adapter(tmp_path / "a.gguf")
    name = next(iter(reread.tensors))
    assert reread.scale(name) == pytest.approx(8 / 4 ** 0.5)


# ---- merged models -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_merged_f32_equals_base_plus_adapter(tmp_path, name):
    ref, model = _ref(name), load_model(GOLDEN / f"{name}-f32.gguf")
    out = tmp_path / "merged.gguf"
    report = _export(_source(name), "merged", out, name)
    assert report.ok, report.to_text()
    merged = load_model(out)
    live = model.logits(ref["tokens"], adapter=load_adapter(GOLDEN / f"{name}-lora.gguf"))
    got = merged.logits(ref["tokens"])
    bound = logit_bound(merged, ref["tokens"])     # W + s B A rounds apart from x W^T + s x A^T B^T
    assert_within(got, live, bound, "merged vs base + adapter")
    assert_within(got, ref["logits_f32_lora"], bound, "merged vs llama.cpp")
    meta = merged.metadata
    assert meta["general.name"] == model.metadata["general.name"] + " (fine-tuned)"
    for key, value in model.metadata.items():      # tokenizer, hyperparameters: all kept
        if key != "general.name":
            assert np.array_equal(np.asarray(meta[key]), np.asarray(value)), key
            assert merged.gguf.value_types[key] == model.gguf.value_types[key], key


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_merged_keeps_the_adapter_at_f16(tmp_path, name, qtype):
    """Changed tensors are stored F16 (re-quantizing them to the base's type would undo much of
    the adapter), the others byte for byte; the held-out NLL is within 1% of base + adapter."""
    ref = _ref(name)
    base_path = GOLDEN / f"{name}-{qtype}.gguf"
    source = _source(name, qtype)
    out = tmp_path / "merged.gguf"
    told = []
    report = _export(source, "merged", out, name, notify=told.append)
    assert report.ok, report.to_text()
    assert not report.warnings
    assert report.settings["type"] == "f16"      # the size told before writing, to the header
    assert report.settings["merged_size_bytes"] == pytest.approx(out.stat().st_size, abs=4096)
    assert len(told) == 1 and "writing the merged model" in told[0]
    kept = next(c for c in report.checks if c.name == "adapter kept")
    assert kept.ok and kept.data["relative_diff"] < 0.01
    base, merged = read_gguf(base_path), read_gguf(out)
    assert list(merged.tensors) == list(base.tensors)
    changed = set(source.adapter.tensors)
    for tname, info in base.tensors.items():
        if tname in changed:                      # F32 ones (routers) stay F32
            assert merged.tensors[tname].ggml_type == (0 if info.ggml_type == 0 else 1), tname
        else:
            assert merged.tensors[tname].ggml_type == info.ggml_type, tname
            assert np.array_equal(merged.raw(tname), base.raw(tname)), tname   # byte-identical
    adapter = source.adapter
    for tname in list(changed)[:4]:           # exactly F16(dequantized base + scale * B @ A)
        a, b, s = adapter.scaled(tname)
        delta = b @ a if a.ndim == 2 else np.matmul(b, a)
        want = quantize(base.array(tname) + np.float32(s) * delta, merged.tensors[tname].ggml_type)
        assert np.array_equal(merged.raw(tname), want), tname
    # F16 rounding of the merged weights moves the logits far less than quantizing the base
    live = load_model(base_path).logits(ref["tokens"], adapter=adapter, llamacpp_numerics=False)
    got = load_model(out).logits(ref["tokens"], llamacpp_numerics=False)   # as the report
    per_position = np.abs(got - live).max(axis=1)
    quant_noise = np.abs(ref[f"logits_{qtype}"] - ref["logits_f32"]).max(axis=1)
    assert np.median(per_position) < 0.5 * np.median(quant_noise)
    drift = next(c for c in report.checks if c.name == "drift")
    assert drift.data["max_abs_diff"] == pytest.approx(per_position.max(), abs=1e-5)


def test_merged_type_is_the_users_and_q8_0_must_keep_the_adapter(tmp_path, monkeypatch):
    source = _source("llama", "q4_0")
    report = _export(source, "merged", tmp_path / "q8.gguf", "llama", adapter_type="q8_0")
    assert report.ok, report.to_text()
    merged = read_gguf(tmp_path / "q8.gguf")
    assert merged.tensors["blk.0.attn_q.weight"].ggml_type == 8
    # a merge that lost the adapter (written with almost no scale) is not OK, and says why
    real = ex.write_merged
    monkeypatch.setattr(ex, "write_merged", lambda *a, **k: real(*a, **{**k, "scale": 1e-6}))
    report = _export(source, "merged", tmp_path / "lost.gguf", "llama", adapter_type="q8_0",
                     scale=3.0)
    kept = next(c for c in report.checks if c.name == "adapter kept")
    assert not report.ok and kept.ok is False
    assert "--type f16" in kept.detail and "base + adapter" in kept.detail


def _with_iq4_nl(tmp_path, names) -> Path:
    """A copy of llama-f32 whose `names` are stored as IQ4_NL, which gguf reads but cannot write."""
    f = read_gguf(GOLDEN / "llama-f32.gguf")
    rng = np.random.default_rng(3)
    tensors = {}
    for n, info in f.tensors.items():
        if n in names:
            rows = int(np.prod(info.shape[:-1]))
            blocks = np.zeros((rows, info.shape[-1] // 32, 18), np.uint8)
            blocks[..., :2] = np.frombuffer(np.float16(0.02).tobytes(), np.uint8)
            blocks[..., 2:] = rng.integers(0, 256, (rows, info.shape[-1] // 32, 16))
            tensors[n] = (blocks.reshape(*info.shape[:-1], -1), 20)
        else:
            tensors[n] = (f.raw(n), info.ggml_type)
    path = tmp_path / "llama-iq4nl.gguf"
    write_gguf(path, f.metadata, tensors, f.value_types)
    del tensors
    f.close()
    return path


def test_merged_tensor_of_a_type_gguf_cannot_write(tmp_path):
    """A changed IQ4_NL tensor (gguf reads it, cannot write it) is stored F16 like the others."""
    names = {"blk.0.attn_q.weight", "blk.1.ffn_down.weight", "blk.0.attn_k.weight"}
    base_path = _with_iq4_nl(tmp_path, names)
    source = source_from_adapter(GOLDEN / "llama-lora.gguf", base_path)
    report = _export(source, "merged", tmp_path / "m.gguf", "llama")
    assert report.ok, report.to_text()
    merged = read_gguf(tmp_path / "m.gguf")
    assert merged.tensors["blk.0.attn_q.weight"].ggml_type == 1
    assert merged.tensors["blk.0.attn_v.weight"].ggml_type == 0          # F32 stays F32
    assert set(report.settings["retyped_tensors"]) == names
    assert "IQ4_NL -> F16" in next(c for c in report.checks if c.name == "types").detail


def test_merged_untouched_quantized_tensor_keeps_its_bytes(tmp_path):
    base_path = _with_iq4_nl(tmp_path, {"blk.0.ffn_up.weight"})
    adapter = load_adapter(GOLDEN / "llama-lora.gguf")
    adapter.tensors.pop("blk.0.ffn_up.weight")
    source = ExportSource(str(base_path), adapter)
    report = _export(source, "merged", tmp_path / "m.gguf", "llama")
    assert report.ok and not report.warnings
    base, merged = read_gguf(base_path), read_gguf(tmp_path / "m.gguf")
    assert merged.tensors["blk.0.ffn_up.weight"].ggml_type == 20
    assert np.array_equal(merged.raw("blk.0.ffn_up.weight"), base.raw("blk.0.ffn_up.weight"))


def test_merged_full_and_hybrid_training(tmp_path):
    """Fully trained tensors replace the base ones (with an adapter on top for hybrid runs)."""
    name = "qwen3moe"
    model = load_model(GOLDEN / f"{name}-f32.gguf")
    rng = np.random.default_rng(0)
    names = ("blk.0.ffn_norm.weight", "blk.1.ffn_gate_inp.weight", "token_embd.weight")
    full = {n: model.gguf.array(n) * np.float32(1.1)
            + rng.normal(0, 0.01, model.gguf.tensors[n].shape).astype(np.float32) for n in names}
    tokens = _ref(name)["tokens"]
    for adapter in (None, load_adapter(GOLDEN / f"{name}-lora.gguf")):
        source = ExportSource(str(GOLDEN / f"{name}-f32.gguf"), adapter, full)
        report = _export(source, "merged", tmp_path / "m.gguf", name, overwrite=True)
        assert report.ok, report.to_text()
        want = engine_logits(model, tokens, adapter, 1.0, full)
        assert np.abs(want - model.logits(tokens, adapter)).max() > 0.1   # the full tensors count
        np.testing.assert_allclose(load_model(tmp_path / "m.gguf").logits(tokens), want, atol=1e-4)
    with pytest.raises(ConfigError, match="merged"):
        _export(source, "gguf-lora", tmp_path / "a.gguf", name)
    with pytest.raises(ConfigError, match="merged"):
        _export(ExportSource(source.model_path, None, full), "peft", tmp_path / "p", name)


# ---- Ollama ------------------------------------------------------------------------------------

CHATML_GO = ("{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n"
             "{{ end }}<|im_start|>assistant\n")


@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_ollama_modelfile(tmp_path, name):
    """ADAPTER where Ollama's llama.cpp runner runs the model; FROM the merged model where its
    own engine does (gemma3, qwen3moe); the training template (ChatML: the GGUFs have none)
    and its stops either way."""
    out = tmp_path / "ollama"
    report = _export(_source(name), "ollama", out, name)
    assert report.ok, report.to_text()
    text = (out / "Modelfile").read_text()
    parsed = parse_modelfile(text)
    assert parsed["stops"] == ["<|im_start|>", "<|im_end|>", "<|eos|>"]
    assert parsed["template"] == CHATML_GO
    assert "ChatML, the template training used (the GGUF has none)" in text
    tokens = _ref(name)["tokens"]
    model = load_model(GOLDEN / f"{name}-f32.gguf")
    if name in ex.OLLAMA_ENGINE_ARCHS:
        assert parsed["adapter"] is None
        assert not [ln for ln in text.splitlines() if ln.startswith("ADAPTER")]
        assert Path(parsed["from"]) == out / "model.gguf" and not (out / "adapter.gguf").exists()
        assert "refuses adapters" in text
        assert next(c for c in report.checks if c.name == "model adapter kept").ok
        got = load_model(out / "model.gguf").logits(tokens)
    else:
        assert parsed["adapter"] == "./adapter.gguf"
        assert parsed["from"] == str((GOLDEN / f"{name}-f32.gguf").absolute())
        got = model.logits(tokens, adapter=load_adapter(out / "adapter.gguf"))
    assert_within(got, _ref(name)["logits_f32_lora"], 10 * logit_bound(model, tokens), name)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
          "'<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{% elif "
           "m['role'] == 'user' %}{{ '[INST] ' }}{% if loop.index0 == 1 and messages[0]['role'] "
           "== 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}{{ m['content'] + "
           "' [/INST]' }}{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}")
FAMILY_TEMPLATES = {"ChatML": ["Qwen-Qwen2.5-7B-Instruct.jinja", "Qwen-QwQ-32B.jinja",
                               "Qwen3-Coder.jinja", "LFM2-8B-A1B.jinja", CHATML],
                    "Gemma": ["google-gemma-2-2b-it.jinja"],
                    "Phi": ["microsoft-Phi-3.5-mini-instruct.jinja"],
                    "DeepSeek": ["deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"],
                    "Llama 3": [LLAMA3, "meta-llama-Llama-3.1-8B-Instruct.jinja",
                                "meta-llama-Llama-3.2-3B-Instruct.jinja"],
                    "Mistral": [MISTRAL]}
CONVERSATION = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "Paris"},
                {"role": "user", "content": "And of Italy?"}]


@pytest.mark.parametrize("family,source", [(f, s) for f, ss in FAMILY_TEMPLATES.items()
                                           for s in ss])
def test_ollama_go_template_renders_as_the_jinja_one(family, source):
    """Each family's Go TEMPLATE renders a conversation exactly as the model's Jinja template
    (BOS left out: Ollama's runner adds it), by a renderer of the Go template subset."""
    from app.engine.export.gotemplate import render_go
    from app.engine.text.chat_template import render_chat

    jinja = (TEMPLATES / source).read_text() if source.endswith(".jinja") else source
    result = ollama_template(jinja, "</s>")
    assert result.family == family and result.matches, result.note
    for messages in (CONVERSATION, CONVERSATION[1:], CONVERSATION[1:2]):
        want = render_chat(jinja, messages, bos_token="", eos_token="</s>",
                           add_generation_prompt=True)
        assert render_go(result.template, messages) == want
    assert result.stops


def test_ollama_template_differences_are_said_not_written(tmp_path):
    """Mistral Nemo's template (the system prompt goes into the last user turn) is the Mistral
    family, but its Go template differs: no TEMPLATE is written, and the note says why."""
    jinja = (TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()
    result = ollama_template(jinja, "</s>")
    assert result.family == "Mistral" and not result.matches
    assert "differs from it: a system/user/assistant/user conversation" in result.note
    path = _with_chat_template(tmp_path, "qwen2", jinja)
    source = source_from_adapter(GOLDEN / "qwen2-lora.gguf", path)
    report = _export(source, "ollama", tmp_path / "o", "qwen2")
    assert report.ok, report.to_text()
    text = (tmp_path / "o" / "Modelfile").read_text()
    parsed = parse_modelfile(text)
    assert parsed["template"] is None and "# TEMPLATE not written: Mistral" in text
    assert parsed["stops"][:2] == ["[INST]", "[/INST]"]
    assert ollama_template("{{ messages }}").family is None
    training = ollama_template(None)
    assert training.template == CHATML_GO and training.matches


def test_go_template_renderer_subset():
    from app.engine.export.gotemplate import render_go

    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert render_go("{{ .System }}|{{ .Prompt }}", msgs) == "S|U"
    assert render_go("a  {{- range $i, $m := .Messages }} {{ $i }}{{ $m.Role }}{{ end -}}  b",
                     msgs) == "a 0system 1userb"
    assert render_go('{{ if eq .Prompt "X" }}x{{ else if not .System }}n{{ else }}e{{ end }}',
                     msgs) == "e"
    assert render_go('{{ if and $.System (eq 1 1) }}y{{ end }}', msgs) == "y"
    with pytest.raises(ValueError):
        render_go("{{ .Missing }}", msgs)


def _with_chat_template(tmp_path, name: str, template: str) -> Path:
    """A copy of a golden F32 model with tokenizer.chat_template set."""
    f = read_gguf(GOLDEN / f"{name}-f32.gguf")
    meta, types = dict(f.metadata), dict(f.value_types)
    meta["tokenizer.chat_template"] = template
    types["tokenizer.chat_template"] = (8, None)
    path = tmp_path / f"{name}-chat.gguf"
    write_gguf(path, meta, {n: (f.raw(n), i.ggml_type) for n, i in f.tensors.items()}, types)
    f.close()
    return path


def test_ollama_modelfile_with_chatml_template_and_merged_model(tmp_path):
    path = _with_chat_template(tmp_path, "qwen2", CHATML)
    full = {"blk.0.attn_norm.weight": np.full(32, 1.5, np.float32)}
    report = _export(ExportSource(str(path), None, full), "ollama", tmp_path / "o", "qwen2")
    assert report.ok, report.to_text()
    parsed = parse_modelfile((tmp_path / "o" / "Modelfile").read_text())
    assert parsed["template"] == CHATML_GO
    assert parsed["adapter"] is None and Path(parsed["from"]) == tmp_path / "o" / "model.gguf"


# ---- import, run directories, CLI --------------------------------------------------------------

def test_import_gguf_and_peft_adapters_to_continue_training(tmp_path):
    from app.engine.training.config import TrainConfig
    from app.engine.training.session import TrainSession

    model = load_model(GOLDEN / "mixtral-q8_0.gguf")
    tokens = _ref("mixtral")["tokens"]
    golden = import_adapter(GOLDEN / "mixtral-lora.gguf", model)
    _export(ExportSource(model.path, golden), "peft", tmp_path / "peft", "mixtral")
    peft = import_adapter(tmp_path / "peft", model)
    want = model.logits(tokens, golden)
    np.testing.assert_array_equal(model.logits(tokens, peft), want)
    session = TrainSession(model, TrainConfig(mode="lora", lora_rank=4), adapter=peft)
    assert session.adapter is peft and "blk.0.ffn_up_exps.weight.lora_a" in session.trainable
    with pytest.raises(Exception, match="'qwen2'"):
        import_adapter(GOLDEN / "qwen2-lora.gguf", model)


def _make_run(tmp_path, mode="lora", **train_kw):
    from app.engine.training.config import TrainConfig
    from app.engine.data.dataset import DataConfig
    from app.engine.training.sft import RunConfig, train
    from app.engine.runs.rundir import RunDir

    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"Expert {i % 4} routes token {i}."})
                              for i in range(12)) + "\n")
    tc = TrainConfig(mode=mode, lr=1e-2, lora_rank=4, lora_alpha=8, **train_kw)
    config = RunConfig(model=str(GOLDEN / "mixtral-q8_0.gguf"), data=str(data), train=tc,
                       data_config=DataConfig(context=32, val_fraction=0.0), epochs=0,
                       max_steps=2, norms_every=0)
    run = RunDir.create(tmp_path / "run", config.to_dict())
    assert train(config, lambda e: None, lambda: None, run.checkpoints_dir) == "done"
    return run


def test_cli_exports_a_run_directory(tmp_path, capsys):
    run = _make_run(tmp_path, lora_targets=("attention", "experts", "router"))
    source = source_from_run(run.path)
    assert source.checkpoint.endswith("step-2") and not source.full
    final = load_adapter(run.path / "adapter.gguf")            # what the run itself saved
    for name, (a, b) in final.tensors.items():
        np.testing.assert_array_equal(source.adapter.tensors[name][1], b)
    assert source.adapter.alpha == final.alpha
    assert source_from_run(run.path, step=2).checkpoint == source.checkpoint
    with pytest.raises(ConfigError, match="step 99"):
        source_from_run(run.path, step=99)
    for to in ("gguf-lora", "merged", "peft", "ollama"):
        assert run_cli(["export", str(run.path), "--to", to]) == 0, capsys.readouterr()
        out = capsys.readouterr().out
        assert out.startswith("OK") and "logits" in out
    exports = run.exports_dir
    assert (exports / "adapter-f32.gguf").is_file() and (exports / "merged.gguf").is_file()
    assert (exports / "peft" / "adapter_model.safetensors").is_file()
    assert (exports / "ollama" / "Modelfile").is_file()
    report = json.loads((exports / "adapter-f32.gguf.verify.json").read_text())
    assert report["ok"] and report["format"] == "gguf-lora"
    assert report["source"]["run_dir"] == str(run.path)
    assert {c["name"] for c in report["checks"]} >= {"format", "shapes", "scale", "tensors",
                                                     "logits", "llamacpp"}
    tokens = report["prompt_tokens"]
    model = load_model(GOLDEN / "mixtral-q8_0.gguf")
    np.testing.assert_array_equal(model.logits(tokens, load_adapter(exports / "adapter-f32.gguf")),
                                  model.logits(tokens, final))
    # elsewhere with --out: the report goes next to the export and into the run's exports/
    out = tmp_path / "elsewhere" / "a.gguf"
    assert run_cli(["export", str(run.path), "--to", "gguf-lora", "--out", str(out),
                    "--type", "q8_0", "--scale", "0.5", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["ok"] and printed["settings"]["scale"] == 0.5
    assert (tmp_path / "elsewhere" / "a.gguf.verify.json").is_file()
    assert (exports / "a.gguf.verify.json").is_file()
    assert load_adapter(out).alpha == pytest.approx(final.alpha * 0.5)


def test_cli_exports_an_adapter_and_reports_errors(tmp_path, capsys):
    out = tmp_path / "merged.gguf"
    assert run_cli(["export", "--adapter", str(GOLDEN / "deepseek-lora.gguf"), "--model",
                    str(GOLDEN / "deepseek-q4_0.gguf"), "--to", "merged", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "adapter kept" in printed.out and out.is_file()
    assert "writing the merged model" in printed.err
    assert (tmp_path / "merged.gguf.verify.json").is_file()
    assert run_cli(["export", "--adapter", str(GOLDEN / "deepseek-lora.gguf"), "--to",
                    "merged", "--out", str(out)]) == 2                        # no --model
    assert run_cli(["export", "--adapter", str(GOLDEN / "deepseek-lora.gguf"), "--model",
                    str(GOLDEN / "deepseek-f32.gguf"), "--to", "peft"]) == 2  # no --out
    assert run_cli(["export", "--adapter", str(GOLDEN / "deepseek-lora.gguf"), "--model",
                    str(GOLDEN / "qwen2-f32.gguf"), "--to", "merged", "--out", str(out)]) == 2
    assert run_cli(["export", "--adapter", str(GOLDEN / "deepseek-lora.gguf"), "--model",
                    str(GOLDEN / "deepseek-f32.gguf"), "--to", "peft", "--type", "q8_0",
                    "--out", str(tmp_path / "p")]) == 2
    assert run_cli(["export", str(tmp_path), "--to", "merged"]) == 2          # not a run
    err = capsys.readouterr().err
    assert "error: " in err and "hint: " in err


def test_full_run_exports_merged_only(tmp_path, capsys):
    run = _make_run(tmp_path, mode="full")
    source = source_from_run(run.path)
    assert source.adapter is None and source.full
    assert run_cli(["export", str(run.path), "--to", "merged"]) == 0
    assert run_cli(["export", str(run.path), "--to", "gguf-lora"]) == 2
    assert "--to merged" in capsys.readouterr().err
    assert run_cli(["export", str(run.path), "--to", "ollama"]) == 0
    assert (run.exports_dir / "ollama" / "model.gguf").is_file()


# ---- verification flags bad exports ------------------------------------------------------------

def _corrupt_tensor(path: Path, tensor: str, value: float = 1e4) -> None:
    f = read_gguf(path)
    info = f.tensors[tensor]
    f.close()
    with open(path, "r+b") as fh:
        fh.seek(info.offset)
        fh.write(np.full(info.nbytes // 4, value, np.float32).tobytes())


def test_verification_flags_a_corrupted_adapter(tmp_path):
    name = "mixtral"
    model = load_model(GOLDEN / f"{name}-f32.gguf")
    live = load_adapter(GOLDEN / f"{name}-lora.gguf")
    tokens = _ref(name)["tokens"]
    path = tmp_path / "a.gguf"
    assert _export(ExportSource(model.path, live), "gguf-lora", path, name).ok
    _corrupt_tensor(path, "blk.1.ffn_down_exps.weight.lora_b")
    report = ExportReport("gguf-lora", str(path))
    verify_gguf_lora(path, model, live, 1.0, tokens, report, llamacpp=False)
    assert not report.ok
    assert {c.name for c in report.failed} == {"tensors", "logits"}
    # a wrong alpha is caught by the scale check
    f = read_gguf(GOLDEN / f"{name}-lora.gguf")
    meta = dict(f.metadata, **{"adapter.lora.alpha": 4.0})
    write_gguf(path, meta, {n: (f.raw(n), i.ggml_type) for n, i in f.tensors.items()},
               f.value_types)
    report = ExportReport("gguf-lora", str(path))
    verify_gguf_lora(path, model, live, 1.0, tokens, report, llamacpp=False)
    assert "scale" in {c.name for c in report.failed}


def test_cli_flags_a_failed_export_with_a_nonzero_exit(tmp_path, capsys, monkeypatch):
    real = ex.write_merged

    def corrupting(model_path, out, *args, **kw):
        summary = real(model_path, out, *args, **kw)
        _corrupt_tensor(Path(out), "blk.0.attn_norm.weight", 3.0)   # an untouched tensor
        return summary
    monkeypatch.setattr(ex, "write_merged", corrupting)
    out = tmp_path / "m.gguf"
    assert run_cli(["export", "--adapter", str(GOLDEN / "olmoe-lora.gguf"), "--model",
                    str(GOLDEN / "olmoe-f32.gguf"), "--to", "merged", "--out", str(out)]) == 3
    captured = capsys.readouterr()
    aside = tmp_path / "m.failed-verification.gguf"          # not left where a good one goes
    assert captured.out.startswith("FAILED") and not out.exists() and aside.is_file()
    assert (f"error: the export failed verification, so it was moved aside to {aside} instead "
            f"of {out}; do not use it." in captured.err)
    report = json.loads((tmp_path / "m.failed-verification.gguf.verify.json").read_text())
    assert not report["ok"] and report["path"] == str(aside) and report["moved_from"] == str(out)
    assert report["files"] == [str(aside)]
    failed = {c["name"] for c in report["checks"] if c["ok"] is False}
    assert "unchanged" in failed and "logits" in failed


def test_an_unreadable_export_is_flagged_not_raised(tmp_path, monkeypatch):
    real = ex.write_adapter_gguf

    def truncating(adapter, path, **kw):
        types = real(adapter, path, **kw)
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[: len(data) // 2])
        return types
    monkeypatch.setattr(ex, "write_adapter_gguf", truncating)
    for to in ("gguf-lora", "ollama"):
        report = _export(_source("qwen2moe"), to, tmp_path / to, "qwen2moe")  # ollama: ADAPTER
        assert not report.ok
        failed = report.failed[0]
        assert failed.name.endswith("read back") and "truncated" in failed.detail
        aside = tmp_path / f"{to}.failed-verification"
        assert report.path == str(aside) and os.path.lexists(aside)
        assert not os.path.lexists(tmp_path / to)
        assert json.loads((tmp_path / f"{aside.name}.verify.json").read_text())["ok"] is False


def test_verification_flags_a_bad_peft_config(tmp_path, monkeypatch):
    from app.engine.export import exporter

    real = exporter.export_peft

    def wrong_alpha(*args, **kw):
        result = real(*args, **kw)
        cfg_path = Path(result.files[1])
        cfg = json.loads(cfg_path.read_text())
        cfg["lora_alpha"] *= 2
        cfg_path.write_text(json.dumps(cfg))
        return result
    monkeypatch.setattr(exporter, "export_peft", wrong_alpha)
    report = _export(_source("qwen2moe"), "peft", tmp_path / "p", "qwen2moe")
    assert not report.ok and {c.name for c in report.failed} == {"tensors", "logits"}


# ---- llama.cpp (optional extra) ----------------------------------------------------------------

def test_llamacpp_check_is_skipped_without_llama_cpp_python(tmp_path, monkeypatch):
    from app.engine.export import verify

    monkeypatch.delenv("WORKBENCH_LLAMACPP_PYTHON", raising=False)
    monkeypatch.setattr(verify.importlib.util, "find_spec", lambda name: None)
    report = _export(_source("olmoe"), "gguf-lora", tmp_path / "a.gguf", "olmoe", llamacpp=None)
    check = next(c for c in report.checks if c.name == "llamacpp")
    assert check.ok is None and "not installed" in check.detail and report.ok
    assert "the llama.cpp cross-check did not run" in report.to_text()     # said, not silent
    assert "gguf-workbench[verify]" in report.to_text()


@pytest.mark.skipif(llamacpp_python() is None,
                    reason="llama-cpp-python is not installed (extra `verify`, or set "
                           "WORKBENCH_LLAMACPP_PYTHON to an interpreter that has it)")
@pytest.mark.parametrize("name", ["mixtral", "qwen2moe", "gemma3"])
def test_llamacpp_loads_our_exports(tmp_path, name):
    for to in ("gguf-lora", "merged"):
        report = _export(_source(name), to, tmp_path / f"{to}.gguf", name, scale=0.5,
                         llamacpp=None)
        check = next(c for c in report.checks if c.name == "llamacpp")
        assert check.ok is not False, check.detail
        if check.ok is None:
            pytest.skip(f"llama.cpp did not run here: {check.detail}")
        assert check.data["max_abs_diff"] < 2e-3


# ---- the gguf_io.quantize wrapper --------------------------------------------------------------

def test_quantize_wrapper():
    x = np.random.default_rng(0).normal(size=(3, 2, 64)).astype(np.float32)
    cases = ((0, 0), (1, 1e-3), (30, 1e-2), (8, 2e-2), (2, 0.3), (3, 0.3), (6, 0.2), (7, 0.2))
    for t, tol in cases:
        raw = quantize(x, t)
        assert raw.dtype == np.uint8 and raw.shape[:-1] == (3, 2)
        back = dequantize(raw, t).reshape(x.shape)
        assert np.abs(back - x).max() <= tol * np.abs(x).max()
    assert quantize(x[0, 0], 8).shape == (68,)
    for t in (12, 14, 20):                      # Q4_K, Q6_K (blocks of 256), IQ4_NL: not writable
        with pytest.raises(UnsupportedModelError):
            quantize(np.zeros((1, 256), np.float32), t)
    with pytest.raises(UnsupportedModelError):
        quantize(np.zeros((1, 48), np.float32), 8)        # 48 is not a multiple of 32


def test_an_embedding_adapter_on_a_tied_model_is_refused_by_the_same_rule(tmp_path):
    """The rule training start applies (model.lora.llamacpp_lora_problems): llama.cpp would
    abort on the adapter, so no format writes one."""
    model = load_model(GOLDEN / "gemma3-f32.gguf")
    v, c = model.tensor_shapes["token_embd.weight"]
    adapter = LoraAdapter(4.0, {"token_embd.weight": (np.zeros((v, 2), np.float32),
                                                      np.ones((c, 2), np.float32))}, "gemma3")
    for to in ("gguf-lora", "ollama"):
        with pytest.raises(ConfigError, match="ties its output head"):
            _export(ExportSource(model.path, adapter), to, tmp_path / to, "gemma3")
