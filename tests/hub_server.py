"""A local Hugging Face Hub for the tests: the endpoints `huggingface_hub` calls, over real HTTP.

`FakeHub(repos)` serves, on loopback at a random port (threaded, one thread per connection):

- `GET /api/models?search=&author=&sort=&filter=&limit=` the repositories, filtered and sorted
  the Hub's way (descending), as ModelInfo JSON;
- `GET /api/models/{repo}[/revision/{rev}]` one repository's info with its siblings;
- `GET /api/models/{repo}/tree/{rev}[?recursive=]` the file listing with sizes and, for the LFS
  files (every .gguf), `lfs.oid` (the sha256) and size;
- `HEAD|GET /{repo}/resolve/{rev}/{file}` the file, with the headers the client reads
  (`X-Repo-Commit`, `ETag` and `X-Linked-Etag` = the sha256 for LFS files and the git blob id
  otherwise, `X-Linked-Size`, `Content-Length`) and `Range: bytes=N-` answered 206.

A repository's other revisions (`Repo.revisions`: a branch or tag name -> its files) answer at
that name and at their commit in the tree and resolve URLs; an unknown one is the Hub's 404
RevisionNotFound.

Errors come the Hub's way: `X-Error-Code` RepoNotFound / EntryNotFound / GatedRepo, 401 for a
gated repository without a token and 403 with a token that has no access.

Faults (attributes of the server, set by a test):

- `drop_after[file] = n`: close the connection after n bytes of that file's body, once, in a
  download (a GET with no Range or an open one, `bytes=N-`; not a header's closed range);
  `reset = True` makes that close a TCP reset (the client's httpx2.ReadError);
- `corrupt` (file names): serve the last byte flipped under the right checksum;
- `status[key] = code`: answer `code` to a request whose path contains `key`;
- `garbage` (path fragments): answer "{not json" with 200;
- `body[key] = bytes`: answer these bytes with 200 (JSON of the wrong shape) to a request whose
  path contains `key`;
- `advertised_size[file] = n`: announce a size other than the real one;
- `slow[file] = s`: send a download's body in 4 KiB pieces `s` seconds apart;
- `hold[file] = event`: send a download's first 4 KiB, then wait for `event` to send the rest;
- `stall` (path fragments): accept the request and never answer;
- `no_ranges = True`: ignore Range headers (200 and the whole body, as some mirrors do);
- `cdn = True`: answer an LFS file's resolve URL the Hub's way, a 302 (with X-Linked-Etag and
  X-Linked-Size) to another origin (`http://localhost:PORT/cdn/...`, the server being
  127.0.0.1), which serves the bytes.

`requests` records (method, path, Range header) of every request, `authorizations` their
Authorization headers.

Tests point the engine at it with HF_ENDPOINT=`hub.url` (the engine reads HF_ENDPOINT, HF_HOME,
HF_HUB_OFFLINE and HF_TOKEN at each call and hands them to the client explicitly, so the tests
run the client in their own process; see app/engine/hub/__init__.py).

`build_repos(folder)` makes the repositories from the golden tiny models (tests/data/golden):
real GGUF files, one split with gguf's own writer (the `split.*` keys llama.cpp's gguf-split
writes, `-00001-of-00002.gguf` names).
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

GOLDEN = Path(__file__).parent / "data" / "golden"
SAMPLE = Path(__file__).parent.parent / "sample_data"
TOKEN = "hf_test_token_0123456789"          # the only token the gated repository accepts


@dataclass
class Repo:
    repo_id: str
    files: dict[str, bytes]
    downloads: int = 0
    likes: int = 0
    gated: bool = False
    tags: tuple[str, ...] = ("gguf",)
    commit: str = ""
    revisions: dict[str, dict[str, bytes]] = field(default_factory=dict)

    def __post_init__(self):
        if not self.commit:
            self.commit = self._commit_of("", self.files)

    def _commit_of(self, revision: str, files: dict[str, bytes]) -> str:
        h = hashlib.sha1(self.repo_id.encode() + (b"@" + revision.encode() if revision else b""))
        for name in sorted(files):
            h.update(name.encode() + hashlib.sha256(files[name]).digest())
        return h.hexdigest()

    def at(self, revision: str) -> tuple[dict[str, bytes], str] | None:
        """(the files, the commit) at a branch/tag name or a commit; None if there is none."""
        if revision in ("main", self.commit):
            return self.files, self.commit
        for name, files in self.revisions.items():
            commit = self._commit_of(name, files)
            if revision in (name, commit):
                return files, commit
        return None


def is_lfs(name: str) -> bool:
    return name.endswith(".gguf")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def etag_of(name: str, data: bytes) -> str:
    return hashlib.sha256(data).hexdigest() if is_lfs(name) else git_blob_id(data)


def write_split_gguf(source: Path, folder: Path, stem: str) -> list[Path]:
    """Rewrite the F32 GGUF `source` as two shards with gguf's writer (split_max_tensors):
    `<stem>-00001-of-00002.gguf` (all the metadata and the first half of the tensors) and
    `-00002-of-00002.gguf` (the rest), each with llama.cpp's split.no/count/tensors.count."""
    from tests.gguf_build import read_all, write_gguf

    metadata, tensors = read_all(source)
    write_gguf(folder / f"{stem}.gguf", metadata, tensors, split_max_tensors=-(-len(tensors) // 2))
    shards = sorted(folder.glob(f"{stem}-0000?-of-00002.gguf"))
    assert len(shards) == 2, shards
    return shards


def build_repos(folder: Path) -> dict[str, Repo]:
    """The test Hub's repositories (real GGUF files from tests/data/golden):

    - `wb-test/tiny-llama-GGUF`: tiny-llama-Q8_0.gguf, tiny-llama-F32.gguf, README.md; its tag
      `v0` holds another tiny-llama-Q8_0.gguf (the golden Gemma 3 file) and README.md;
    - `wb-test/tiny-mixtral-GGUF`: tiny-mixtral-Q8_0.gguf and the split
      tiny-mixtral-F32-00001-of-00002.gguf / -00002-of-00002.gguf;
    - `gated-org/tiny-gemma-GGUF` (gated): tiny-gemma-Q8_0.gguf;
    - `wb-test/tiny-moe-GGUF`: the sample model (sample_data/tiny-moe.gguf), trainable on
      sample_data/chat.jsonl;
    - `wb-test/tiny-llama` (no GGUF: not a search hit with filter=gguf)."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = write_split_gguf(GOLDEN / "mixtral-f32.gguf", folder, "tiny-mixtral-F32")
    read = lambda name: (GOLDEN / name).read_bytes()   # noqa: E731
    return {r.repo_id: r for r in [
        Repo("wb-test/tiny-llama-GGUF", {
            "tiny-llama-Q8_0.gguf": read("llama-q8_0.gguf"),
            "tiny-llama-F32.gguf": read("llama-f32.gguf"),
            "README.md": b"# tiny llama\n\nGGUF files for the workbench's tests.\n"},
            downloads=1200, likes=7, revisions={"v0": {
                "tiny-llama-Q8_0.gguf": read("gemma3-q8_0.gguf"), "README.md": b"# v0\n"}}),
        Repo("wb-test/tiny-mixtral-GGUF", {
            "tiny-mixtral-Q8_0.gguf": read("mixtral-q8_0.gguf"),
            **{p.name: p.read_bytes() for p in shards}}, downloads=300, likes=40),
        Repo("gated-org/tiny-gemma-GGUF", {"tiny-gemma-Q8_0.gguf": read("gemma3-q8_0.gguf")},
             downloads=50, likes=2, gated=True),
        Repo("wb-test/tiny-moe-GGUF", {"tiny-moe.gguf": (SAMPLE / "tiny-moe.gguf").read_bytes()},
             downloads=10, likes=1),
        Repo("wb-test/tiny-llama", {"config.json": b"{}"}, downloads=9999, likes=99,
             tags=("safetensors",)),
    ]}


class FakeHub:
    def __init__(self, repos: dict[str, Repo]):
        self.repos = repos
        self.drop_after: dict[str, int] = {}
        self.corrupt: set[str] = set()
        self.status: dict[str, int] = {}
        self.garbage: set[str] = set()
        self.body: dict[str, bytes] = {}
        self.advertised_size: dict[str, int] = {}
        self.slow: dict[str, float] = {}
        self.cdn = False
        self.stall: set[str] = set()
        self.no_ranges = False
        self.reset = False
        self.hold: dict[str, threading.Event] = {}
        self._closing = threading.Event()
        self.requests: list[tuple[str, str, str | None]] = []
        self.authorizations: list[str | None] = []
        self._lock = threading.Lock()
        hub = self

        class Handler(_Handler):
            server_hub = hub

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,),
                                        daemon=True)

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def ranges(self, file: str) -> list[str | None]:
        """The Range headers of the GET requests of `file`, in order."""
        return [r for m, p, r in self.requests if m == "GET" and p.endswith("/" + file)]


class _Handler(BaseHTTPRequestHandler):
    server_hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:      # quiet
        pass

    # ---- answers ---------------------------------------------------------------------------
    def _send(self, code: int, body: bytes = b"", headers: dict | None = None,
              content_type: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, value) -> None:
        self._send(200, json.dumps(value).encode())

    def _error(self, code: int, error_code: str | None = None, message: str = "") -> None:
        headers = {"X-Error-Code": error_code} if error_code else {}
        if message:
            headers["X-Error-Message"] = message
        self._send(code, json.dumps({"error": message or error_code or str(code)}).encode(),
                   headers)

    # ---- routing ---------------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self._route()

    def do_GET(self) -> None:
        self._route()

    def _route(self) -> None:
        hub = self.server_hub
        url = urlsplit(self.path)
        path = unquote(url.path)
        with hub._lock:
            hub.requests.append((self.command, path, self.headers.get("Range")))
            hub.authorizations.append(self.headers.get("Authorization"))
        if any(key in path for key in hub.stall):   # accept, then say nothing
            hub._closing.wait(60)
            self.close_connection = True
            return
        for key, code in hub.status.items():
            if key in path:
                return self._error(code, message=f"fault {code}")
        if any(key in path for key in hub.garbage):
            return self._send(200, b"{not json", {})
        for key, body in hub.body.items():
            if key in path:
                return self._send(200, body, {})
        query = parse_qs(url.query)
        if path == "/api/models":
            return self._search(query)
        if path.startswith("/api/models/"):
            return self._api_repo(path[len("/api/models/"):])
        if "/resolve/" in path:
            repo_id, _, rest = path.lstrip("/").partition("/resolve/")
            rev, _, file = rest.partition("/")          # (a revision without a "/")
            return self._resolve(repo_id, file, rev=rev)
        if path.startswith("/cdn/"):                 # the storage an LFS file redirects to
            repo_id, _, rest = path[len("/cdn/"):].partition("/cdn/")
            commit, _, file = rest.partition("/")
            return self._resolve(repo_id, file, cdn=True, rev=commit)
        self._error(404, message="no such route")

    def _repo(self, repo_id: str) -> Repo | None:
        """The repository, or None after answering the error (not found; gated: 401/403)."""
        repo = self.server_hub.repos.get(repo_id)
        if repo is None:
            self._error(401 if not self.headers.get("Authorization") else 404, "RepoNotFound",
                        "Repository not found")
            return None
        if repo.gated:
            auth = self.headers.get("Authorization")
            if auth is None:
                self._error(401, "GatedRepo", "Access to this model is restricted: log in.")
                return None
            if auth != f"Bearer {TOKEN}":
                self._error(403, "GatedRepo", "Access to this model is restricted: ask for "
                                              "access on the model's page.")
                return None
        return repo

    def _info(self, repo: Repo) -> dict:
        return {"id": repo.repo_id, "modelId": repo.repo_id, "author": repo.repo_id.split("/")[0],
                "sha": repo.commit, "downloads": repo.downloads, "likes": repo.likes,
                "gated": "auto" if repo.gated else False, "private": False,
                "tags": list(repo.tags), "lastModified": "2026-11-01T00:00:00.000Z",
                "siblings": [{"rfilename": n} for n in sorted(repo.files)]}

    def _search(self, query: dict) -> None:
        repos = list(self.server_hub.repos.values())
        text = query.get("search", [""])[0].lower()
        author = query.get("author", [None])[0]
        tags = query.get("filter", [])
        hits = [r for r in repos if text in r.repo_id.lower()
                and (author is None or r.repo_id.split("/")[0] == author)
                and all(t in r.tags for t in tags)]
        sort = query.get("sort", [None])[0]
        if sort in ("downloads", "likes"):
            hits.sort(key=lambda r: -getattr(r, sort))
        limit = int(query.get("limit", ["1000"])[0])
        self._json([{k: v for k, v in self._info(r).items() if k != "siblings"}
                    for r in hits[:limit]])

    def _api_repo(self, rest: str) -> None:
        parts = rest.split("/")
        repo_id = "/".join(parts[:2])
        repo = self._repo(repo_id)
        if repo is None:
            return
        if len(parts) == 2 or parts[2] == "revision":
            return self._json(self._info(repo))
        if parts[2] == "tree":
            found = repo.at(parts[3] if len(parts) > 3 else "main")
            if found is None:
                return self._error(404, "RevisionNotFound", "Invalid rev id")
            entries = []
            for name in sorted(found[0]):
                data = found[0][name]
                size = self.server_hub.advertised_size.get(name, len(data))
                entry = {"type": "file", "oid": git_blob_id(data), "size": size, "path": name}
                if is_lfs(name):
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": size,
                                    "pointerSize": 134}
                entries.append(entry)
            return self._json(entries)
        self._error(404, message="no such route")

    def _resolve(self, repo_id: str, file: str, cdn: bool = False, rev: str = "main") -> None:
        hub = self.server_hub
        repo = hub.repos.get(repo_id) if cdn else self._repo(repo_id)
        if repo is None:
            return self._error(404, message="no such object") if cdn else None
        found = repo.at(rev)
        if found is None:
            return self._error(404, "RevisionNotFound", "Invalid rev id")
        files, commit = found
        data = files.get(file)
        if data is None:
            return self._send(404, b"{}", {"X-Error-Code": "EntryNotFound",
                                           "X-Repo-Commit": commit})
        etag = etag_of(file, data)
        size = hub.advertised_size.get(file, len(data))
        if file in hub.corrupt:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])     # in the weights, not the header
        headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        if is_lfs(file):
            headers["X-Linked-Etag"] = f'"{etag}"'
            headers["X-Linked-Size"] = size
            if hub.cdn and not cdn:                   # the Hub's 302 to another origin
                host, port = self.server.server_address[:2]
                headers["Location"] = f"http://localhost:{port}/cdn/{repo_id}/cdn/{commit}/{file}"
                headers["Content-Length"] = 0
                return self._send(302, b"", headers)
        start = 0
        rng = None if hub.no_ranges else self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            first, _, last = rng[len("bytes="):].partition("-")
            start = int(first)
            end = min(int(last) + 1, len(data)) if last else len(data)
            if start >= len(data):
                return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
            body = data[start:end]
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
            code = 206
        else:
            body, code = data, 200
        headers["Content-Length"] = len(body)
        if self.command == "HEAD":
            headers["Content-Length"] = size
            return self._send(200, b"", headers, "application/octet-stream")
        asked = self.headers.get("Range")
        downloading = not asked or asked.endswith("-")   # not a header's closed range
        with hub._lock:
            cut = hub.drop_after.get(file)
            if cut is not None and start < cut and downloading:
                del hub.drop_after[file]        # once
            else:
                cut = None
        self.send_response(code)
        self.send_header("Content-Type", "application/octet-stream")
        for k, v in headers.items():
            self.send_header(k, str(v))
        self.end_headers()
        if cut is not None:
            self.wfile.write(body[:max(0, cut - start)])
            self.wfile.flush()
            self.close_connection = True
            if hub.reset:                   # a TCP reset (RST): the client's ReadError
                time.sleep(0.05)            # the bytes reach the peer first
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                           struct.pack("ii", 1, 0))
                self.connection.close()
            else:
                self.connection.shutdown(2)     # the peer sees the body end early
            return
        hold = hub.hold.get(file) if downloading else None
        if hold is not None:                 # the first piece, then wait for the test
            self.wfile.write(body[:4096])
            self.wfile.flush()
            hold.wait(30)
            self.wfile.write(body[4096:])
            return
        pause = hub.slow.get(file) if downloading else None
        if pause:
            for i in range(0, len(body), 4096):
                self.wfile.write(body[i:i + 4096])
                self.wfile.flush()
                time.sleep(pause)
            return
        self.wfile.write(body)


def point_at(monkeypatch, hub: FakeHub, home: Path) -> None:
    """The engine's Hub settings for a test: HF_ENDPOINT at `hub`, HF_HOME at `home`, no token,
    online (whatever the developer's shell says)."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(home))
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_HUB_OFFLINE",
                "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released): a refused connection."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


UNRESOLVABLE = "http://hub.workbench-test.invalid"      # .invalid never resolves (RFC 2606)


def count_attempts(monkeypatch) -> list[str]:
    """The URLs of every HTTP request the client's session sends from now on (each retry
    too), the client's backoff sleeps made instant so that a retry loop costs no time."""
    import httpx2
    import huggingface_hub.utils._http as http

    monkeypatch.setattr(http.time, "sleep", lambda s: None)
    attempts: list[str] = []
    send = httpx2.Client.send

    def counted(self, request, *a, **k):
        attempts.append(str(request.url))
        return send(self, request, *a, **k)

    monkeypatch.setattr(httpx2.Client, "send", counted)
    return attempts


# Fixtures: a test module takes them with `from tests.hub_server import hub, hub_repos`.
@pytest.fixture(scope="session")
def hub_repos(tmp_path_factory):
    return build_repos(tmp_path_factory.mktemp("hub-repos"))


@pytest.fixture
def hub(hub_repos, tmp_path, monkeypatch):
    """A fresh local Hub (faults cleared) and an empty HF_HOME, the engine pointed at both."""
    with FakeHub(hub_repos) as server:
        point_at(monkeypatch, server, tmp_path / "hf-home")
        # merged split models go beside the dataset cache: a test's own, so that whether a
        # merge happens does not depend on which test merged first
        monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "workbench-cache"))
        yield server
