"""The benchmark harness (bench/): the FLOP and memory counts against hand counts, the one-
configuration command's JSON, and the PyTorch peer computing the same step as ours."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from app.engine import load_model
from app.engine.model.config import config_from_metadata
from app.engine.io.gguf import dequantize, read_gguf
from app.engine.data.batches import Batch
from app.engine.training.session import TrainSession
from bench.cost import memory_bound, step_flops
from bench.llamacpp import parse_progress
from bench.models import Q4_K, quantize_q4_k
from bench.train import PHASES, Workload
from tests.conftest import GOLDEN

ROOT = GOLDEN.parents[2]


def _config(name: str):
    f = read_gguf(GOLDEN / f"{name}-f32.gguf")
    cfg = config_from_metadata(f.metadata, f.tensors)
    f.close()
    return cfg


def test_step_flops_of_dense_lora_match_a_hand_count():
    # golden llama: C 32, 2 layers, 4 heads / 2 kv heads of 8, FFN 96, vocabulary 259; T = 8
    cfg, t, r = _config("llama"), 8, 4
    ranks = {f"blk.{il}.attn_{p}.weight": r for il in range(2) for p in ("q", "k", "v", "output")}
    qkvo = 2 * t * 32 * (32 + 16 + 16 + 32)                   # base q, k, v, o
    lora = 2 * t * r * ((32 + 32) + (32 + 16) * 2 + (32 + 32))  # x A^T and (x A^T) B^T
    ffn = 3 * 2 * t * 32 * 96
    attn = 2 * 2 * 4 * t * t * 8                               # Q K^T and P V
    forward = 2 * (qkvo + lora + ffn + attn)
    backward = 2 * (qkvo + ffn + 2 * lora + 5 * attn // 2)      # dx only: nothing trained in full
    head = 2 * t * 32 * 259
    flops = step_flops(cfg, t, ranks, set(), checkpoint=0)
    assert flops == {"forward": forward, "backward": backward, "recompute": 0, "loss": 2 * head,
                     "total": forward + backward + 2 * head}   # frozen head: logits and dx, one pass
    ranks["output.weight"] = r                                  # a LoRA head: logits recomputed
    lora_head = 2 * t * r * (32 + 259)
    assert step_flops(cfg, t, ranks, set(), 0)["loss"] == 3 * head + 3 * lora_head + 2 * t * r * 259
    assert step_flops(cfg, t, ranks, set(), checkpoint=1)["recompute"] == forward


def test_step_flops_of_moe_full_finetuning_match_a_hand_count():
    # golden mixtral: attention as llama, router to 4 experts, 2 per token, expert FFN 64
    cfg, t = _config("mixtral"), 8
    f = read_gguf(GOLDEN / "mixtral-f32.gguf")
    trained = set(f.tensors)
    f.close()
    linears = 2 * t * 32 * (32 + 16 + 16 + 32) + 2 * t * 32 * 4 + 3 * 2 * (t * 2) * 32 * 64
    attn = 2 * 2 * 4 * t * t * 8
    head = 2 * t * 32 * 259
    flops = step_flops(cfg, t, {}, trained, checkpoint=0)
    assert flops["forward"] == 2 * (linears + attn)
    assert flops["backward"] == 2 * (2 * linears + 5 * attn // 2)       # dx and dW
    assert flops["loss"] == head + 2 * head + head                      # fwd, dx + dW, recompute


def test_memory_bound_matches_a_hand_count():
    cfg, t, r = _config("llama"), 8, 4
    ranks = {f"blk.{il}.attn_{p}.weight": r for il in range(2) for p in ("q", "k", "v", "output")}
    per_token = (2 * 32 + 2 * 32 + 2 * 16 + 4) + 2 * 32 + 2 * 96 + 4 * r   # attention, FFN, LoRA
    bound = memory_bound(cfg, t, stored_bytes=1000, n_trainable=10, ranks=ranks, checkpoint=0,
                         vocab_chunk=100)
    assert bound == {"weights": 1000, "trainable_and_optimizer": 160,
                     "activations": 2 * per_token * t * 4 + 2 * t * 32 * 4,
                     "head_chunk": t * 100 * 4, "total": sum(bound[k] for k in (
                         "weights", "trainable_and_optimizer", "activations", "head_chunk"))}
    ckpt = memory_bound(cfg, t, 1000, 10, ranks, checkpoint=1, vocab_chunk=100)
    assert ckpt["activations"] == 2 * t * 32 * 4 + per_token * t * 4 + 2 * t * 32 * 4


def test_train_command_prints_one_json_object_with_the_figures():
    cmd = [sys.executable, "-m", "bench", "train", "--model", str(GOLDEN / "llama-f32.gguf"),
           "--targets", "attention,ffn", "--ctx", "16", "--steps", "1", "--json"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    row = json.loads(out)
    for key in ("tokens_per_s", "step_ms", "peak_rss_mb", "startup_rss_mb", "loss0", "trainable",
                "gflops_per_s", "rss_over_bound"):
        assert row[key] > 0, key
    assert set(row["phase_ms"]) == {*PHASES, "dequant", "other"}
    assert row["flops"]["total"] == sum(v for k, v in row["flops"].items() if k != "total")
    assert row["memory_bound_mb"]["total"] > row["memory_bound_mb"]["weights"] > 0


def test_q4_k_quantizer_writes_blocks_the_dequantizers_read_back_closely():
    import gguf

    x = np.random.default_rng(0).normal(0, 0.02, (3, 512)).astype(np.float32)
    x[1, :256] = 0.01                                            # a constant block
    raw = quantize_q4_k(x)
    assert raw.shape == (3, 2 * 144)
    ours = dequantize(raw, Q4_K).reshape(x.shape)
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K).reshape(x.shape)
    assert np.array_equal(ours, theirs)
    step = (x.reshape(-1, 32).max(1) - np.minimum(x.reshape(-1, 32).min(1), 0)) / 15
    assert np.all(np.abs(ours - x).reshape(-1, 32).max(1) <= 0.5 * step + 2e-3 * np.abs(x).max())


def test_llamacpp_progress_line_is_parsed():
    stderr = ("train: [\u2588\u2588   ] data=0000004/0000010 loss=5.60000±0.1 acc=1.00±0.50% "
              "t=00:00:02 ETA=00:00:03 \rtrain: [\u2588\u2588\u2588\u2588  ] data=0000010/0000010 "
              "loss=5.54321±0.10000 acc=1.20±0.40% t=00:01:05 ETA=00:00:00 \n")
    assert parse_progress(stderr) == {"data": 10, "data_max": 10, "loss": 5.54321, "seconds": 65}
    assert parse_progress("no progress") is None


# ---- the PyTorch peer computes the same step ----------------------------------------------------

TARGETS = {"llama": ("attention", "ffn"), "mixtral": ("attention", "experts")}


@pytest.mark.parametrize("name", TARGETS)
def test_peer_logits_equal_ours(name):
    torch = pytest.importorskip("torch")
    from bench.torch_peer import TorchPeer

    tokens = np.load(GOLDEN / f"{name}.npz")["tokens"].astype(np.int64)
    ours = load_model(GOLDEN / f"{name}-f32.gguf").logits(tokens)
    peer = TorchPeer(str(GOLDEN / f"{name}-f32.gguf"))
    with torch.no_grad():
        theirs = peer.logits(peer.hidden(torch.from_numpy(tokens))).numpy()
    assert np.abs(theirs - ours).max() <= 1e-5 * np.abs(ours).max()


@pytest.mark.parametrize("name", TARGETS)
def test_peer_training_step_has_our_loss(name):
    """The timed step of both sides (bench.train.EngineTrainer and TorchTrainer) at step 0."""
    pytest.importorskip("torch")
    from bench.torch_peer import TorchTrainer
    from bench.train import EngineTrainer

    w = Workload(str(GOLDEN / f"{name}-f32.gguf"), "lora", rank=4, targets=TARGETS[name],
                 ctx=24, steps=1)
    window = w.windows(259)[0]
    ours, peer = EngineTrainer(w), TorchTrainer(w)
    assert peer.n_trainable == ours.n_trainable
    assert peer.step(peer.batch(window)) == pytest.approx(ours.step(ours.batch(window)), rel=1e-6)


@pytest.mark.parametrize("name", TARGETS)
@pytest.mark.parametrize("mode, checkpoint", [("lora", 0), ("full", 1)])
def test_peer_gradients_equal_ours(name, mode, checkpoint):
    """Every trained tensor's gradient (LoRA A and B with B != 0, so that dA is not trivially
    zero; or every tensor of a full fine-tuning under gradient checkpointing)."""
    torch = pytest.importorskip("torch")
    from bench.torch_peer import TorchPeer

    path = str(GOLDEN / f"{name}-f32.gguf")
    w = Workload(path, mode, rank=4, targets=TARGETS[name], ctx=24, steps=1, checkpoint=checkpoint)
    window = w.windows(259)[0]
    session = TrainSession(load_model(path), w.train_config())
    rng = np.random.default_rng(1)
    for _, b in (session.adapter.tensors.values() if session.adapter else ()):
        b[...] = rng.normal(0, 0.1, b.shape)
    loss, _, grads = session.loss_and_grads(Batch(window[:-1], window[1:]))
    peer = TorchPeer(path, session.adapter, full=mode == "full", checkpoint_interval=checkpoint)
    peer_loss = peer.loss(torch.from_numpy(window[:-1]), torch.from_numpy(window[1:]))
    peer_loss.backward()
    assert peer_loss.item() == pytest.approx(loss, rel=1e-6)
    peer_grads = peer.grads()
    assert set(peer_grads) == set(grads)
    for n, g in grads.items():
        assert np.abs(peer_grads[n] - g).max() <= 1e-4 * np.abs(g).max(), n


def test_the_peer_check_compares_with_our_training_numerics_on_quantized_models():
    """The peer multiplies dequantized weights in plain float32, as our trainer does; our
    inference default rounds activations like llama.cpp, which would fail the check."""
    from bench.train import compare_logits

    path = GOLDEN / "mixtral-q8_0.gguf"
    tokens = np.arange(24) % 259
    plain = load_model(path).logits(tokens, llamacpp_numerics=False)
    assert compare_logits(plain, str(path), tokens)["ok"]
    assert not compare_logits(plain + 0.01, str(path), tokens)["ok"]


def test_rounds_take_turns_and_keep_each_implementations_best(monkeypatch, tmp_path):
    from bench import table

    calls = []
    speeds = {"ours": iter([100.0, 120.0, 110.0]), "torch": iter([90.0, 80.0, 95.0])}

    def fake_run(path, row, impl, steps, device, precision="fp32"):
        calls.append(impl)
        if impl == "llama.cpp":
            return {"impl": impl, "skipped": "llama-finetune not installed"}
        return {"impl": impl, "tokens_per_s": next(speeds[impl])}

    monkeypatch.setattr(table, "run_impl", fake_run)
    monkeypatch.setattr(table, "gemm_gflops", lambda *a, **k: 300.0)
    monkeypatch.setattr(table, "model_path", lambda name: tmp_path / "m.gguf")
    row = table.Row("bench-dense", "full", "", 256, peers=("torch", "llama.cpp"))
    out = table.run_row(row, steps=1, device="cpu", rounds=3)
    assert calls == ["ours", "torch", "llama.cpp", "ours", "torch", "ours", "torch"]
    assert out["ours"]["tokens_per_s"] == 120.0 and out["torch"]["tokens_per_s"] == 95.0
    assert out["ours"]["rounds_tokens_per_s"] == [100.0, 120.0, 110.0]
    assert out["ratio"] == 120.0 / 95.0 and out["llama.cpp"]["skipped"]


def test_each_implementation_runs_in_each_precision_with_ratios(monkeypatch, tmp_path, capsys):
    from bench import table

    speeds = {("ours", "fp32"): 100.0, ("ours", "bf16"): 190.0, ("torch", "fp32"): 80.0,
              ("torch", "bf16"): 120.0}
    calls = []

    def fake_run(path, row, impl, steps, device, precision="fp32"):
        calls.append((impl, precision))
        if impl == "llama.cpp":
            return {"impl": impl, "skipped": "llama-finetune not installed"}
        return {"impl": impl, "precision": precision, "precision_used": precision,
                "tokens_per_s": speeds[impl, precision]}

    monkeypatch.setattr(table, "run_impl", fake_run)
    monkeypatch.setattr(table, "gemm_gflops", lambda *a, **k: 300.0)
    monkeypatch.setattr(table, "model_path", lambda name: tmp_path / "m.gguf")
    row = table.Row("bench-dense", "full", "", 256, peers=("torch", "llama.cpp"))
    out = table.run_row(row, steps=1, device="cpu", precisions=("fp32", "bf16"))
    # llama.cpp has no precision setting: it runs once
    assert calls == [("ours", "fp32"), ("torch", "fp32"), ("llama.cpp", "fp32"),
                     ("ours", "bf16"), ("torch", "bf16")]
    assert out["variants"] == ["ours", "torch", "llama.cpp", "ours/bf16", "torch/bf16"]
    assert out["ratio"] == 100.0 / 80.0
    assert out["ratios"] == {"ours": 1.0, "torch": 0.8, "ours/bf16": 1.9, "torch/bf16": 1.2}
    monkeypatch.setattr(table, "format_impl", lambda label, r, res: f"{r['impl']} "
                        f"{r.get('precision_used', '-')} {r.get('tokens_per_s', '-')}")
    table.print_row(out)
    assert capsys.readouterr().out.split("\n")[3:5] == ["ours bf16 190.0", "torch bf16 120.0"]


def test_the_table_prints_each_precisions_line_with_its_ratios(capsys):
    from bench import table

    phases = {p: 1.0 for p in table.PHASE_COLUMNS}

    def line(impl, precision, tokens_per_s):
        return {"impl": impl, "precision": precision, "precision_used": precision,
                "tokens_per_s": tokens_per_s, "step_ms": 1000 / tokens_per_s,
                "phase_ms": phases, "gflops_per_s": 10.0, "matmul_pct": 5.0,
                "peak_rss_mb": 300, "memory_bound_mb": {"total": 80}, "rss_over_bound": 3.0,
                "logits_check": {"rel": 1e-7, "ok": True}}
    result = {"label": "bench-dense lora", "config": {"peers": ["torch"]},
              "precisions": ["fp32", "bf16"], "matmul_gflops_large": 100.0, "target": 1.3,
              "variants": ["ours", "torch", "ours/bf16", "torch/bf16"], "ratio": 1.25,
              "meets_target": False, "loss0_rel_diff": 1e-8,
              "ours": line("ours", "fp32", 100), "torch": line("torch", "fp32", 80),
              "ours/bf16": line("ours", "bf16", 190), "torch/bf16": line("torch", "bf16", 120),
              "ratios": {"ours": 1.0, "torch": 0.8, "ours/bf16": 1.9, "torch/bf16": 1.2}}
    table.print_row(result)
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split("|")[0].split()[-3] for ln in lines] == ["fp32", "fp32", "bf16", "bf16"]
    assert "1.25x the peer (target 1.3x: MISSED)" in lines[0]
    assert "step-0 loss rel diff 1e-08; 0.80x ours in fp32" in lines[1]
    assert " bf16 " in lines[2] and "1.90x ours in fp32; 1.58x the peer in bf16" in lines[2]
    assert "step-0" not in lines[3] and "1.20x ours in fp32" in lines[3]


def test_attention_pairs_count_what_the_causal_blocks_skip():
    from bench.cost import attention_pairs

    cfg = _config("llama")                                    # 2 kv heads
    assert attention_pairs(cfg, 0, 8) == 8 * 8                # one block: the whole square
    assert attention_pairs(cfg, 0, 256) == 256 * 256 * 3 // 4  # 2 blocks: 128 x 128 + 128 x 256
    assert attention_pairs(cfg, 0, 1024) == 1024 * 1024 * 9 // 16  # 8 blocks of 128 rows
