"""PEFT interop: Hugging Face module names per architecture, the Q/K row permutation of llama-style
GGUFs, per-expert modules, scales, and exact export -> import round trips."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from app.engine.errors import ModelFormatError
from app.engine.export.exporter import ExportSource, export, source_from_adapter
from app.engine.export.verify import engine_logits
from app.engine.kernels.rope import NEOX, NORM, rope_angles, rope_forward
from app.engine.model.lora import LoraAdapter, load_adapter
from app.engine.model.transformer import load_model
from app.engine.export.peft import import_peft, module_map, permute_rows, read_peft, unpermute_rows
from tests.conftest import GOLDEN, GOLDEN_MODELS
from tests.llamacpp_parity import assert_within, logit_bound


def _ref(name):
    return np.load(GOLDEN / f"{name}.npz")


def _import(path, model):
    cfg = model.config
    return import_peft(path, arch=cfg.arch, n_head=cfg.n_head, n_head_kv=cfg.n_head_kv,
                       embed_scale=cfg.embed_scale, shapes=model.tensor_shapes)


@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_peft_round_trip_gives_the_same_adapter(tmp_path, name):
    model = load_model(GOLDEN / f"{name}-f32.gguf")
    source = source_from_adapter(GOLDEN / f"{name}-lora.gguf", model.path, model)
    report = export(source, "peft", tmp_path / "peft", prompt_tokens=_ref(name)["tokens"],
                    llamacpp=False)
    assert report.ok, report.to_text()
    assert report.max_abs_logit_diff == 0.0
    back = _import(tmp_path / "peft", model)
    live = source.adapter
    assert list(back.tensors) == list(live.tensors)
    for tname, (a, b) in live.tensors.items():
        np.testing.assert_array_equal(back.tensors[tname][0], a)
        np.testing.assert_array_equal(back.tensors[tname][1], b)
        assert back.scale(tname) == pytest.approx(live.scale(tname), rel=1e-12)
    tokens = _ref(name)["tokens"]
    assert_within(model.logits(tokens, adapter=back), _ref(name)["logits_f32_lora"],
                  logit_bound(model, tokens, back), name)
    config, tensors = read_peft(tmp_path / "peft")
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert config["lora_alpha"] == pytest.approx(8.0)          # scale 2 = alpha 8 / r 4
    assert config["base_model_name_or_path"] == str((GOLDEN / f"{name}-f32.gguf").absolute())
    assert not config["use_rslora"] and not config["rank_pattern"] and not config["alpha_pattern"]
    assert all(k.startswith("base_model.model.") for k in tensors)


EXPECTED_MODULES = {
    "llama": ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.o_proj",
              "model.layers.1.mlp.gate_proj", "model.layers.0.mlp.down_proj"],
    "mixtral": ["model.layers.0.block_sparse_moe.gate",
                "model.layers.1.block_sparse_moe.experts.3.w1",
                "model.layers.0.block_sparse_moe.experts.0.w2",
                "model.layers.0.block_sparse_moe.experts.2.w3"],
    "qwen2": ["model.layers.1.self_attn.v_proj", "model.layers.0.mlp.up_proj"],
    "qwen2moe": ["model.layers.0.mlp.gate", "model.layers.1.mlp.experts.3.gate_proj",
                 "model.layers.0.mlp.shared_expert.down_proj"],
    "qwen3moe": ["model.layers.0.mlp.gate", "model.layers.1.mlp.experts.2.up_proj"],
    "olmoe": ["model.layers.1.mlp.gate", "model.layers.0.mlp.experts.1.down_proj"],
    "deepseek": ["model.layers.0.mlp.gate_proj", "model.layers.1.mlp.gate",
                 "model.layers.1.mlp.experts.3.down_proj",
                 "model.layers.1.mlp.shared_experts.up_proj"],
    "gemma3": ["model.layers.2.self_attn.k_proj", "model.layers.2.mlp.down_proj"],
}
TARGETS = {"llama": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
           "mixtral": {"q_proj", "k_proj", "v_proj", "o_proj", "gate", "w1", "w2", "w3"},
           "qwen2moe": {"q_proj", "k_proj", "v_proj", "o_proj", "gate", "gate_proj", "up_proj",
                        "down_proj"}}


@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_hugging_face_module_names(tmp_path, name):
    source = source_from_adapter(GOLDEN / f"{name}-lora.gguf", GOLDEN / f"{name}-f32.gguf")
    export(source, "peft", tmp_path / "p", llamacpp=False)
    config, tensors = read_peft(tmp_path / "p")
    modules = {k[len("base_model.model."):].rsplit(".lora_", 1)[0] for k in tensors}
    assert set(EXPECTED_MODULES[name]) <= modules
    if name in TARGETS:
        assert set(config["target_modules"]) == TARGETS[name]
    n_expert_modules = sum(".experts." in m for m in modules)
    n_3d = sum(a.ndim == 3 for a, _ in source.adapter.tensors.values())
    assert n_expert_modules == 4 * n_3d                        # 4 experts, one module each
    for key, value in tensors.items():               # PEFT's shapes: A (r, in), B (out, r)
        assert value.shape[0 if key.endswith("lora_A.weight") else 1] == 4


def test_permutation_matches_the_converter_and_inverts():
    w = np.arange(2 * 8 * 3).reshape(2 * 8, 3)                 # 2 heads of 8 rows
    p = permute_rows(w, 2)
    # convert_hf_to_gguf's LlamaModel.permute: reshape(n_head, 2, rows/n_head/2, ...).swapaxes(1, 2)
    np.testing.assert_array_equal(p, w.reshape(2, 2, 4, 3).swapaxes(1, 2).reshape(16, 3))
    assert list(p[:8, 0] // 3) == [0, 4, 1, 5, 2, 6, 3, 7]   # halves interleaved within a head
    np.testing.assert_array_equal(unpermute_rows(p, 2), w)


def test_peft_b_applies_to_the_hugging_face_weights_on_llama(tmp_path):
    """llama GGUFs carry Q/K rows permuted; the PEFT B must act on the HF (un-permuted) weight:
    W_hf + s B_peft A_peft == unpermute(W_gguf + s B A), for q (4 heads) and k (2 kv heads)."""
    model = load_model(GOLDEN / "llama-f32.gguf")
    adapter = load_adapter(GOLDEN / "llama-lora.gguf")
    export(ExportSource(model.path, adapter), "peft", tmp_path / "p", llamacpp=False)
    config, tensors = read_peft(tmp_path / "p")
    s = config["lora_alpha"] / config["r"]
    cfg = model.config
    for kind, proj, heads in (("attn_q", "q_proj", cfg.n_head), ("attn_k", "k_proj", cfg.n_head_kv),
                              ("attn_v", "v_proj", None)):
        tname = f"blk.1.{kind}.weight"
        key = f"base_model.model.model.layers.1.self_attn.{proj}"
        w_gguf = model.gguf.array(tname)
        a, b, scale = adapter.scaled(tname)
        merged_gguf = w_gguf + scale * (b @ a)
        w_hf = unpermute_rows(w_gguf, heads) if heads else w_gguf
        merged_hf = w_hf + s * (tensors[key + ".lora_B.weight"] @ tensors[key + ".lora_A.weight"])
        want = unpermute_rows(merged_gguf, heads) if heads else merged_gguf
        np.testing.assert_allclose(merged_hf, want, atol=1e-6)
        if heads:   # without un-permuting B the PEFT delta would land on the wrong rows
            assert np.abs(tensors[key + ".lora_B.weight"] - b).max() > 1e-3
    # and the semantics: NEOX RoPE on HF rows gives the same attention scores as NORM RoPE on
    # GGUF rows (what llama.cpp runs), with the PEFT delta included on the HF side
    x = np.random.default_rng(0).normal(size=(5, cfg.n_embd)).astype(np.float32)
    cos, sin = rope_angles(np, np.arange(5), cfg.head_dim, cfg.rope_base, 1.0, np.float32)

    def scores(wq, wk, mode):
        q = rope_forward((x @ wq.T).reshape(5, cfg.n_head, -1), cos, sin, cfg.head_dim, mode)[0]
        k = rope_forward((x @ wk.T).reshape(5, cfg.n_head_kv, -1), cos, sin, cfg.head_dim, mode)[0]
        k = np.repeat(k, cfg.n_head // cfg.n_head_kv, axis=1)
        return np.einsum("thd,shd->hts", q, k)

    def merged(kind, hf):
        tname = f"blk.1.{kind}.weight"
        a, b, scale = adapter.scaled(tname)
        w = model.gguf.array(tname) + scale * (b @ a)
        if not hf:
            return w
        key = f"base_model.model.model.layers.1.self_attn.{'q' if kind == 'attn_q' else 'k'}_proj"
        heads = cfg.n_head if kind == "attn_q" else cfg.n_head_kv
        return unpermute_rows(model.gguf.array(tname), heads) + s * (
            tensors[key + ".lora_B.weight"] @ tensors[key + ".lora_A.weight"])
    np.testing.assert_allclose(scores(merged("attn_q", True), merged("attn_k", True), NEOX),
                               scores(merged("attn_q", False), merged("attn_k", False), NORM),
                               atol=1e-4)


def test_no_permutation_for_neox_architectures(tmp_path):
    source = source_from_adapter(GOLDEN / "qwen2-lora.gguf", GOLDEN / "qwen2-f32.gguf")
    export(source, "peft", tmp_path / "p", llamacpp=False)
    _, tensors = read_peft(tmp_path / "p")
    np.testing.assert_array_equal(
        tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"],
        source.adapter.tensors["blk.0.attn_q.weight"][1])


def test_token_embedding_adapter_and_mixed_ranks_round_trip(tmp_path):
    """lora_embedding_A is A transposed; mixed ranks and an alpha-0 adapter need rank_pattern /
    alpha_pattern."""
    model = load_model(GOLDEN / "mixtral-f32.gguf")
    rng = np.random.default_rng(1)
    v, c = model.tensor_shapes["token_embd.weight"]
    adapter = load_adapter(GOLDEN / "mixtral-lora.gguf")
    adapter.tensors["token_embd.weight"] = (rng.normal(0, 0.5, (v, 3)).astype(np.float32),
                                            rng.normal(0, 0.5, (c, 3)).astype(np.float32))
    tokens = _ref("mixtral")["tokens"]
    for alpha, scale in ((8.0, 1.0), (0.0, 0.7)):
        adapter.alpha = alpha
        report = export(ExportSource(model.path, adapter), "peft", tmp_path / "p", scale=scale,
                        prompt_tokens=tokens, llamacpp=False, overwrite=True)
        assert report.ok, report.to_text()
        config, tensors = read_peft(tmp_path / "p")
        key = "base_model.model.model.embed_tokens"
        np.testing.assert_array_equal(tensors[key + ".lora_embedding_A"],
                                      adapter.tensors["token_embd.weight"][0].T)
        np.testing.assert_array_equal(tensors[key + ".lora_embedding_B"],
                                      adapter.tensors["token_embd.weight"][1])
        assert config["rank_pattern"] == {"model.embed_tokens": 3}
        modules = ("model.embed_tokens", "model.layers.0.self_attn.q_proj")
        s = {m: config["alpha_pattern"].get(m, config["lora_alpha"])
             / config["rank_pattern"].get(m, config["r"]) for m in modules}
        assert s["model.embed_tokens"] == pytest.approx(adapter.scale("token_embd.weight", scale))
        assert s["model.layers.0.self_attn.q_proj"] == pytest.approx(
            adapter.scale("blk.0.attn_q.weight", scale))
        back = _import(tmp_path / "p", model)
        np.testing.assert_allclose(model.logits(tokens, back),
                                   model.logits(tokens, adapter, scale), atol=1e-4)


def test_embedding_scale_goes_into_lora_embedding_b(tmp_path):
    """Gemma 3 multiplies embeddings by sqrt(n_embd) after llama.cpp adds the LoRA delta, while
    PEFT's delta is added after Gemma's scaled embedding: lora_embedding_B carries the scale."""
    model = load_model(GOLDEN / "llama-f32.gguf")
    v, c = model.tensor_shapes["token_embd.weight"]
    rng = np.random.default_rng(4)
    a, b = rng.normal(size=(v, 2)).astype(np.float32), rng.normal(size=(c, 2)).astype(np.float32)
    adapter = LoraAdapter(4.0, {"token_embd.weight": (a, b)}, "llama")
    kw = {"arch": "llama", "n_head": 4, "n_head_kv": 2, "embed_scale": float(np.sqrt(c)),
          "shapes": model.tensor_shapes}
    from app.engine.export.peft import export_peft
    export_peft(adapter, tmp_path / "p", **kw)
    _, tensors = read_peft(tmp_path / "p")
    np.testing.assert_allclose(tensors["base_model.model.model.embed_tokens.lora_embedding_B"],
                               b * np.sqrt(c), rtol=1e-6)
    back = import_peft(tmp_path / "p", **kw)
    np.testing.assert_allclose(back.tensors["token_embd.weight"][1], b, rtol=1e-6)
    np.testing.assert_array_equal(back.tensors["token_embd.weight"][0], a)


def _write_peft(folder, config, tensors):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))


def test_import_handwritten_peft_rslora_patterns_and_missing_experts(tmp_path):
    model = load_model(GOLDEN / "qwen3moe-f32.gguf")
    rng = np.random.default_rng(2)
    pre = "base_model.model.model.layers.1."
    tensors = {pre + "self_attn.v_proj.lora_A.weight": rng.normal(size=(4, 32)).astype(np.float32),
               pre + "self_attn.v_proj.lora_B.weight": rng.normal(size=(32, 4)).astype(np.float32),
               pre + "mlp.experts.2.up_proj.lora_A.default.weight":
                   rng.normal(size=(4, 32)).astype(np.float32),
               pre + "mlp.experts.2.up_proj.lora_B.default.weight":
                   rng.normal(size=(32, 4)).astype(np.float32)}
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 16, "use_rslora": True,
              "alpha_pattern": {"experts.2.up_proj": 8}, "target_modules": ["v_proj", "up_proj"]}
    _write_peft(tmp_path / "p", config, tensors)
    adapter = _import(tmp_path / "p", model)
    a3, b3 = adapter.tensors["blk.1.ffn_up_exps.weight"]
    assert a3.shape == (4, 4, 32) and not a3[0].any() and not b3[3].any()   # other experts: 0
    # rsLoRA scales: v_proj 16/sqrt(4) = 8, expert 2 (alpha_pattern) 8/sqrt(4) = 4; one GGUF
    # alpha for both, the difference folded into a B
    np.testing.assert_allclose(b3[2] * adapter.scale("blk.1.ffn_up_exps.weight"),
                               tensors[pre + "mlp.experts.2.up_proj.lora_B.default.weight"] * 4,
                               rtol=1e-6)
    _, bv = adapter.tensors["blk.1.attn_v.weight"]
    np.testing.assert_allclose(bv * adapter.scale("blk.1.attn_v.weight"),
                               tensors[pre + "self_attn.v_proj.lora_B.weight"] * 8, rtol=1e-6)
    bad = dict(tensors)
    bad[pre + "mlp.nonexistent.lora_A.weight"] = bad.pop(pre + "self_attn.v_proj.lora_A.weight")
    _write_peft(tmp_path / "bad", config, bad)
    with pytest.raises(ModelFormatError, match="nonexistent"):
        _import(tmp_path / "bad", model)
    _write_peft(tmp_path / "dora", {**config, "use_dora": True}, tensors)
    with pytest.raises(ModelFormatError, match="DoRA"):
        _import(tmp_path / "dora", model)
    with pytest.raises(ModelFormatError, match="adapter_config.json"):
        read_peft(tmp_path)


def test_module_map_covers_every_lora_target():
    for name in GOLDEN_MODELS:
        model = load_model(GOLDEN / f"{name}-f32.gguf")
        mapped = {ref.tensor for ref in module_map(model.config.arch, model.tensor_shapes).values()}
        adapter = load_adapter(GOLDEN / f"{name}-lora.gguf")
        assert set(adapter.tensors) <= mapped, name
        assert "token_embd.weight" in mapped


def test_alpha_zero_adapter_with_one_rank():
    from app.engine.export.exporter import fold_scale

    a, b = np.ones((2, 4), np.float32), np.ones((3, 2), np.float32)
    folded = fold_scale(LoraAdapter(0.0, {"x": (a, b)}), 0.25)
    assert folded.alpha == 0.5 and folded.scale("x") == 0.25


# ---- transformers 5 fused experts (peft target_parameters) ------------------------------------

def _fused_expert_adapter(folder, model, rank=2, alpha=4.0, seed=0):
    """A PEFT adapter in the layout peft 0.21 saves for LoraConfig(target_modules=["q_proj"],
    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]) on a transformers 5
    MoE whose experts hold gate_up_proj (E, 2F, C) and down_proj (E, C, F): each parameter
    wraps `experts` once more (gate_up_proj innermost, under .base_layer); lora_A (E*r, d1)
    with the expert slowest, lora_B (d2, E*r) with the expert fastest. Returns the tensors and,
    per GGUF tensor, the float32 delta peft adds (scale included)."""
    rng = np.random.default_rng(seed)
    shapes = model.tensor_shapes
    tensors, deltas = {}, {}
    scale = alpha / rank
    for layer in range(model.config.n_layer):
        n_expert, n_ff, n_embd = shapes[f"blk.{layer}.ffn_gate_exps.weight"]
        pre = f"base_model.model.model.layers.{layer}."
        for key, (d1, d2) in ((pre + "mlp.experts.base_layer", (2 * n_ff, n_embd)),
                              (pre + "mlp.experts", (n_embd, n_ff))):
            a = rng.normal(0, 0.3, (n_expert * rank, d1)).astype(np.float32)
            b = rng.normal(0, 0.3, (d2, n_expert * rank)).astype(np.float32)
            tensors[key + ".lora_A.weight"], tensors[key + ".lora_B.weight"] = a, b
            a3, b3 = a.reshape(n_expert, rank, d1), b.reshape(d2, rank, n_expert)
            delta = np.einsum("ore,eri->eio", b3, a3) * np.float32(scale)   # peft's einsum
            if d1 == 2 * n_ff:
                deltas[f"blk.{layer}.ffn_gate_exps.weight"] = delta[:, :n_ff]
                deltas[f"blk.{layer}.ffn_up_exps.weight"] = delta[:, n_ff:]
            else:
                deltas[f"blk.{layer}.ffn_down_exps.weight"] = delta
        q = pre + "self_attn.q_proj"
        n_q, n_in = shapes[f"blk.{layer}.attn_q.weight"]
        a = rng.normal(0, 0.3, (rank, n_in)).astype(np.float32)
        b = rng.normal(0, 0.3, (n_q, rank)).astype(np.float32)
        tensors[q + ".lora_A.weight"], tensors[q + ".lora_B.weight"] = a, b
        deltas[f"blk.{layer}.attn_q.weight"] = (b @ a) * np.float32(scale)
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": ["q_proj"],
              "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
              "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False,
              "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {},
              "base_model_name_or_path": "Qwen/Qwen3-30B-A3B", "peft_version": "0.21.2"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return deltas


def test_fused_expert_peft_adapter_imports_and_exports_to_gguf(tmp_path):
    model = load_model(GOLDEN / "qwen3moe-f32.gguf")
    deltas = _fused_expert_adapter(tmp_path / "peft", model)
    adapter = _import(tmp_path / "peft", model)
    assert set(adapter.tensors) == set(deltas)
    for name, want in deltas.items():                  # the same weight change as peft's
        a, b, s = adapter.scaled(name)
        np.testing.assert_allclose(np.float32(s) * (b @ a), want, atol=1e-5)
    assert adapter.tensors["blk.0.ffn_up_exps.weight"][0].shape == (4, 2, 32)
    tokens = _ref("qwen3moe")["tokens"]
    full = {n: model.gguf.array(n) + d for n, d in deltas.items()}
    want = engine_logits(model, tokens, None, 1.0, full)
    np.testing.assert_allclose(model.logits(tokens, adapter=adapter, llamacpp_numerics=False),
                               want, atol=1e-4)
    source = source_from_adapter(tmp_path / "peft", model.path, model)
    report = export(source, "gguf-lora", tmp_path / "a.gguf", prompt_tokens=tokens,
                    llamacpp=False)
    assert report.ok, report.to_text()
    np.testing.assert_allclose(
        model.logits(tokens, adapter=load_adapter(tmp_path / "a.gguf"), llamacpp_numerics=False),
        want, atol=1e-4)


def test_failed_peft_import_names_the_real_cause(tmp_path):
    model = load_model(GOLDEN / "qwen3moe-f32.gguf")
    _fused_expert_adapter(tmp_path / "peft", model)
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    config["target_parameters"] = ["mlp.experts.gate_up_proj"]     # one parameter, two wrappers
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError) as e:
        _import(tmp_path / "peft", model)
    assert "target_parameters" in e.value.hint and "base model" not in e.value.hint
    with pytest.raises(ModelFormatError, match="another architecture or size"):
        _import(tmp_path / "peft", load_model(GOLDEN / "llama-f32.gguf"))


def test_peft_base_model_from_gguf_metadata():
    from app.engine.export.exporter import base_model_id

    assert base_model_id({"general.source.huggingface.repository": "google/gemma-3-270m",
                          "general.name": "x"}, "m.gguf") == "google/gemma-3-270m"
    assert base_model_id({"general.base_model.count": 1, "general.base_model.0.repo_url":
                          "https://huggingface.co/Qwen/Qwen3-0.6B"}, "m.gguf") == "Qwen/Qwen3-0.6B"
    assert base_model_id({"general.name": "gemma-3"}, "/m/x.gguf") == "/m/x.gguf"
