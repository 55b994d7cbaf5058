"""Every call path to the Hub (search, files, get, the header read of what fits) against every
fault of the test Hub (tests/hub_server.py) that bears on it: each ends in an EngineError with a
message that says what happened (never another exception, a traceback or a hang), or in the
right file. The dialog's side: tests/views/get_model/test_get_model.py."""

from __future__ import annotations

import json

import pytest

from app.engine.errors import EngineError
from app.engine.hub import client
from tests.hub_server import count_attempts

LLAMA = "wb-test/tiny-llama-GGUF"
Q8 = "tiny-llama-Q8_0.gguf"


def _q8(repo=LLAMA):
    return client.HubModel(repo, (client.HubFile(Q8, 50208, None),), "Q8_0")


PATHS = {
    "search": lambda: client.search("tiny"),
    "files": lambda: client.list_models(LLAMA),
    "get": lambda: client.download(_q8()),
    "header": lambda: client.what_fits(_q8()),
}
URLS = {"search": "/api/models", "files": "/tree/", "get": "/resolve/", "header": "/resolve/"}

# (fault, what the message says) for every path; a fault set on the path's URL
FAULTS = [
    ("500", "HTTP 500.*server error"),
    ("503", "HTTP 503.*server error"),
    ("502", "HTTP 502.*server error"),
    ("400", "HTTP 400"),
    ("418", "HTTP 418"),
    ("garbage", "does not understand|did not say the commit"),
]


def _set(hub, fault: str, url: str) -> None:
    if fault == "garbage":
        hub.garbage.add(url)
    else:
        hub.status[url] = int(fault)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("fault,message", FAULTS)
def test_every_path_says_what_a_bad_answer_is(hub, monkeypatch, path, fault, message):
    attempts = count_attempts(monkeypatch)         # the retries (of 5xx) cost no time
    _set(hub, fault, URLS[path])
    with pytest.raises(EngineError, match=message) as e:
        PATHS[path]()
    assert e.value.hint                             # and what to do
    assert len(attempts) <= 3                       # 2 retries at most, never the client's 5


# JSON of the wrong shape: a listing that is an object, items that are not objects, fields of
# the wrong type, a size that is not a number
SHAPES = {
    "search": [b'{"models": []}', b'["a", "b"]', b'[{"id": "a/b", "downloads": "many"}]',
               b'[{"id": "a/b", "lastModified": "yesterday"}]', b'[{"downloads": 1}]',
               b'null'],
    "files": [b'{"type": "file"}', b'[1, 2]', b'[{"type": "file", "path": "a.gguf"}]',
              b'[{"type": "file", "path": "a.gguf", "size": "big"}]', b'[{"path": "a.gguf"}]',
              b'[{"type": "file", "path": "a.gguf", "size": 5, "lfs": "x"}]'],
}


@pytest.mark.parametrize("path,body", [(p, b) for p, bodies in SHAPES.items() for b in bodies])
def test_json_of_the_wrong_shape_is_not_understood(hub, path, body):
    hub.body[URLS[path] if path == "files" else "/api/models"] = body
    try:
        got = PATHS[path]()
    except EngineError as e:
        assert "does not understand" in e.message, e.message
    else:                                           # read as far as it makes sense
        assert isinstance(got, list), got


SIZES = {   # an announced size other than the file's -> what each path says
    ("get", 0): "announces .* as empty", ("header", 0): "does not end within its first 0",
    ("get", 10): "more of .* than its announced size", ("header", 10): "within its first 10",
    ("get", -5): "broke the HTTP protocol.*bad Content-Length",     # not "offline"
    ("header", -5): "broke the HTTP protocol.*bad Content-Length",
    ("get", 1 << 50): "Not enough space", ("header", 1 << 50): "cannot be checked here",
}


@pytest.mark.parametrize("path,size", sorted(SIZES))
def test_a_wrong_size_is_a_clear_error(hub, path, size):
    hub.advertised_size[Q8] = size
    with pytest.raises(EngineError, match=SIZES[path, size]) as e:
        PATHS[path]()
    assert e.value.hint


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_silent_server_is_an_error_not_a_hang(hub, monkeypatch, path):
    count_attempts(monkeypatch)
    monkeypatch.setattr(client, "METADATA_TIMEOUT_S", 0.2)
    monkeypatch.setattr(client, "READ_TIMEOUT_S", 0.2)
    hub.stall.add(URLS[path])
    with pytest.raises(EngineError, match="Timeout"):
        PATHS[path]()


def test_a_header_that_is_not_gguf_is_said(hub, hub_repos, monkeypatch):
    repo = hub_repos[LLAMA]
    monkeypatch.setitem(repo.files, "fake-Q8_0.gguf", json.dumps({"no": "gguf"}).encode())
    model = client.HubModel(LLAMA, (client.HubFile("fake-Q8_0.gguf", 13, None),), "Q8_0")
    with pytest.raises(EngineError, match="not a GGUF"):
        client.what_fits(model)
