"""Cluster URLs (issue 28): checked when a cluster is made (`cluster add`, Settings > Clusters:
both through `Cluster`), credentials refused and never shown, an older clusters.json entry
with credentials loaded without them; any text given as a URL is accepted or refused with a
ConfigError, never another exception (a property test)."""

from __future__ import annotations

import json
import urllib.request
from urllib.parse import urlsplit

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.engine.errors import ConfigError
from app.engine.runs.clusters import Cluster, ClusterStore, check_url
from tests.fuzz import fuzz, fuzz_settings


@pytest.mark.parametrize("url, why", [
    ("http://[::1", "Invalid IPv6 URL"),
    ("http://head:8265\n", "control character"),
    ("http://he ad:8265", "a space"),
    ("http://head\x00:8265", "control character"),
    ("http://héad:8265", "other than ASCII"),
    ("http://head:99999", "Port out of range"),
    ("http://head:0", "port 0"),
    ("http://head:-1", "not a usable address"),
    ("http://head:abc", "not a usable address"),
    ("http://head:", "not a host name"),
    ("http://a..b:8265", "not a host name"),
    ("http://[::1]x:8265", "not a host name"),
    ("ftp://head:8265", "not an http(s) address"),
    ("head:8265", "not an http(s) address"),
    ("http://:8265", "not an http(s) address"),
    ("http://head:8265/?x=1", "query or fragment"),
    ("", "empty"),
])
def test_a_bad_url_is_refused_with_the_reason(url, why):
    with pytest.raises(ConfigError, match=why.replace("(", r"\(").replace(")", r"\)")) as e:
        Cluster("lab", url)
    assert e.value.hint


@pytest.mark.parametrize("url, kept", [
    ("http://head-node:8265/", "http://head-node:8265"),
    ("https://[::1]:8265", "https://[::1]:8265"),
    ("http://10.0.0.2:65535/ray/", "http://10.0.0.2:65535/ray"),
    ("http://ray_head.lab.example.:1", "http://ray_head.lab.example.:1"),
])
def test_a_good_url_is_kept(url, kept):
    assert Cluster("lab", url).url == kept


def test_credentials_are_refused_with_the_token_as_the_way_and_never_repeated():
    with pytest.raises(ConfigError, match="user name or password") as e:
        Cluster("lab", "http://alice:s3cret@head:8265")
    assert "s3cret" not in e.value.message + e.value.hint and "alice" not in e.value.message
    assert "--token-stdin" in e.value.hint and "keyring" in e.value.hint
    with pytest.raises(ConfigError, match="user name or password"):
        Cluster("lab", "http://alice@head:8265")


@pytest.mark.parametrize("field, value", [("num_cpus", -1), ("num_gpus", float("nan")),
                                          ("num_cpus", float("inf")), ("python", "py\nthon"),
                                          ("python", "")])
def test_resources_and_python_are_checked(field, value):
    with pytest.raises(ConfigError):
        Cluster("lab", "http://head:8265", **{field: value})


def test_an_older_entry_with_credentials_is_loaded_without_them(tmp_path):
    path = tmp_path / "clusters.json"
    path.write_text(json.dumps({"clusters": [
        {"name": "old", "url": "http://bob:hunter2@head:8265", "path_map": []}]}))
    store = ClusterStore(path)
    assert store.get("old").url == "http://head:8265"
    store.save(Cluster("new", "http://other:8265"))  # any write leaves the password out
    assert "hunter2" not in path.read_text()


@fuzz
@fuzz_settings(400)
@given(url=st.one_of(
    st.text(max_size=40),
    st.builds(lambda scheme, auth, host, port, path: f"{scheme}://{auth}{host}{port}{path}",
              st.sampled_from(["http", "https", "HTTP", "ftp", ""]),
              st.sampled_from(["", "u:p@", "@", "u@"]),
              st.text(st.characters(codec="utf-8"), max_size=12) | st.sampled_from(
                  ["head", "[::1]", "[::1", "10.0.0.1", "a..b", "xn--bcher-kva.example"]),
              st.sampled_from(["", ":", ":8265", ":99999", ":0", ":-1", ":1e3"])
              | st.integers(-10, 10**6).map(lambda n: f":{n}"),
              st.text(max_size=10))))
def test_any_text_is_a_usable_url_or_a_config_error(url):
    try:
        kept = check_url(url)
    except ConfigError as e:
        assert e.message and e.hint
        return
    parts = urlsplit(kept)  # what the executor's client will make of it
    assert parts.scheme in ("http", "https") and parts.hostname
    assert parts.port is None or 1 <= parts.port <= 65535
    assert "@" not in parts.netloc and kept.isprintable() and not any(c.isspace() for c in kept)
    urllib.request.Request(kept + "/api/version")


@pytest.mark.parametrize("entry", [
    {"name": "old", "url": "http://head:99999"}, {"name": "old", "url": "http://a\nb"},
    {"name": "old", "url": "http://head:1", "num_cpus": "many"},
    {"name": "old", "url": "http://head:1", "path_map": [["/a"]]},
    {"name": "old", "url": "http://head:1", "path_map": 5}, {"name": "old", "url": None}])
def test_an_entry_written_before_the_checks_is_named_with_the_way_out(tmp_path, entry):
    path = tmp_path / "clusters.json"
    path.write_text(json.dumps({"clusters": [entry, {"name": ["odd"]}]}))
    store = ClusterStore(path)
    with pytest.raises(ConfigError, match="Cluster 'old' in .* is not usable") as e:
        store.list()
    assert "workbench cluster remove old" in e.value.hint
    store.remove("old")
    assert store.list() == []


def test_a_run_under_a_linked_shared_folder_is_mapped_by_its_resolved_path(tmp_path):
    """The queue keys a run by its resolved path: a local prefix that is a link to the shared
    folder still maps it (it did not: 'not under a shared folder')."""
    from app.engine.runs.clusters import PathMap

    (tmp_path / "real" / "runs").mkdir(parents=True)
    (tmp_path / "shared").symlink_to(tmp_path / "real")
    path_map = PathMap.parse(f"{tmp_path / 'shared'}=/mnt/shared")
    resolved_run = (tmp_path / "shared" / "runs" / "r1").resolve()
    assert path_map.covers(resolved_run)
    assert path_map.to_cluster(resolved_run) == "/mnt/shared/runs/r1"
    assert path_map.to_cluster(tmp_path / "shared" / "runs" / "r1") == "/mnt/shared/runs/r1"
    assert not path_map.covers(tmp_path / "elsewhere")
