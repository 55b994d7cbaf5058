"""A split GGUF model merged into one file to train (app.engine.hub.merge)."""

from __future__ import annotations

import pytest

from app.engine.errors import ModelFormatError
from app.engine.hub.merge import trainable_path
from tests.conftest import GOLDEN
from tests.gguf_build import assert_same_model
from tests.hub_server import write_split_gguf


def test_merged_once_and_a_missing_part_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    parts = write_split_gguf(GOLDEN / "olmoe-f32.gguf", tmp_path, "olmoe-F32")
    assert trainable_path(GOLDEN / "olmoe-q8_0.gguf") == GOLDEN / "olmoe-q8_0.gguf"  # one file
    merged = trainable_path(parts[1], "repo/commit")          # any part names the model
    assert merged == tmp_path / "cache" / "merged-models" / "repo" / "commit" / "olmoe-F32.gguf"
    assert_same_model(merged, GOLDEN / "olmoe-f32.gguf")
    stamp = merged.stat().st_mtime_ns
    assert trainable_path(parts[0], "repo/commit") == merged and merged.stat().st_mtime_ns == stamp
    parts[1].unlink()
    with pytest.raises(ModelFormatError, match="lacks olmoe-F32-00002-of-00002.gguf"):
        trainable_path(parts[0], "repo/other")


@pytest.mark.parametrize("source", ["mixtral-q8_0.gguf", "gemma3-q4_0.gguf"])
def test_the_parts_headers_make_the_merged_file_s_header(tmp_path, monkeypatch, source):
    """merged_header (what fits of a split model before its download) from the parts' headers
    and sizes only: byte for byte the header of the file trainable_path writes, and its size
    (quantized tensors too: their shapes and byte sizes carried over)."""
    from app.engine.hub.header import header_length
    from app.engine.hub.merge import merged_header

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    parts = write_split_gguf(GOLDEN / source, tmp_path, "m")
    heads = []
    for p in parts:
        data = p.read_bytes()
        heads.append((data[:header_length(data)], len(data)))
    header, size = merged_header(heads)
    merged = trainable_path(parts[0], "k").read_bytes()
    assert size == len(merged) and header == merged[:header_length(merged)]
    with pytest.raises(ModelFormatError, match="hold .* tensors; the first says"):
        merged_header(heads[:1])                       # a part missing
