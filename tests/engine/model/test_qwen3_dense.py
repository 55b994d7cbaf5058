"""`qwen3` (dense) has no llama.cpp golden file; check its wiring against the golden `qwen3moe`.

A qwen3moe layer whose experts are all the same FFN computes exactly that FFN (top-k weights are
renormalised to sum 1), so a qwen3 model with that FFN as its dense FFN must give the same logits.
qwen3moe itself is checked against llama.cpp in test_golden.py.
"""

from __future__ import annotations

import numpy as np

from app.engine import load_model
from tests.conftest import GOLDEN
from tests.gguf_build import read_all, write_gguf


def test_qwen3_dense_equals_qwen3moe_with_identical_experts(tmp_path):
    meta, tensors = read_all(GOLDEN / "qwen3moe-f32.gguf")
    same_experts = dict(tensors)
    dense_tensors = {}
    for name, arr in tensors.items():
        if name.endswith("_exps.weight"):
            same_experts[name] = np.broadcast_to(arr[:1], arr.shape).copy()
            dense_tensors[name.replace("_exps", "")] = arr[0]
        elif not name.endswith("ffn_gate_inp.weight"):
            dense_tensors[name] = arr
    moe_path = write_gguf(tmp_path / "moe.gguf", meta, same_experts)

    dense_meta = {k.replace("qwen3moe.", "qwen3."): v for k, v in meta.items()
                  if not k.startswith(("qwen3moe.expert", "general.architecture"))}
    dense_meta["general.architecture"] = "qwen3"
    dense_meta["qwen3.feed_forward_length"] = tensors["blk.0.ffn_up_exps.weight"].shape[1]
    dense_path = write_gguf(tmp_path / "dense.gguf", dense_meta, dense_tensors)

    tokens = np.arange(3, 40, 3)
    dense, moe = load_model(dense_path), load_model(moe_path)
    assert dense.config.arch == "qwen3" and not dense.config.is_moe
    assert dense.config.qk_norm == "head" and dense.config.rope_type == "neox"
    np.testing.assert_allclose(dense.logits(tokens), moe.logits(tokens), rtol=0, atol=2e-5)
