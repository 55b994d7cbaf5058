"""Search, list and download GGUF models on the Hugging Face Hub, through `huggingface_hub`.

Settings are read at each call (`hub_settings()`): HF_ENDPOINT, HF_HOME / HF_HUB_CACHE,
HF_HUB_OFFLINE and the token (HF_TOKEN, else the file `huggingface_hub`'s login writes,
HF_TOKEN_PATH or `<HF_HOME>/token`), and handed to the client explicitly (endpoint=,
cache_dir=, token=): the client reads its own copies of them once, at import, so a process
that changes them later (the tests, a window whose user logs in) would otherwise talk to the
old endpoint.

Search and listing follow the Hub's Link-header pages through the client's `http_backoff`
(a timeout that HfApi's list methods do not send; 2 retries of a timeout, a drop, a 429 or 5xx;
none of a refused connection or a name that does not resolve: "No network" at once) and read
its ModelInfo/RepoFile; a file's
metadata (the commit, the ETag that is the LFS sha256, the size) is its
`get_hf_file_metadata`. The bytes come through the client's HTTP session with our own Range
requests into a kept partial file, `blobs/<sha256>.workbench.incomplete` in the cache, because
the client deletes its partial file when a download fails and resumes across nothing
(huggingface_hub 2.4.0): a dropped connection is resumed from the byte it stopped at
(`retries` times in one call, then the partial waits for the next call), a cancel or a full
disk keeps it for the next call too. A finished file is
checked against the Hub's sha256 and placed the client's way (blobs/<sha256>, a relative link in
snapshots/<commit>/, refs/<revision>), under the client's own lock file for that blob, so
`hf_hub_download(..., local_files_only=True)`, the other tools that read the Hugging Face
cache and a second `models get` find it. Nothing is ever written under snapshots/ but a
whole, verified file.
(hf-xet is not used for the transfer: the Hub serves Xet-stored files on the same resolve URL.)

The token goes in the Authorization header of the requests and nowhere else: no message, log or
run folder holds it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.engine.errors import Cancelled, ConfigError, EngineError
from app.engine.hub.names import (ModelSpec, is_gguf, quant_of, split_part)
from app.engine.runtime.files import DiskFullError, storage_error

CHUNK = 1 << 20
HEADER_FIRST_FETCH = 1 << 20          # the first ranged read of a header; doubled until whole
METADATA_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 30.0
PARTIAL_SUFFIX = ".workbench.incomplete"

Progress = Callable[[int, int, str], None]     # (bytes done, bytes in all, file name)


class HubError(EngineError):
    """The Hub could not answer what was asked (not found, a server error, a bad answer)."""

    kind = "hub"


class HubAuthError(HubError):
    """A gated or private repository without a token that may read it."""

    kind = "hub_auth"


class HubOfflineError(HubError):
    """No network, or HF_HUB_OFFLINE=1: only the cache can answer."""

    kind = "hub_offline"


class ChecksumError(HubError):
    kind = "checksum"


# ---------------------------------------------------------------- settings, read at each call
@dataclass(frozen=True)
class HubSettings:
    endpoint: str
    cache_dir: Path
    offline: bool
    token: str | None = field(repr=False, default=None)


def _hf_home(home: Path, env: Mapping[str, str]) -> Path:
    if env.get("HF_HOME"):
        return Path(os.path.expandvars(env["HF_HOME"])).expanduser()
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else home / ".cache"
    return base / "huggingface"


def hf_cache_dir(home: Path, env: Mapping[str, str]) -> Path:
    """The hub cache `huggingface_hub` uses under these variables (HF_HUB_CACHE, HF_HOME,
    XDG_CACHE_HOME) and this home folder."""
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(os.path.expandvars(cache)).expanduser()
    return _hf_home(home, env) / "hub"


def _token() -> str | None:
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if not token:
        path = os.environ.get("HF_TOKEN_PATH") or str(_hf_home(Path.home(), os.environ)
                                                       / "token")
        try:
            token = Path(os.path.expandvars(path)).expanduser().read_text().strip()
        except (OSError, UnicodeDecodeError):
            token = None
    token = (token or "").strip()
    return token or None


def _no_telemetry() -> None:
    """The client's telemetry off in this process: with it on, the first request of a process
    first asks https://huggingface.co/api/agent-harnesses (the endpoint read at import, not
    HF_ENDPOINT; 3 s timeout) to decorate its User-Agent (huggingface_hub 2.4.0), which costs
    up to 3 s without a network and talks to the Hub where a user pointed HF_ENDPOINT
    elsewhere. The workbench sends nothing but the requests a user asked for."""
    from huggingface_hub import constants

    constants.HF_HUB_DISABLE_TELEMETRY = True


def hub_settings() -> HubSettings:
    _no_telemetry()
    offline = (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "")
    return HubSettings(
        endpoint=(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/"),
        cache_dir=hf_cache_dir(Path.home(), os.environ),
        offline=offline.strip().upper() in ("1", "ON", "YES", "TRUE"),
        token=_token())


def _require_online(s: HubSettings, what: str) -> None:
    if s.offline:
        raise HubOfflineError(
            f"Cannot {what}: HF_HUB_OFFLINE is set, so the Hub is not asked.",
            "Unset HF_HUB_OFFLINE to reach the Hub; `workbench models list` shows the models "
            "already downloaded.")


# ---------------------------------------------------------------- errors, the client's -> ours
def _page(s: HubSettings, repo_id: str) -> str:
    return f"{s.endpoint}/{repo_id}"


def hub_error(e: BaseException, s: HubSettings, repo_id: str = "", what: str = "",
              revision: str = "") -> EngineError:
    """The EngineError for an exception of the client or of its HTTP layer (never naming the
    token)."""
    import httpx2
    from huggingface_hub import errors as hf

    where = f" {repo_id}" if repo_id else ""
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, hf.GatedRepoError):       # before RepositoryNotFoundError: its subclass
        if status == 401 or not s.token:
            return HubAuthError(
                f"{repo_id} is gated: the Hub wants a token that has accepted its terms.",
                f"Accept the terms on {_page(s, repo_id)}, then log in (`hf auth login`) or set "
                "HF_TOKEN to a token of that account.")
        return HubAuthError(
            f"{repo_id} is gated and your token has no access to it (HTTP {status}).",
            f"Ask for access on {_page(s, repo_id)} with the account of your token, or use a "
            "token of an account that has it (HF_TOKEN).")
    if isinstance(e, hf.RepositoryNotFoundError):
        if status == 401 and not s.token:
            return HubAuthError(
                f"{repo_id} was not found, or it is private and needs a token (HTTP 401).",
                "Check the name; for a private repository log in (`hf auth login`) or set "
                "HF_TOKEN.")
        return HubError(f"No repository {repo_id} on {s.endpoint} (HTTP {status}).",
                        "Check the name (owner/name); `workbench models search` finds models.")
    if isinstance(e, hf.RevisionNotFoundError):
        return HubError(f"{repo_id} has no revision {revision or ''} (a branch, tag or "
                        f"commit).".replace("  ", " "),
                        f"See its branches and tags on {_page(s, repo_id)}; without "
                        "@REVISION the main branch is used.")
    if isinstance(e, (hf.RemoteEntryNotFoundError, hf.EntryNotFoundError)):
        return HubError(f"{repo_id} has no file {what or ''} (HTTP {status}).".replace("  ", " "),
                        f"`workbench models files {repo_id}` lists its GGUF files.")
    if isinstance(e, hf.OfflineModeIsEnabled):
        return HubOfflineError(f"Cannot {what or 'reach the Hub'}: offline mode is on.",
                               "Unset HF_HUB_OFFLINE.")
    if isinstance(e, hf.HfHubHTTPError):
        if status == 401 and s.token:
            return HubAuthError(
                f"The Hub refused the token (HTTP 401) for{where or ' the request'}.",
                "The token is invalid or expired: log in again (`hf auth login`) or fix "
                "HF_TOKEN.")
        if status in (401, 403):
            return HubAuthError(
                f"The Hub refused the request (HTTP {status}) for{where or ' the request'}"
                f"{'' if s.token else ': it wants a token'}.",
                "Log in (`hf auth login`) or set HF_TOKEN to a token with access.")
        if status == 429:
            return HubError("The Hub is rate-limiting these requests (HTTP 429).",
                            "Wait a minute and try again; logged-in users (`hf auth login`) "
                            "get higher limits.")
        if status is not None and status >= 500:
            return HubError(f"The Hub answered HTTP {status} for{where or ' the request'}: a "
                            "server error.", "Try again later.")
        return HubError(f"The Hub answered HTTP {status} for{where or ' the request'}.",
                        "Check the name and try again.")
    if isinstance(e, httpx2.ConnectError):
        return _no_network(e, s)
    if isinstance(e, httpx2.RemoteProtocolError):     # an answer, but not valid HTTP
        return HubError(f"{s.endpoint} broke the HTTP protocol ({type(e).__name__}: {e}).",
                        "Try again; if it goes on, check HF_ENDPOINT (or a proxy between).")
    if isinstance(e, httpx2.TransportError):
        reason = type(e).__name__ + (f": {e}" if str(e) else "")
        return HubOfflineError(
            f"Cannot reach {s.endpoint} ({reason}).",
            "Check the network (or HF_ENDPOINT). Downloaded models still work: "
            "`workbench models list`.")
    if isinstance(e, (ValueError, TypeError, KeyError, AttributeError)):
        return HubError(f"{s.endpoint} gave an answer the workbench does not understand"
                        f"{' for ' + repo_id if repo_id else ''} ({type(e).__name__}).",
                        "Check HF_ENDPOINT; if it is the Hub, try again later.")
    if isinstance(e, OSError):
        return HubError(f"Talking to {s.endpoint} failed: {e}.", "Try again.")
    raise e


def _no_network(e: BaseException, s: HubSettings) -> HubOfflineError:
    """HubOfflineError for a connection that could not be opened: the host does not resolve
    (no DNS: no network, or a wrong HF_ENDPOINT), or it refused the connection."""
    import socket
    from urllib.parse import urlsplit

    host = urlsplit(s.endpoint).hostname or s.endpoint
    cause, seen = e, set()
    while cause is not None and id(cause) not in seen:     # the OSError under httpx2's
        seen.add(id(cause))
        if isinstance(cause, socket.gaierror):
            break
        cause = cause.__cause__ or cause.__context__
    text = str(e).lower()
    if isinstance(cause, socket.gaierror) or "name or service" in text or \
            "name resolution" in text or "getaddrinfo" in text or "nodename" in text:
        what = f"the name {host} does not resolve"
    elif "refused" in text or isinstance(cause, ConnectionRefusedError):
        what = f"{host} refused the connection"
    else:
        what = f"cannot connect to {host} ({e or type(e).__name__})"
    return HubOfflineError(
        f"No network: {what}, so the Hub ({s.endpoint}) cannot be asked.",
        "Check the network connection (or HF_ENDPOINT). Downloaded models still work: "
        "`workbench models list`.")


_CLIENT_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, TypeError, KeyError,
                                                   AttributeError)


def _client_errors() -> tuple[type[BaseException], ...]:
    import httpx2

    return (*_CLIENT_ERRORS, httpx2.HTTPError)


# The client's retries of a listing request: a timeout, a dropped connection, 429 and 5xx
# answers are tried LIST_RETRIES more times (1 s, then 2 s apart); a refused connection or a
# host name that does not resolve is not retried at all (the client's own loop tries 6 times,
# 1+2+4+8+8 s apart: 23 s before a user without a network hears why).
LIST_RETRIES = 2


def _retried_exceptions() -> tuple[type[BaseException], ...]:
    import httpx2

    return (httpx2.TimeoutException, httpx2.ReadError, httpx2.WriteError, httpx2.CloseError,
            httpx2.RemoteProtocolError)


def _pages(s: HubSettings, path: str, params: dict, limit: int | None = None) -> Iterable[dict]:
    """The items of a paginated listing of the Hub API (the Link headers followed, as the
    client's `paginate` does), each request through the client's `http_backoff` with a timeout
    (HfApi's list_models and list_repo_tree send none: a server that accepts and never answers
    would hang them) and the retries above."""
    import httpx2
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_backoff

    headers = build_hf_headers(token=s.token or False, library_name="gguf-workbench")
    timeout = httpx2.Timeout(METADATA_TIMEOUT_S, read=READ_TIMEOUT_S)
    url: str | None = s.endpoint + path
    n = 0
    while url is not None:
        r = http_backoff("GET", url, params=params, headers=headers, timeout=timeout,
                         max_retries=LIST_RETRIES, retry_on_exceptions=_retried_exceptions())
        hf_raise_for_status(r)
        page = r.json()
        if not isinstance(page, list):
            raise TypeError(f"a listing is a {type(page).__name__}")
        for item in page:
            if limit is not None and n >= limit:
                return
            if not isinstance(item, dict):
                raise TypeError(f"a listing item is a {type(item).__name__}")
            n += 1
            yield item
        url, params = r.links.get("next", {}).get("url"), None   # the next link has the query


# ---------------------------------------------------------------- search and listing
@dataclass(frozen=True)
class RepoHit:
    repo_id: str
    downloads: int
    likes: int
    gated: bool
    updated: str

    def to_dict(self) -> dict:
        return {"repo": self.repo_id, "downloads": self.downloads, "likes": self.likes,
                "gated": self.gated, "updated": self.updated}


SORTS = ("downloads", "likes")


def search(query: str = "", author: str | None = None, sort: str = "downloads",
           limit: int = 50) -> list[RepoHit]:
    """Repositories with GGUF files (the Hub's "gguf" tag) matching `query`, by `author`,
    most downloaded (or liked) first."""
    if sort not in SORTS:
        raise ConfigError(f"Unknown sort {sort!r}.", f"Use one of: {', '.join(SORTS)}.")
    s = hub_settings()
    _require_online(s, "search the Hub")
    params = {"filter": "gguf", "sort": sort, "limit": limit,
              **({"search": query} if query else {}), **({"author": author} if author else {})}
    try:
        from huggingface_hub.hf_api import ModelInfo

        hits = []
        for item in _pages(s, "/api/models", params, limit):
            m = ModelInfo(**{"siblings": None, **item})
            when = m.last_modified or m.created_at     # the Hub lists createdAt by default
            hits.append(RepoHit(str(m.id), int(m.downloads or 0), int(m.likes or 0),
                                bool(m.gated), when.date().isoformat() if when else ""))
        return hits
    except _client_errors() as e:
        raise hub_error(e, s, author or "", "search") from None


@dataclass(frozen=True)
class HubFile:
    path: str
    size: int
    sha256: str | None            # the LFS oid, None for a file stored in git


@dataclass(frozen=True)
class HubModel:
    """One GGUF model of a repository: a file, or the parts of a split model in order."""

    repo_id: str
    files: tuple[HubFile, ...]
    quant: str
    revision: str = "main"        # the branch, tag or commit it was listed at

    @property
    def name(self) -> str:
        part = split_part(self.files[0].path)
        return f"{part[0]}.gguf" if part else self.files[0].path

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def is_split(self) -> bool:
        return len(self.files) > 1 or split_part(self.files[0].path) is not None

    def to_dict(self) -> dict:
        return {"repo": self.repo_id, "name": self.name, "quant": self.quant, "size": self.size,
                "split": self.is_split, "revision": self.revision, "files": [
                    {"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files]}


def group_models(repo_id: str, files: Iterable[HubFile], revision: str = "main"
                 ) -> list[HubModel]:
    """The GGUF models among `files`: each unsplit .gguf alone, the parts `-0000k-of-0000n`
    of one name together (in order; an incomplete set is still listed, its missing parts
    named when it is downloaded)."""
    single, parts = [], {}
    for f in files:
        if not is_gguf(f.path):
            continue
        sp = split_part(f.path.rsplit("/", 1)[-1])
        if sp is None:
            single.append(HubModel(repo_id, (f,), quant_of(f.path), revision))
        else:
            folder = f.path.rsplit("/", 1)[0] + "/" if "/" in f.path else ""
            parts.setdefault((folder + sp[0], sp[2]), []).append((sp[1], f))
    for (_stem, _count), found in parts.items():
        ordered = tuple(f for _k, f in sorted(found, key=lambda kf: kf[0]))
        single.append(HubModel(repo_id, ordered, quant_of(ordered[0].path), revision))
    return sorted(single, key=lambda m: (m.size, m.name))


def list_models(repo_id: str, revision: str = "main") -> list[HubModel]:
    """The GGUF models of a repository at `revision` (a branch, tag or commit) with their sizes
    and quant types (from the names)."""
    from urllib.parse import quote

    s = hub_settings()
    _require_online(s, f"list the files of {repo_id}")
    try:
        from huggingface_hub.hf_api import RepoFile

        tree = f"/api/models/{repo_id}/tree/{quote(revision, safe='')}"
        entries = (RepoFile(**e) for e in _pages(s, tree,
                                                   {"recursive": True, "expand": False})
                   if e["type"] == "file")
        files = [HubFile(e.path, int(e.size), e.lfs.sha256 if e.lfs else None) for e in entries]
    except _client_errors() as e:
        raise hub_error(e, s, repo_id, revision=revision) from None
    return group_models(repo_id, files, revision)


def choose(models: list[HubModel], spec: ModelSpec) -> HubModel:
    """The model `spec.select` names: a file name (any part of a split model), a quant type
    (case-insensitive), or nothing when the repository holds one GGUF model."""
    if not models:
        raise HubError(f"{spec.repo_id} holds no GGUF file.", "Search for a GGUF repository: "
                       "`workbench models search NAME`.")
    want = spec.select.strip()
    if want:
        for m in models:
            if any(f.path == want or f.path.rsplit("/", 1)[-1] == want for f in m.files):
                return m
        hits = [m for m in models if m.quant and m.quant.upper() == want.upper()]
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            names = ", ".join(m.name for m in hits)
            raise ConfigError(f"{spec.repo_id} has {len(hits)} {want.upper()} models: {names}.",
                              f"Name the file: {spec.repo_id}:{hits[0].files[0].path}.")
    elif len(models) == 1:
        return models[0]
    quants = ", ".join(sorted({m.quant or m.name for m in models}))
    what = f"no {want!r} model" if want else f"{len(models)} GGUF models"
    raise ConfigError(f"{spec.repo_id} has {what}; it has: {quants}.",
                      f"Pick one: {spec.repo_id}:QUANT or {spec.repo_id}:FILE.")


# ---------------------------------------------------------------- the cache
def _storage(s: HubSettings, repo_id: str) -> Path:
    return s.cache_dir / ("models--" + repo_id.replace("/", "--"))


def cached_file(repo_id: str, filename: str, revision: str = "main") -> Path | None:
    """The cached file of `filename` at `revision` (the client's lookup), else None."""
    from huggingface_hub import try_to_load_from_cache

    s = hub_settings()
    try:
        found = try_to_load_from_cache(repo_id, filename, cache_dir=s.cache_dir,
                                       revision=revision)
    except (ValueError, OSError):
        return None
    return Path(found) if isinstance(found, str) else None


@dataclass(frozen=True)
class CachedModel:
    repo_id: str
    path: Path                 # the snapshot's file (the first part of a split model)
    name: str
    quant: str
    size: int
    revision: str


def cached_models(cache_dir: Path | None = None) -> list[CachedModel]:
    """GGUF models in the Hugging Face cache (`cache_dir`, default the settings'; every
    snapshot; split models once, complete sets only). Reads the folders: no network."""
    cache_dir = hub_settings().cache_dir if cache_dir is None else Path(cache_dir)
    out: list[CachedModel] = []
    try:
        repos = sorted(p for p in cache_dir.iterdir() if p.name.startswith("models--"))
    except OSError:
        return out
    for repo_dir in repos:
        repo_id = repo_dir.name[len("models--"):].replace("--", "/", 1)
        snapshots = repo_dir / "snapshots"
        try:
            commits = sorted(snapshots.iterdir())
        except OSError:
            continue
        for commit in commits:
            files = []
            for root, _dirs, names in os.walk(commit):
                for n in names:
                    p = Path(root) / n
                    if is_gguf(n) and p.is_file():
                        files.append(HubFile(p.relative_to(commit).as_posix(), p.stat().st_size,
                                             None))
            for m in group_models(repo_id, files):
                part = split_part(m.files[0].path.rsplit("/", 1)[-1])
                if part and len(m.files) != part[2]:
                    continue                        # an incomplete split model
                out.append(CachedModel(repo_id, commit / m.files[0].path, m.name, m.quant,
                                       m.size, commit.name))
    return out


def find_cached(spec: ModelSpec) -> Path | None:
    """The cached model `spec` names in the snapshot of its revision (the commit the cache's
    refs/<revision> names, or the commit itself), else None. No network."""
    s = hub_settings()
    commit = _read_ref(s, spec.repo_id, spec.revision) or spec.revision
    found: dict[str, CachedModel] = {}
    for c in cached_models():
        if c.repo_id == spec.repo_id and c.revision == commit:
            found.setdefault(c.name, c)
    if not found:
        return None
    cached = list(found.values())
    models = [HubModel(c.repo_id, (HubFile(c.path.relative_to(
        _storage(s, c.repo_id) / "snapshots" / c.revision).as_posix(), c.size, None),), c.quant)
        for c in cached]
    try:
        return cached[models.index(choose(models, spec))].path
    except (ConfigError, HubError):
        return None


def _read_ref(s: HubSettings, repo_id: str, revision: str) -> str | None:
    try:
        return (_storage(s, repo_id) / "refs" / revision).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _place(s: HubSettings, repo_id: str, revision: str, commit: str, filename: str,
           etag: str, blob: Path) -> Path:
    """Put a whole, verified blob where the client keeps it and link the snapshot to it."""
    storage = _storage(s, repo_id)
    target = storage / "snapshots" / commit / filename
    target.parent.mkdir(parents=True, exist_ok=True)
    final_blob = storage / "blobs" / etag
    os.replace(blob, final_blob)
    tmp = target.with_name(target.name + ".workbench-link")
    tmp.unlink(missing_ok=True)
    try:
        os.symlink(os.path.relpath(final_blob, target.parent), tmp)
    except OSError:                     # no symlinks here (Windows without the right): a copy
        shutil.copyfile(final_blob, tmp)
    os.replace(tmp, target)
    if revision != commit:
        ref = storage / "refs" / revision
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)
    return target


# ---------------------------------------------------------------- downloads
@dataclass(frozen=True)
class RemoteFile:
    repo_id: str
    filename: str
    url: str
    commit: str
    etag: str
    size: int


def _metadata(s: HubSettings, repo_id: str, filename: str, revision: str) -> RemoteFile:
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    url = hf_hub_url(repo_id, filename, revision=revision, endpoint=s.endpoint)
    try:
        meta = get_hf_file_metadata(url, token=s.token or False, timeout=METADATA_TIMEOUT_S,
                                    endpoint=s.endpoint)
    except _client_errors() as e:
        raise hub_error(e, s, repo_id, filename, revision) from None
    if not meta.commit_hash or not meta.etag or meta.size is None or meta.size < 0:
        raise HubError(f"{s.endpoint} did not say the commit, checksum and size of "
                       f"{repo_id}/{filename}.", "Check HF_ENDPOINT: it does not answer like "
                       "the Hub.")
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", meta.etag) or meta.etag.startswith("."):
        raise HubError(f"The Hub's ETag of {filename} ({meta.etag[:80]!r}) is not a checksum.",
                       "Check HF_ENDPOINT: it does not answer like the Hub.")
    # the resolve URL, not meta.location: a redirect to the storage (another origin) is
    # followed per request, and httpx drops the Authorization header on the way (the token
    # goes to the Hub only); a signed storage URL would expire between two calls anyway
    return RemoteFile(repo_id, filename, url, meta.commit_hash, meta.etag, int(meta.size))


def _headers(s: HubSettings, extra: dict[str, str] | None = None) -> dict[str, str]:
    from huggingface_hub.utils import build_hf_headers

    headers = build_hf_headers(token=s.token or False, library_name="gguf-workbench")
    headers["Accept-Encoding"] = "identity"
    headers.update(extra or {})
    return headers


def fetch_range(s: HubSettings, remote: RemoteFile, start: int, end: int) -> bytes:
    """Bytes [start, end) of a remote file (one ranged GET)."""
    import httpx2
    from huggingface_hub.utils import get_session, hf_raise_for_status

    headers = _headers(s, {"Range": f"bytes={start}-{end - 1}"})
    timeout = httpx2.Timeout(METADATA_TIMEOUT_S, read=READ_TIMEOUT_S)
    for attempt in range(3):                 # a dropped connection: the range again
        try:
            with get_session().stream("GET", remote.url, headers=headers, timeout=timeout,
                                      follow_redirects=True) as r:
                if r.status_code >= 400:
                    r.read()
                    hf_raise_for_status(r)
                skip = start if r.status_code == 200 else 0    # the server ignored the range
                body = bytearray()
                for chunk in r.iter_bytes():  # read what is wanted, never the whole file
                    if skip:
                        cut = min(skip, len(chunk))
                        chunk, skip = chunk[cut:], skip - cut
                    body += chunk
                    if len(body) >= end - start:
                        break
                return bytes(body[:end - start])
        except httpx2.TransportError as e:
            if attempt == 2 or isinstance(e, httpx2.ConnectError):    # no network: at once
                raise hub_error(e, s, remote.repo_id, remote.filename) from None
        except _client_errors() as e:
            raise hub_error(e, s, remote.repo_id, remote.filename) from None
    raise AssertionError("unreachable")


def read_header(repo_id: str, filename: str, revision: str = "main") -> tuple[bytes, int]:
    """(the GGUF header of a remote file, its file size), by ranged reads: 1 MiB, doubled until
    the header is whole."""
    from app.engine.hub.header import MAX_HEADER, header_length

    s = hub_settings()
    _require_online(s, f"read the header of {filename}")
    remote = _metadata(s, repo_id, filename, revision)
    data = b""
    want = min(HEADER_FIRST_FETCH, remote.size)
    while True:
        if want > len(data):
            data += fetch_range(s, remote, len(data), want)
        n = header_length(data)
        if n is not None:
            return data[:n], remote.size
        if len(data) < want or want >= remote.size or want >= MAX_HEADER:
            raise HubError(f"The header of {filename} does not end within its first "
                           f"{len(data):,} bytes.", "The file is not a GGUF model.")
        want = min(want * 2, remote.size, MAX_HEADER)


def quant_shown(named: str, fit) -> str:
    """app.engine.hub.header.quant_shown (the name's quant confirmed by the header's)."""
    from app.engine.hub.header import quant_shown as shown

    return shown(named, fit)


def what_fits(model: HubModel, rank: int = 16, context: int = 512):
    """app.engine.hub.header.Fit of a remote model, from its header (weights not fetched). A
    split model: every part's header (the first holds the metadata, the tensors are spread
    over the parts), put together as the file its parts merge into (app.engine.hub.merge), so
    the estimate is the merged file's."""
    from dataclasses import replace

    from app.engine.hub.header import fits_here
    from app.engine.hub.merge import merged_header

    headers = [read_header(model.repo_id, f.path, model.revision) for f in model.files]
    if not model.is_split:
        header, size = headers[0]
        return fits_here(header, size, model.files[0].path, rank, context)
    try:
        header, size = merged_header(headers)
    except EngineError as e:
        raise HubError(f"The parts of {model.name} in {model.repo_id} do not make one model: "
                       f"{e.message}", "Pick another file of the repository.") from None
    fit = fits_here(header, size, model.name, rank, context)
    return replace(fit, note=f"{fit.note} (split into {len(model.files)} files, merged into "
                             "one to train)")


def download(model: HubModel, progress: Progress | None = None, cancel=None,
             retries: int = 3) -> Path:
    """Every file of `model` (at its revision) into the cache (see the module docstring); the
    local path of its first file. `cancel` (anything with is_set()) stops between chunks with Cancelled, the
    partial kept."""
    total = model.size
    done_before = 0
    first = None
    for f in model.files:
        def shifted(done: int, _total: int, name: str, base=done_before) -> None:
            if progress is not None:
                progress(base + done, total, name)
        path = download_file(model.repo_id, f.path, shifted, cancel, retries, model.revision,
                             f.sha256)
        first = first or path
        done_before += f.size
    assert first is not None
    return first


def download_file(repo_id: str, filename: str, progress: Progress | None = None, cancel=None,
                  retries: int = 3, revision: str = "main", sha256: str | None = None) -> Path:
    """One file into the cache, resumed from a kept partial, verified (against `sha256`, the
    LFS oid of the listing, else the ETag: an LFS file's is its sha256, a git file's its git
    blob id); its snapshot path."""
    from filelock import FileLock, Timeout

    s = hub_settings()
    if s.offline:
        found = cached_file(repo_id, filename, revision)
        if found is not None:
            return found
        _require_online(s, f"download {repo_id}/{filename}")
    remote = _metadata(s, repo_id, filename, revision)
    if remote.size == 0:
        raise HubError(f"The Hub announces {filename} as empty (0 bytes).",
                       "Check HF_ENDPOINT: a model file is never empty; pick another file.")
    target = _storage(s, repo_id) / "snapshots" / remote.commit / filename
    blob = _storage(s, repo_id) / "blobs" / remote.etag
    if target.is_file() and blob.is_file() and blob.stat().st_size == remote.size:
        if progress is not None:
            progress(remote.size, remote.size, filename)
        return target
    lock_path = s.cache_dir / ".locks" / _storage(s, repo_id).name / f"{remote.etag}.lock"
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        blob.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise storage_error(e, blob, "download") from None
    lock = FileLock(str(lock_path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise HubError(f"{filename} is being downloaded by another process.",
                       "Wait for it to finish, then run this again.") from None
    try:
        partial = blob.with_name(blob.name + PARTIAL_SUFFIX)
        if not blob.is_file() or blob.stat().st_size != remote.size:
            _fetch_into(s, remote, partial, progress, cancel, retries, sha256)
            os.replace(partial, blob)
        return _place(s, repo_id, revision, remote.commit, filename, remote.etag, blob)
    except OSError as e:
        raise storage_error(e, blob, "download") from None
    finally:
        lock.release()


def _hash_file(path: Path, upto: int, h=None) -> Any:
    """`h` (a new sha256 by default) updated with the first `upto` bytes of `path`."""
    h = hashlib.sha256() if h is None else h
    with open(path, "rb") as f:
        left = upto
        while left > 0:
            chunk = f.read(min(CHUNK, left))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return h


_DIGESTS = {"sha256": 64, "git": 40, "md5": 32}     # hex digits of each kind


def _expected(remote: RemoteFile, sha256: str | None) -> tuple[str, str]:
    """(kind, hex digest) the file must have: the listing's LFS sha256, else the ETag read as
    a sha256 (an LFS file's, the Hub's), a git blob id (a file in git) or an MD5 (plain HTTP
    servers' usual ETag)."""
    for kind, digest in (("sha256", sha256), ("sha256", remote.etag), ("git", remote.etag),
                         ("md5", remote.etag)):
        if digest and re.fullmatch(f"[0-9a-f]{{{_DIGESTS[kind]}}}", digest.lower()):
            return kind, digest.lower()
    raise HubError(f"The Hub gave no checksum for {remote.filename} (its ETag is "
                   f"{remote.etag[:40]!r}), so a download could not be verified.",
                   "Check HF_ENDPOINT: the Hub gives an LFS file's sha256.")


def _check_space(folder: Path, need: int, remote: RemoteFile) -> None:
    """DiskFullError before a byte is fetched when `folder`'s disk has less than `need` free."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    if free < need:
        raise DiskFullError(
            f"Not enough space for {remote.filename}: it needs {need:,} more bytes and "
            f"{folder} has {free:,} free.",
            "Free some space, or put the Hugging Face cache on a larger disk (HF_HOME), then "
            "get the model again.")


def _fetch_into(s: HubSettings, remote: RemoteFile, partial: Path, progress: Progress | None,
                cancel, retries: int, sha256: str | None = None) -> None:
    """Fill `partial` up to remote.size with Range requests (resuming from its length), then
    check the sha256 (LFS files; a git blob's id for the others). A dropped connection is
    resumed `retries` times here; after that, and on a cancel or a full disk, the partial stays
    for the next call. A wrong checksum or a longer body than announced removes it."""
    import httpx2

    kind, want = _expected(remote, sha256)
    have = partial.stat().st_size if partial.exists() else 0
    if have > remote.size:
        partial.unlink()
        have = 0
    _check_space(partial.parent, remote.size - have, remote)
    if progress is not None:
        progress(have, remote.size, remote.filename)      # a resume starts where it stopped
    sha = _hash_file(partial, have) if have else hashlib.sha256()
    tries = 0
    while have < remote.size:
        if cancel is not None and cancel.is_set():
            raise _cancelled(remote, have)
        try:
            have, sha = _stream(s, remote, partial, have, sha, progress, cancel)
        except httpx2.TransportError as e:
            tries += 1
            have = partial.stat().st_size
            sha = _hash_file(partial, have)
            if tries > retries:
                raise HubError(
                    f"The download of {remote.filename} was interrupted ({type(e).__name__}) "
                    f"at {have:,} of {remote.size:,} bytes, {tries} times.",
                    "Run the same command again: it resumes from there.") from None
    if progress is not None:
        progress(have, remote.size, remote.filename)
    if kind == "sha256":
        got = sha.hexdigest()
    else:                                    # a git blob id (sha1 of "blob N\0" + bytes), MD5
        h = hashlib.sha1(b"blob %d\0" % remote.size) if kind == "git" else hashlib.md5()
        got = _hash_file(partial, remote.size, h).hexdigest()
        if kind == "git" and got != want:    # a plain server's 40 digits: the bytes' sha1
            got = _hash_file(partial, remote.size, hashlib.sha1()).hexdigest()
    if got != want:
        partial.unlink(missing_ok=True)
        raise ChecksumError(
            f"{remote.filename} does not match the Hub's checksum (got {got[:12]}..., "
            f"expected {want[:12]}...): the bytes were damaged on the way.",
            "Run the command again: it downloads the file anew.")


def _cancelled(remote: RemoteFile, have: int) -> Cancelled:
    return Cancelled(f"Download of {remote.filename} cancelled at {have:,} of {remote.size:,} "
                     "bytes.", "The part downloaded is kept: get the model again to resume.")


def _stream(s: HubSettings, remote: RemoteFile, partial: Path, have: int, sha, progress,
            cancel) -> tuple[int, Any]:
    """One GET from byte `have` appended to `partial`; (bytes now held, the hash of them)."""
    import httpx2
    from huggingface_hub.utils import get_session, hf_raise_for_status

    headers = _headers(s, {"Range": f"bytes={have}-"} if have else None)
    timeout = httpx2.Timeout(METADATA_TIMEOUT_S, read=READ_TIMEOUT_S)
    try:
        with get_session().stream("GET", remote.url, headers=headers, follow_redirects=True,
                                  timeout=timeout) as r:
            if r.status_code == 416 and have >= remote.size:
                return have, sha
            if r.status_code >= 400:
                r.read()
                hf_raise_for_status(r)
            if have and r.status_code != 206:           # the range was not honoured
                have, sha = 0, hashlib.sha256()
            elif have and r.headers.get("Content-Range"):    # (a 206 without one: trusted)
                start = r.headers["Content-Range"].partition(" ")[2].partition("-")[0]
                if start != str(have):
                    raise HubError(f"The Hub sent {remote.filename} from the wrong byte "
                                   f"({start or 'unknown'} instead of {have}).", "Try again.")
            with open(partial, "r+b" if have else "wb") as f:
                f.seek(have)
                f.truncate()
                for chunk in r.iter_bytes():      # as it arrives: a drop loses nothing
                    if have + len(chunk) > remote.size:
                        f.close()
                        partial.unlink(missing_ok=True)
                        raise HubError(
                            f"The Hub sent more of {remote.filename} than its announced size "
                            f"({remote.size:,} bytes).", "Try again later; the partial file "
                            "was removed.")
                    try:
                        _write(f, chunk)
                    except OSError as e:
                        f.truncate(have)                 # keep whole, hashed bytes only
                        raise _write_error(e, partial, remote, have) from None
                    sha.update(chunk)
                    have += len(chunk)
                    if progress is not None:
                        progress(have, remote.size, remote.filename)
                    if cancel is not None and cancel.is_set():
                        raise _cancelled(remote, have)
    except httpx2.TransportError:
        raise
    except _client_errors() as e:
        if isinstance(e, OSError) and not isinstance(e, httpx2.HTTPError):
            raise storage_error(e, partial, "download") from None
        raise hub_error(e, s, remote.repo_id, remote.filename) from None
    if have < remote.size:                   # the body ended early without an error
        raise httpx2.RemoteProtocolError("the body ended before the announced size")
    return have, sha


def _write(f, chunk: bytes) -> None:
    """The write boundary of a download (the tests put a full disk here)."""
    f.write(chunk)
    f.flush()


def _write_error(e: OSError, partial: Path, remote: RemoteFile, have: int) -> EngineError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(
            f"The disk is full: {remote.filename} ({remote.size:,} bytes) does not fit in "
            f"{partial.parent} ({have:,} bytes written).",
            "Free some space (or move the cache with HF_HOME), then get the model again: the "
            "download resumes where it stopped.")
    return storage_error(e, partial, "download")


def copy_to(path: Path, folder: str | os.PathLike, link: bool = False) -> Path:
    """A model's file(s) copied (or hard-linked, else symlinked, with `link`) into `folder`;
    the new path of `path`. The parts of a split model go along."""
    folder = Path(folder).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise storage_error(e, folder / path.name, "create") from None
    part = split_part(path.name)
    sources = sorted(path.parent.glob(f"{part[0]}-*-of-{part[2]:05d}.gguf")) if part else [path]
    for src in sources:
        dst = folder / src.name
        tmp = dst.with_name(dst.name + ".workbench-copy")
        try:
            tmp.unlink(missing_ok=True)
            if link:
                try:
                    os.link(os.path.realpath(src), tmp)
                except OSError:
                    os.symlink(os.path.realpath(src), tmp)
            else:
                shutil.copyfile(src, tmp)
            os.replace(tmp, dst)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise storage_error(e, dst, "copy") from None
    return folder / path.name
