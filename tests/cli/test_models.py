"""`workbench models` and `train -m owner/name[:QUANT]` against the local Hub."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from app.cli.main import run_cli
from tests.conftest import GOLDEN, SAMPLE_DATA
from tests.gguf_build import assert_same_model
from tests.hub_server import TOKEN, hub, hub_repos  # noqa: F401  (the fixtures)

LLAMA = "wb-test/tiny-llama-GGUF"
Q8 = "tiny-llama-Q8_0.gguf"


def test_search_prints_a_table_and_json(hub, capsys):
    assert run_cli(["models", "search", "tiny", "--sort", "likes"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["REPOSITORY", "DOWNLOADS", "LIKES", "UPDATED"]
    assert out[1].split()[:3] == ["wb-test/tiny-mixtral-GGUF", "300", "40"]
    assert "(gated)" in out[-1] or "(gated)" in out[-2]
    assert run_cli(["models", "search", "llama", "--author", "wb-test", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert [h["repo"] for h in hits] == [LLAMA]


def test_files_lists_models_quants_sizes_and_what_fits(hub, capsys):
    assert run_cli(["models", "files", "wb-test/tiny-mixtral-GGUF", "--fits"]) == 0
    out = capsys.readouterr().out
    assert "tiny-mixtral-F32.gguf" in out and "F32" in out and "split into 2 files" in out
    assert "merged into one to train" in out and out.count("fits: needs about") == 2
    assert "tiny-mixtral-Q8_0.gguf" in out and "fits: needs about" in out
    assert run_cli(["models", "files", LLAMA, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(m["name"], m["quant"], m["size"]) for m in listed] == [
        (Q8, "Q8_0", 50208), ("tiny-llama-F32.gguf", "F32", 171040)]


def test_get_interrupted_once_resumes_and_prints_the_path(hub, hub_repos, capsys, monkeypatch):
    hub.drop_after[Q8] = 12_345
    assert run_cli(["models", "get", f"{LLAMA}:Q8_0"]) == 0
    out, err = capsys.readouterr()
    path = Path(out.strip())
    assert path.read_bytes() == hub_repos[LLAMA].files[Q8]
    assert hub.ranges(Q8)[-1] == "bytes=12345-"
    assert "fits" in err and "100%" in err                   # the check and the progress
    # a second get is the cache's: no download
    assert run_cli(["models", "get", f"{LLAMA}:Q8_0"]) == 0
    assert Path(capsys.readouterr().out.strip()) == path
    assert len([r for r in hub.ranges(Q8)]) == 3          # header read, first body, the resume
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")            # offline: the cache answers
    assert run_cli(["models", "get", f"{LLAMA}:Q8_0"]) == 0
    assert Path(capsys.readouterr().out.strip()) == path


def test_get_to_a_folder_and_list(hub, hub_repos, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))     # no scan of the real home folder
    assert run_cli(["models", "get", "wb-test/tiny-mixtral-GGUF:F32", "--to",
                    str(tmp_path / "out")]) == 0
    out = Path(capsys.readouterr().out.strip())
    assert out.parent == tmp_path / "out" and len(list(out.parent.iterdir())) == 2
    assert run_cli(["models", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(m["name"], m["source"]) for m in listed] == [("wb-test/tiny-mixtral-GGUF:F32",
                                                           "Hugging Face")]


def test_errors_are_one_line_and_a_hint_never_a_traceback(hub, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cases = [
        (["models", "files", "gated-org/tiny-gemma-GGUF"], "gated", "HF_TOKEN"),
        (["models", "files", "wb-test/nope-GGUF"], "not found", "private"),
        (["models", "get", f"{LLAMA}:Q2_K"], "no 'Q2_K' model", "Q8_0"),
        (["models", "get", "not-a-repo"], "not a Hugging Face model", "owner/name"),
    ]
    for argv, message, hint in cases:
        assert run_cli(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and hint in err and "Traceback" not in err, err
    hub.corrupt.add(Q8)
    assert run_cli(["models", "get", f"{LLAMA}:Q8_0"]) == 2
    assert "checksum" in capsys.readouterr().err
    hub.garbage.add("/tree/")
    assert run_cli(["models", "files", LLAMA]) == 2
    assert "does not understand" in capsys.readouterr().err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert run_cli(["models", "search", "tiny"]) == 2
    assert "HF_HUB_OFFLINE" in capsys.readouterr().err
    assert run_cli(["models", "list"]) == 0
    assert "offline" in capsys.readouterr().err


def test_the_token_is_used_and_never_printed(hub, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert run_cli(["models", "get", "gated-org/tiny-gemma-GGUF", "--json"]) == 0
    out, err = capsys.readouterr()
    assert Path(json.loads(out)["path"]).is_file()
    assert TOKEN not in out + err


@pytest.mark.slow
def test_train_from_the_hub_resolves_through_the_cache(hub, hub_repos, tmp_path, capsys,
                                                       monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)          # sent to the Hub, written nowhere
    data = str(SAMPLE_DATA / "chat.jsonl")
    assert run_cli(["train", "-m", "wb-test/tiny-moe-GGUF", "-d", data, "--max-steps", "2",
                    "--rank", "4", "-o", str(tmp_path / "run")]) == 0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    cached = Path(os.environ["HF_HOME"]) / "hub" / "models--wb-test--tiny-moe-GGUF"
    assert Path(config["model"]).is_relative_to(cached)
    assert json.loads((tmp_path / "run" / "status.json").read_text())["state"] == "done"
    assert f"Bearer {TOKEN}" in hub.authorizations
    for f in (tmp_path / "run").rglob("*"):
        assert not f.is_file() or TOKEN.encode() not in f.read_bytes(), f
    # REPO:QUANT, queued: the file is resolved (downloaded) before the run is written
    queue = tmp_path / "q.sqlite3"
    assert run_cli(["train", "-m", f"{LLAMA}:Q8_0", "-d", data, "-o", str(tmp_path / "r2"),
                    "--queue", str(queue)]) == 0
    model = Path(json.loads((tmp_path / "r2" / "config.json").read_text())["model"])
    assert model.read_bytes() == hub_repos[LLAMA].files[Q8]   # the cached blob (the run
    assert "models--wb-test--tiny-llama-GGUF" in str(model)     # resolves the snapshot link)
    # a split model: its parts merged once into one file, which the run trains on
    assert run_cli(["train", "-m", "wb-test/tiny-mixtral-GGUF:F32", "-d", data, "-o",
                    str(tmp_path / "r3"), "--queue", str(queue)]) == 0
    assert "merging the parts" in capsys.readouterr().err
    merged = Path(json.loads((tmp_path / "r3" / "config.json").read_text())["model"])
    assert merged.name == "tiny-mixtral-F32.gguf" and "merged-models" in str(merged)
    assert_same_model(merged, GOLDEN / "mixtral-f32.gguf")


def test_grpo_from_the_hub_resolves_through_the_cache(hub, hub_repos, tmp_path):
    queue = str(tmp_path / "q.sqlite3")
    assert run_cli(["grpo", "-m", "wb-test/tiny-moe-GGUF", "--prompts",
                    str(SAMPLE_DATA / "addition.jsonl"), "--reward", "exact", "-o",
                    str(tmp_path / "g"), "--queue", queue]) == 0
    model = Path(json.loads((tmp_path / "g" / "config.json").read_text())["model"])
    assert model.read_bytes() == hub_repos["wb-test/tiny-moe-GGUF"].files["tiny-moe.gguf"]


def test_a_revision_other_than_main(hub, hub_repos, capsys):
    """`@REV` (or --revision) lists, downloads and resolves for train the files of that tag;
    each revision's file is its own in the cache (a cached main is not v0's, nor the reverse)."""
    from app.cli.models import model_argument

    v0 = hub_repos[LLAMA].revisions["v0"][Q8]
    for argv in (["models", "files", f"{LLAMA}@v0", "--json"],
                 ["models", "files", LLAMA, "--revision", "v0", "--json"]):
        assert run_cli(argv) == 0
        listed = json.loads(capsys.readouterr().out)
        assert [(m["name"], m["size"], m["revision"]) for m in listed] == [(Q8, len(v0), "v0")]
    assert run_cli(["models", "get", f"{LLAMA}:Q8_0@v0"]) == 0
    got = capsys.readouterr()
    old = Path(got.out.strip())
    assert old.read_bytes() == v0 and "fits" in got.err
    assert any(m == "GET" and "/resolve/v0/" in p and r and not r.endswith("-")
               for m, p, r in hub.requests)                  # the header read at v0 too
    assert run_cli(["models", "get", f"{LLAMA}:Q8_0"]) == 0      # main: not v0's cached file
    main = Path(capsys.readouterr().out.strip())
    assert main.read_bytes() == hub_repos[LLAMA].files[Q8] and main != old
    asked = len(hub.requests)
    assert model_argument(f"{LLAMA}:Q8_0@v0") == str(old)        # train -m: from the cache
    assert run_cli(["models", "get", f"{LLAMA}:Q8_0", "--revision", "v0"]) == 0
    assert Path(capsys.readouterr().out.strip()) == old and len(hub.requests) == asked
    assert run_cli(["models", "get", f"{LLAMA}:Q8_0@v9"]) == 2
    err = capsys.readouterr().err
    assert "has no revision v9" in err and "Traceback" not in err
    for argv in (["models", "get", f"{LLAMA}:Q8_0@v0", "--revision", "main"],
                 ["models", "get", f"{LLAMA}:Q8_0@.."]):
        assert run_cli(argv) == 2
        err = capsys.readouterr().err
        assert "revision" in err and "Traceback" not in err


def test_files_fits_says_which_header_cannot_be_read_and_lists_the_rest(hub, hub_repos, capsys,
                                                                       monkeypatch):
    monkeypatch.setitem(hub_repos[LLAMA].files, "broken-Q4_0.gguf", b"not a gguf at all")
    assert run_cli(["models", "files", LLAMA, "--fits"]) == 0
    out = capsys.readouterr().out
    assert "broken-Q4_0.gguf" in out and "cannot read the header: " in out
    assert out.count("fits: needs about") == 2                 # the other two
    assert run_cli(["models", "files", LLAMA, "--fits", "--json"]) == 0
    listed = {m["name"]: m["fit"] for m in json.loads(capsys.readouterr().out)}
    assert "GGUF" in listed["broken-Q4_0.gguf"]["error"] and listed[Q8]["supported"]
