"""The Hub client against the local Hub (tests/hub_server.py): search, listing, downloads that
resume, checksums, the Hub's errors, offline, a full disk."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from pathlib import Path

import pytest

from app.engine.errors import Cancelled, ConfigError
from app.engine.hub import client
from app.engine.hub.client import ChecksumError, HubAuthError, HubError, HubOfflineError
from app.engine.hub.names import parse_spec
from app.engine.runtime.files import DiskFullError
from tests.conftest import GOLDEN
from tests.gguf_build import assert_same_model
from tests.hub_server import TOKEN

LLAMA = "wb-test/tiny-llama-GGUF"
MIXTRAL = "wb-test/tiny-mixtral-GGUF"
GATED = "gated-org/tiny-gemma-GGUF"
MOE = "wb-test/tiny-moe-GGUF"
Q8 = "tiny-llama-Q8_0.gguf"


def _model(repo: str, select: str):
    return client.choose(client.list_models(repo), parse_spec(f"{repo}:{select}"))


def _cache(hub) -> Path:
    return Path(os.environ["HF_HOME"]) / "hub"


def _leftovers(repo: str, hub) -> dict[str, list[str]]:
    """Files under the repository's blobs/ and snapshots/ in the cache."""
    storage = _cache(hub) / ("models--" + repo.replace("/", "--"))
    out = {}
    for part in ("blobs", "snapshots"):
        folder = storage / part
        out[part] = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                           if p.is_file() or p.is_symlink()) if folder.exists() else []
    return out


def test_search_finds_gguf_repositories_sorted_and_by_author(hub):
    hits = client.search("tiny")
    assert [h.repo_id for h in hits] == [LLAMA, MIXTRAL, GATED, MOE]  # downloads, descending
    assert (hits[0].downloads, hits[0].likes) == (1200, 7)
    assert [h.repo_id for h in client.search("tiny", sort="likes")] == [MIXTRAL, LLAMA, GATED,
                                                                        MOE]
    assert [h.repo_id for h in client.search("", author="gated-org")] == [GATED]
    assert hits[2].gated
    with pytest.raises(ConfigError, match="sort"):
        client.search("tiny", sort="trending")


def test_files_are_grouped_with_sizes_and_quants(hub, hub_repos):
    models = client.list_models(MIXTRAL)
    by_name = {m.name: m for m in models}
    assert set(by_name) == {"tiny-mixtral-Q8_0.gguf", "tiny-mixtral-F32.gguf"}
    split = by_name["tiny-mixtral-F32.gguf"]
    files = hub_repos[MIXTRAL].files
    assert split.is_split and [f.path for f in split.files] == [
        "tiny-mixtral-F32-00001-of-00002.gguf", "tiny-mixtral-F32-00002-of-00002.gguf"]
    assert split.size == sum(len(files[f.path]) for f in split.files)
    assert split.quant == "F32" and by_name["tiny-mixtral-Q8_0.gguf"].quant == "Q8_0"
    assert split.files[0].sha256 == hashlib.sha256(files[split.files[0].path]).hexdigest()
    assert [m.name for m in client.list_models(LLAMA)] == [Q8, "tiny-llama-F32.gguf"]  # no README


def test_choose_by_quant_file_or_the_only_model(hub):
    models = client.list_models(LLAMA)
    assert client.choose(models, parse_spec(f"{LLAMA}:q8_0")).name == Q8
    assert client.choose(models, parse_spec(f"{LLAMA}:tiny-llama-F32.gguf")).quant == "F32"
    with pytest.raises(ConfigError, match="Q8_0, F32|F32, Q8_0"):
        client.choose(models, parse_spec(LLAMA))
    with pytest.raises(ConfigError, match="no 'Q2_K'"):
        client.choose(models, parse_spec(f"{LLAMA}:Q2_K"))


def test_download_lands_in_the_cache_byte_identical_and_the_client_finds_it(hub, hub_repos):
    seen = []
    path = client.download(_model(LLAMA, "Q8_0"), progress=lambda d, t, n: seen.append((d, t)))
    assert path.read_bytes() == hub_repos[LLAMA].files[Q8]
    assert seen[-1] == (len(hub_repos[LLAMA].files[Q8]),) * 2
    from huggingface_hub import hf_hub_download

    found = hf_hub_download(LLAMA, Q8, cache_dir=_cache(hub), local_files_only=True)
    assert Path(found) == path
    assert client.cached_models()[0].repo_id == LLAMA
    # A second get asks the Hub for the metadata only: no byte of the file again.
    gets = len(hub.ranges(Q8))
    assert client.download(_model(LLAMA, "Q8_0")) == path
    assert len(hub.ranges(Q8)) == gets
    assert not any(n.endswith(".incomplete") for n in _leftovers(LLAMA, hub)["blobs"])


def test_a_dropped_connection_resumes_from_the_byte_it_stopped_at(hub, hub_repos):
    hub.drop_after[Q8] = 20_000
    path = client.download(_model(LLAMA, "Q8_0"))
    assert path.read_bytes() == hub_repos[LLAMA].files[Q8]
    assert hub.ranges(Q8) == [None, "bytes=20000-"]


def test_a_server_without_ranges_restarts_the_file_and_serves_headers(hub, hub_repos):
    hub.no_ranges = True
    hub.drop_after[Q8] = 20_000
    fit = client.what_fits(_model(LLAMA, "Q8_0"))     # the header from a 200: only its bytes
    assert fit.supported and fit.quant == "Q8_0"
    path = client.download(_model(LLAMA, "Q8_0"))
    assert path.read_bytes() == hub_repos[LLAMA].files[Q8]
    assert hub.ranges(Q8)[-1] == "bytes=20000-"       # asked; answered from byte 0


def test_a_tcp_reset_resumes_too(hub, hub_repos):
    hub.reset = True
    hub.drop_after[Q8] = 20_000
    path = client.download(_model(LLAMA, "Q8_0"))
    assert path.read_bytes() == hub_repos[LLAMA].files[Q8]
    # httpx2.ReadError, then a second request from what arrived (a reset may drop bytes the
    # client had not read yet, so where it resumes is not asserted)
    assert len(hub.ranges(Q8)) == 2


def test_an_interruption_resumes_in_the_next_call(hub, hub_repos):
    hub.drop_after[Q8] = 30_000
    with pytest.raises(HubError, match="interrupted.*30,000 of 50,208.*again"):
        client.download(_model(LLAMA, "Q8_0"), retries=0)
    left = _leftovers(LLAMA, hub)
    assert left["snapshots"] == [] and len(left["blobs"]) == 1
    assert left["blobs"][0].endswith(client.PARTIAL_SUFFIX)
    seen = []
    path = client.download(_model(LLAMA, "Q8_0"), progress=lambda d, t, n: seen.append(d))
    assert hub.ranges(Q8)[-1] == "bytes=30000-" and seen[0] == 30_000
    assert path.read_bytes() == hub_repos[LLAMA].files[Q8]
    assert not any(n.endswith(".incomplete") for n in _leftovers(LLAMA, hub)["blobs"])


def test_a_cancel_keeps_the_part_for_the_next_call(hub, hub_repos):
    cancel = threading.Event()

    def progress(done, total, name):
        if done >= 10_000:
            cancel.set()

    hub.drop_after[Q8] = 10_000           # the first body stops there; the retry is cancelled
    with pytest.raises(Cancelled, match="kept"):
        client.download(_model(LLAMA, "Q8_0"), progress=progress, cancel=cancel)
    assert _leftovers(LLAMA, hub)["snapshots"] == []
    path = client.download(_model(LLAMA, "Q8_0"))
    assert hub.ranges(Q8)[-1] == "bytes=10000-"
    assert path.read_bytes() == hub_repos[LLAMA].files[Q8]


def test_a_wrong_checksum_leaves_nothing(hub):
    hub.corrupt.add(Q8)
    with pytest.raises(ChecksumError, match="checksum"):
        client.download(_model(LLAMA, "Q8_0"))
    assert _leftovers(LLAMA, hub) == {"blobs": [], "snapshots": []}


def test_a_plain_server_s_md5_or_sha1_etag_and_a_git_file_are_verified(hub, hub_repos, monkeypatch):
    import hashlib as h

    from huggingface_hub import file_download

    real = file_download.get_hf_file_metadata

    def md5_etag(*a, **k):                 # an endpoint whose ETag is the body's MD5
        meta = real(*a, **k)
        return meta.__class__(**{**meta.__dict__, "etag": h.md5(
            hub_repos[LLAMA].files[Q8]).hexdigest()})

    monkeypatch.setattr("huggingface_hub.get_hf_file_metadata", md5_etag)
    assert client.download_file(LLAMA, Q8).read_bytes() == hub_repos[LLAMA].files[Q8]
    digest = h.sha1                        # then one whose ETag is the body's plain SHA-1
    monkeypatch.setattr("huggingface_hub.get_hf_file_metadata", lambda *a, **k: real(
        *a, **k).__class__(**{**real(*a, **k).__dict__, "etag": digest(
            hub_repos[LLAMA].files["tiny-llama-F32.gguf"]).hexdigest()}))
    f32 = client.download_file(LLAMA, "tiny-llama-F32.gguf")
    assert f32.read_bytes() == hub_repos[LLAMA].files["tiny-llama-F32.gguf"]
    monkeypatch.setattr("huggingface_hub.get_hf_file_metadata", md5_etag)
    with pytest.raises(ChecksumError):                       # a file whose ETag is Q8's MD5
        client.download_file(MIXTRAL, "tiny-mixtral-Q8_0.gguf")
    monkeypatch.setattr("huggingface_hub.get_hf_file_metadata", real)
    readme = client.download_file(LLAMA, "README.md")        # in git: its blob id
    assert readme.read_bytes() == hub_repos[LLAMA].files["README.md"]


def test_a_body_longer_than_announced_is_refused(hub):
    hub.advertised_size[Q8] = 1000
    with pytest.raises(HubError, match="more of .* than its announced size"):
        client.download(_model(LLAMA, "Q8_0"))
    assert _leftovers(LLAMA, hub)["snapshots"] == []


def test_a_body_shorter_than_announced_is_a_clear_error(hub):
    hub.advertised_size[Q8] = 60_000
    with pytest.raises(HubError, match="HTTP 416|interrupted"):
        client.download(_model(LLAMA, "Q8_0"), retries=1)
    assert _leftovers(LLAMA, hub)["snapshots"] == []


def test_a_full_disk_says_so_and_the_next_call_resumes(hub, hub_repos, monkeypatch):
    real = client._write
    kept = []
    f32 = "tiny-llama-F32.gguf"              # 171 KB: more than one network read

    def disk_fills_at_the_second_write(f, chunk):
        if kept:
            real(f, chunk[:100])               # a short write, then the error
            raise OSError(errno.ENOSPC, "No space left on device")
        kept.append(len(chunk))
        real(f, chunk)

    monkeypatch.setattr(client, "_write", disk_fills_at_the_second_write)
    with pytest.raises(DiskFullError, match="disk is full.*tiny-llama-F32.gguf.*resumes"):
        client.download(_model(LLAMA, "F32"))
    left = _leftovers(LLAMA, hub)
    assert left["snapshots"] == [] and left["blobs"][0].endswith(client.PARTIAL_SUFFIX)
    monkeypatch.setattr(client, "_write", real)
    path = client.download(_model(LLAMA, "F32"))
    assert path.read_bytes() == hub_repos[LLAMA].files[f32]
    assert hub.ranges(f32)[-1] == f"bytes={kept[0]}-"     # the short write was not kept


def test_too_little_free_space_is_said_before_a_byte_is_fetched(hub, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9,
                                                                                  1000))
    with pytest.raises(DiskFullError, match="needs 50,208 more bytes .* 1,000 free"):
        client.download(_model(LLAMA, "Q8_0"))
    assert hub.ranges(Q8) == [] and _leftovers(LLAMA, hub)["snapshots"] == []


def test_the_listing_sha256_is_checked_too(hub):
    model = _model(LLAMA, "Q8_0")
    wrong = client.HubModel(model.repo_id, (client.HubFile(model.files[0].path,
                                                           model.files[0].size, "0" * 64),),
                            model.quant)
    with pytest.raises(ChecksumError, match="expected 000000000000"):
        client.download(wrong)


def test_gated_without_a_token_says_how_to_log_in(hub):
    with pytest.raises(HubAuthError, match="gated") as e:
        client.list_models(GATED)
    assert "HF_TOKEN" in e.value.hint and "hf auth login" in e.value.hint


def test_gated_with_a_token_without_access_says_to_ask_for_it(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_someone_else")
    with pytest.raises(HubAuthError, match="no access.*403") as e:
        client.list_models(GATED)
    assert "hf_someone_else" not in str(e.value) + e.value.hint


def test_gated_with_the_token_downloads_and_the_token_stays_in_the_header(hub, hub_repos,
                                                                          monkeypatch, caplog):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    path = client.download(_model(GATED, "Q8_0"))
    assert path.read_bytes() == hub_repos[GATED].files["tiny-gemma-Q8_0.gguf"]
    assert f"Bearer {TOKEN}" in hub.authorizations
    assert TOKEN not in caplog.text
    assert not any(TOKEN.encode() in p.read_bytes() for p in Path(os.environ["HF_HOME"]).rglob("*")
                   if p.is_file() and not p.is_symlink() and p.stat().st_size < 1 << 20)


def test_a_redirect_to_the_storage_does_not_carry_the_token(hub, hub_repos, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub.cdn = True
    hub.drop_after[Q8] = 20_000                  # and a resume goes through the redirect too
    path = client.download(_model(LLAMA, "Q8_0"))
    assert path.read_bytes() == hub_repos[LLAMA].files[Q8]
    sent = list(zip(hub.requests, hub.authorizations))
    storage = [auth for (method, p, _r), auth in sent if p.startswith("/cdn/")]
    hub_side = [auth for (method, p, _r), auth in sent if "/resolve/" in p]
    assert len(storage) == 2 and storage == [None, None]      # the body, then the resume
    assert hub_side and all(a == f"Bearer {TOKEN}" for a in hub_side)
    assert [r for m, p, r in hub.requests if p.startswith("/cdn/")] == [None, "bytes=20000-"]


def test_the_login_token_file_is_used(hub, hub_repos, monkeypatch):
    home = Path(os.environ["HF_HOME"])
    home.mkdir(parents=True)
    (home / "token").write_text(TOKEN + "\n")
    assert client.list_models(GATED)[0].quant == "Q8_0"


def test_not_found_repository_and_file(hub):
    with pytest.raises(HubError, match="not found, or it is private") as e:
        client.list_models("wb-test/no-such-GGUF")
    assert e.value.kind == "hub_auth"          # the Hub's 401 for an unknown repo, anonymous
    with pytest.raises(HubError, match="has no file"):
        client.download_file(LLAMA, "nope.gguf")


def test_server_errors_and_garbage_are_clear_errors(hub, monkeypatch):
    import huggingface_hub.utils._http as http

    monkeypatch.setattr(http.time, "sleep", lambda s: None)   # the client's retries, at once
    hub.status["/api/models"] = 500
    with pytest.raises(HubError, match="HTTP 500.*server error"):
        client.search("tiny")
    with pytest.raises(HubError, match="HTTP 500"):
        client.list_models(LLAMA)
    hub.status.clear()
    hub.status["/resolve/"] = 500
    with pytest.raises(HubError, match="HTTP 500"):
        client.download_file(LLAMA, Q8)
    hub.status.clear()
    hub.status["/api/models"] = 429
    with pytest.raises(HubError, match="rate-limiting"):
        client.search("tiny")
    hub.status["/api/models"] = 401
    with pytest.raises(HubAuthError, match="wants a token"):
        client.search("tiny")
    hub.status.clear()
    hub.garbage.add("/api/models")
    with pytest.raises(HubError, match="does not understand"):
        client.search("tiny")
    with pytest.raises(HubError, match="does not understand"):
        client.list_models(LLAMA)


def test_offline_lists_the_cache_and_refuses_to_search(hub, hub_repos, monkeypatch):
    path = client.download(_model(LLAMA, "Q8_0"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubOfflineError, match="HF_HUB_OFFLINE"):
        client.search("tiny")
    assert client.download_file(LLAMA, Q8) == path
    assert client.find_cached(parse_spec(f"{LLAMA}:Q8_0")) == path
    assert [c.name for c in client.cached_models()] == [Q8]


@pytest.mark.parametrize("endpoint", ["closed port", "unresolvable host"])
def test_no_network_is_said_plainly_at_the_first_try(endpoint, tmp_path, monkeypatch):
    """A refused connection or a name that does not resolve is "No network" after one attempt
    per call (the client's own loop would try 6 times with 1+2+4+8+8 s of backoff: ~23 s)."""
    from tests.hub_server import UNRESOLVABLE, closed_port, count_attempts

    attempts = count_attempts(monkeypatch)
    url = f"http://127.0.0.1:{closed_port()}" if endpoint == "closed port" else UNRESOLVABLE
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    model = client.HubModel(LLAMA, (client.HubFile(Q8, 1000, None),), "Q8_0")
    for call in (lambda: client.search("tiny"), lambda: client.list_models(LLAMA),
                 lambda: client.download_file(LLAMA, Q8), lambda: client.what_fits(model)):
        attempts.clear()
        with pytest.raises(HubOfflineError, match="^No network: ") as e:
            call()
        assert len(attempts) == 1, attempts
        assert ("refused" if endpoint == "closed port" else "does not resolve") in e.value.message
        assert "workbench models list" in e.value.hint


def test_what_fits_reads_the_header_only(hub, hub_repos):
    fit = client.what_fits(_model(LLAMA, "Q8_0"))
    assert fit.supported and fit.architecture == "llama" and fit.fits
    assert fit.need > 0 and fit.have > 0
    assert hub.ranges(Q8) == [f"bytes=0-{len(hub_repos[LLAMA].files[Q8]) - 1}"]
    split = client.what_fits(_model(MIXTRAL, "F32"))
    assert split.supported and split.fits and split.architecture == "llama"
    assert "merged into one to train" in split.note


def test_a_split_model_s_estimate_is_the_merged_file_s(hub, hub_repos):
    """Every part's header read with ranged requests, the estimate before the download equal
    to the one of the file the parts merge into (and of the unsplit file they were cut from:
    the same tensors, the same metadata but the split.* keys)."""
    from dataclasses import replace

    from app.engine.hub.header import fits_here
    from app.engine.hub.merge import merged_header, trainable_path

    model = _model(MIXTRAL, "F32")
    fit = client.what_fits(model, rank=8, context=256)
    parts = [f.path for f in model.files]
    for name in parts:                                 # closed ranges only: no weights
        assert hub.ranges(name) and all(r and not r.endswith("-") for r in hub.ranges(name))
    merged = trainable_path(client.download(model), key="test")
    header, size = merged_header([client.read_header(MIXTRAL, name) for name in parts])
    assert size == merged.stat().st_size                 # the merged file's layout exactly
    assert header == merged.read_bytes()[:len(header)]
    want = fits_here(merged.read_bytes(), merged.stat().st_size, merged.name, 8, 256)
    assert fit.need is not None and fit.need == want.need and fit.have == want.have
    assert replace(fit, note="") == replace(want, note="")
    golden = GOLDEN / "mixtral-f32.gguf"
    assert fit.need == fits_here(golden.read_bytes(), golden.stat().st_size, golden.name, 8,
                                 256).need


def test_copy_to_a_folder_takes_every_part(hub, hub_repos, tmp_path):
    path = client.download(_model(MIXTRAL, "F32"))
    out = client.copy_to(path, tmp_path / "models")
    assert out.name == "tiny-mixtral-F32-00001-of-00002.gguf"
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "tiny-mixtral-F32-00001-of-00002.gguf", "tiny-mixtral-F32-00002-of-00002.gguf"]
    linked = client.copy_to(path, tmp_path / "linked", link=True)
    assert linked.read_bytes() == hub_repos[MIXTRAL].files[linked.name]


def test_a_split_model_in_a_folder_of_the_repository(hub, hub_repos, tmp_path, monkeypatch):
    from app.engine.hub.merge import trainable_path
    from tests.hub_server import FakeHub, Repo, point_at

    files = hub_repos[MIXTRAL].files
    parts = {f"F32/{n}": files[n] for n in sorted(files) if "-of-" in n}
    with FakeHub({"wb-test/folders-GGUF": Repo("wb-test/folders-GGUF", parts)}) as other:
        point_at(monkeypatch, other, tmp_path / "hf")
        [model] = client.list_models("wb-test/folders-GGUF")
        assert model.name == "F32/tiny-mixtral-F32.gguf" and model.quant == "F32"
        path = client.download(model)
        assert path.relative_to(path.parents[1]).as_posix() == \
            "F32/tiny-mixtral-F32-00001-of-00002.gguf"
        assert client.find_cached(parse_spec("wb-test/folders-GGUF:F32")) == path
        monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "wb"))
        assert_same_model(trainable_path(path, "folders"), GOLDEN / "mixtral-f32.gguf")
