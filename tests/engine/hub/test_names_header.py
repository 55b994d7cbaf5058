"""File names (quant, split parts), model specs, and the GGUF header's length."""

from __future__ import annotations

import pytest

from app.engine.errors import ConfigError, ModelFormatError
from app.engine.hub.header import header_length
from app.engine.hub.names import looks_like_repo, parse_spec, quant_of, split_part
from app.engine.io.gguf import read_gguf
from tests.conftest import GOLDEN


@pytest.mark.parametrize("name, quant", [
    ("Qwen3-0.6B-Q4_K_M.gguf", "Q4_K_M"), ("Qwen3-0.6B-UD-Q4_K_XL.gguf", "UD-Q4_K_XL"),
    ("gemma-3-270m-it-F16.gguf", "F16"), ("model.bf16.gguf", "BF16"),
    ("Llama-3.1-8B-Instruct-IQ2_XXS.gguf", "IQ2_XXS"), ("x-q8_0.gguf", "Q8_0"),
    ("Q4_K_M/DeepSeek-R1-Q4_K_M-00001-of-00009.gguf", "Q4_K_M"), ("gpt-oss-20b-MXFP4.gguf",
                                                                    "MXFP4"),
    ("mistral-7b.gguf", ""), ("Qwen2.5-7B-Q3.gguf", ""),
])
def test_quant_from_the_file_name(name, quant):
    assert quant_of(name) == quant


def test_split_parts():
    assert split_part("a-Q8_0-00002-of-00003.gguf") == ("a-Q8_0", 2, 3)
    assert split_part("a-Q8_0.gguf") is None


def test_model_specs():
    assert parse_spec("unsloth/Qwen3-0.6B-GGUF:Q4_K_M").select == "Q4_K_M"
    assert parse_spec("o/n").select == ""
    assert looks_like_repo("o/n:Q8_0") and not looks_like_repo("./o/n")
    assert not looks_like_repo("/models/a.gguf") and not looks_like_repo("models/a.gguf")
    with pytest.raises(ConfigError, match="owner/name"):
        parse_spec("just-a-name")


def test_model_specs_with_a_revision():
    spec = parse_spec("o/n:Q4_K_M@v1.0")
    assert (spec.repo_id, spec.select, spec.revision) == ("o/n", "Q4_K_M", "v1.0")
    assert parse_spec("o/n").revision == "main" and str(parse_spec("o/n@dev")) == "o/n@dev"
    assert parse_spec("o/n:a.gguf", revision="refs/pr/3").revision == "refs/pr/3"
    assert parse_spec("o/n@abc", revision="abc").revision == "abc"
    assert looks_like_repo("o/n@v1") and looks_like_repo("o/n:Q8_0@v1")
    for bad in ("o/n@", "o/n@..", "o/n@a b", "o/n@v1@v2", "o/n@-x", "o/n@a//b"):
        with pytest.raises(ConfigError):
            parse_spec(bad)
    with pytest.raises(ConfigError, match="once"):
        parse_spec("o/n@v1", revision="v2")


@pytest.mark.parametrize("name", ["llama-q8_0", "mixtral-f32", "gemma3-q4_0", "olmoe-lora"])
def test_header_length_is_where_the_reader_puts_the_data(name):
    data = (GOLDEN / f"{name}.gguf").read_bytes()
    n = header_length(data)
    f = read_gguf(GOLDEN / f"{name}.gguf")
    assert n == f.data_offset
    f.close()
    assert header_length(data[:n // 2]) is None and header_length(data[:4]) is None


def test_header_length_refuses_what_is_not_gguf():
    with pytest.raises(ModelFormatError, match="GGUF"):
        header_length(b"<html>not a model</html>")


def test_the_header_confirms_the_quant_of_the_name():
    from app.engine.hub.header import fits_here, quant_shown

    data = (GOLDEN / "llama-q8_0.gguf").read_bytes()
    header = data[:header_length(data)]
    fit = fits_here(header, len(data), "renamed-Q4_K_M.gguf")
    assert fit.quant == "Q8_0" and fit.architecture == "llama" and fit.supported
    assert quant_shown("Q4_K_M", fit) == "Q4_K_M (header: Q8_0)"     # the name lies
    assert quant_shown("Q8_0", fit) == "Q8_0" and quant_shown("", fit) == "Q8_0"
    xl = fit.__class__("llama", True, 1, 2, "", "Q4_K_M")
    assert quant_shown("UD-Q4_K_XL", xl) == "UD-Q4_K_XL"             # a mix of Q4_K_M's family
    assert quant_shown("Q4_K_S", xl) == "Q4_K_S (header: Q4_K_M)"
    assert quant_shown("F16", None) == "F16" and quant_shown("", None) == "-"
