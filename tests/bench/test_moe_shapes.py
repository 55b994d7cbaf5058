"""python -m bench moe-shapes in several precisions: every row in each, and each
configuration's peak RSS per precision (issue 30). The rows themselves are faked (a real one
builds an OLMoE-sized layer and runs minutes)."""

from __future__ import annotations

import pytest

import bench.moe_shapes as moe_shapes

PEAK_MB = {"fp32": 3000.0, "bf16": 2400.0}          # made up: bf16 0.80x float32


def fake_row(name, n_layer, ctx, steps, cache, precision="fp32"):
    peak = PEAK_MB[precision] * n_layer
    return {"step_ms": 1000.0 * n_layer, "tokens_per_s": 100.0, "phase_ms": {"dequant": 0.0},
            "serial_fraction": 0.1, "peak_rss_mb": peak, "estimate_mb": peak + 100}


def test_the_table_gives_the_peak_per_precision(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(moe_shapes, "_run_row", lambda *a: calls.append(a) or fake_row(*a))
    moe_shapes.main(["--models", "olmoe", "--cache", "0", "--precision", "fp32,bf16"])
    out = capsys.readouterr().out
    assert sorted((c[1], c[5]) for c in calls) == [(1, "bf16"), (1, "fp32"), (2, "bf16"),
                                                    (2, "fp32")]
    assert "peak RSS per precision (GB):" in out
    assert "olmoe x1 layers, cache 0: fp32 2.93, bf16 2.34 (0.80x)" in out
    # whole model (16 layers) projected: value(1) + 15 x (value(2) - value(1))
    assert ("olmoe whole model, projected, cache 0: fp32 46.88, bf16 37.50 (0.80x)") in out


def test_one_precision_keeps_the_table_as_it_was(monkeypatch, capsys):
    monkeypatch.setattr(moe_shapes, "_run_row", fake_row)
    moe_shapes.main(["--models", "olmoe", "--cache", "0", "--layers", "1"])
    out = capsys.readouterr().out
    assert "fp32" in out and "peak RSS per precision" not in out


def test_a_bad_precision_is_refused(capsys):
    with pytest.raises(SystemExit):
        moe_shapes.main(["--precision", "fp32,fp16"])
    assert "not 'fp16'" in capsys.readouterr().err
