"""Property tests of JSONL dataset reading: any bytes in a file give examples or rejections
with their line numbers, or a DatasetError for the whole file; never another exception."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from app.engine.errors import DatasetError
from app.engine.data.formats import FORMATS, Example, Rejection, detect_format, read_examples
from tests.fuzz import fuzz, fuzz_settings

KEYS = ("text", "prompt", "completion", "messages", "role", "content", "instruction", "output",
        "conversations", "from", "value", "weight", "reward", "id", "system", "input")
SCALARS = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True),
                    st.integers(min_value=-2**70, max_value=2**70), st.text(max_size=20))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(KEYS), inner, max_size=4)),
    max_leaves=12)
ROWS = st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=5).map(json.dumps)
LINES = st.one_of(
    ROWS,
    VALUES.map(json.dumps),                                         # JSON, not always an object
    st.binary(max_size=40).map(lambda b: b.decode("latin-1")),      # garbage
    st.just("1" * 5000),                                            # past int()'s digit limit
    st.just('{"text": ' + "[" * 3000 + "]" * 3000 + "}"),           # deeper than json's stack
    st.just('{"text": "\\ud800"}'),                                 # a lone surrogate
)


@fuzz
@fuzz_settings(150)
@given(lines=st.lists(LINES, min_size=1, max_size=8), fmt=st.sampled_from(FORMATS))
def test_any_lines_read_as_examples_or_numbered_rejections(tmp_path_factory, lines, fmt):
    path = tmp_path_factory.mktemp("jsonl") / "data.jsonl"
    data = "\n".join(lines).encode("utf-8", "surrogatepass")
    path.write_bytes(data)
    n_lines = data.count(b"\n") + 1                    # garbage may hold line breaks too
    try:
        detect_format(path)
    except DatasetError:
        pass
    for item in read_examples(path, fmt):
        assert isinstance(item, (Example, Rejection))
        if isinstance(item, Rejection):
            assert 1 <= item.line <= n_lines and item.reason
