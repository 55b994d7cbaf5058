"""The clusters a user sends runs to: a name, the Ray dashboard's URL (the Jobs REST API), a path
map, and what each run asks of it. Kept in `clusters.json` beside the queue's database (the
user's state folder); the token is not in that file but in the OS keyring (`keyring`). On a
machine without a keyring (a server, a bare desktop) the token is kept in `cluster-tokens.json`
beside it, a file only the user can read (0600, in the 0700 state folder), and saving says so;
the environment variable `cluster_token_env(name)`, if set, comes before both.

The run directory is the contract between this machine and the cluster: runs live on storage
both see, perhaps under other prefixes. A `PathMap` translates one to the other, prefix by
prefix; a run folder under no local prefix cannot be sent (except to a loopback cluster, which
sees this machine's paths as they are).
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import PurePosixPath
from urllib.parse import urlparse, urlsplit

from app.engine.errors import ConfigError, EngineError
from app.engine.runtime.files import atomic_write_json, read_json
from app.engine.runtime.paths import state_file, user_state_dir

KEYRING_SERVICE = "gguf-workbench"
TOKEN_FILE = "cluster-tokens.json"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
MAX_RESOURCES = 1e6  # CPUs or GPUs one run may ask: a sanity bound, not a cluster's size
URL_HINT = "Give the Ray dashboard's address, e.g. http://head-node:8265."
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
# host (DNS labels, IPv4, or a bracketed IPv6 address that urlsplit checks), then ":port"
_AUTHORITY = re.compile(rf"(?:\[[0-9A-Fa-f:.]+\]|{_LABEL}(?:\.{_LABEL})*\.?)(?::[0-9]+)?")


class ClusterError(EngineError):
    kind = "cluster"


def cluster_token_env(name: str) -> str:
    """The environment variable that holds cluster `name`'s token where no keyring is."""
    return "WORKBENCH_CLUSTER_TOKEN_" + re.sub(r"[^A-Za-z0-9]", "_", name).upper()


def check_token(name: str, token: str, where: str = "") -> str:
    """`token` as it goes into the Authorization header, or a ConfigError: printable ASCII
    without spaces (Ray's tokens are hex; a line break would be a header of its own)."""
    if not (token.isascii() and token.isprintable()) or any(c.isspace() for c in token):
        raise ConfigError(f"The token of cluster {name!r}{where} holds a space, a control "
                          "character or a character other than ASCII.",
                          "Give the head's RAY_AUTH_TOKEN exactly as it is, on one line.")
    return token


def _split_userinfo(url: str) -> tuple[str, str, str]:
    """(before the authority's "user:password@", that userinfo, the rest); plain string work,
    so that it holds for any text."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "", "", url
    authority_end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    userinfo, at, host = rest[:authority_end].rpartition("@")
    if not at:
        return scheme + sep, "", rest
    return scheme + sep, userinfo + at, host + rest[authority_end:]


def without_credentials(url: str) -> str:
    """`url` without the "user:password@" of its authority (if any)."""
    head, _, rest = _split_userinfo(url)
    return head + rest


def check_url(url) -> str:
    """The Ray dashboard's URL `url` as the workbench keeps it (without a trailing "/"), or a
    ConfigError saying what is wrong with it: printable ASCII only (no whitespace or control
    characters: an internationalised host in its xn-- form), http or https, a host, a port
    from 1 to 65535 if one is given, no query or fragment, and no credentials (the head's
    token goes to the keyring instead: a password in the URL would be stored in clusters.json
    and printed). The message never repeats a password."""
    shown = without_credentials(url) if isinstance(url, str) else url
    if not isinstance(url, str) or not url:
        raise ConfigError("The cluster's URL is empty.", URL_HINT)
    if not (url.isascii() and url.isprintable()) or any(c.isspace() for c in url):
        raise ConfigError(f"Cluster URL {shown!r} contains a space, a control character or a "
                          "character other than ASCII.",
                          URL_HINT + " Write an internationalised host name in its xn-- form.")
    head, userinfo, rest = _split_userinfo(url)
    if userinfo:
        raise ConfigError(f"Cluster URL {head + '***@' + rest!r} holds a user name or password; "
                          "the workbench "
                          "does not keep credentials in URLs.",
                          "Give the URL without them, and the head's token with --token-stdin "
                          "(Settings > Clusters: the Token field): it is kept in the OS keyring.")
    try:
        parsed = urlsplit(url)
        port, host = parsed.port, parsed.hostname
    except ValueError as e:  # "Invalid IPv6 URL", "Port out of range 0-65535", ...
        raise ConfigError(f"Cluster URL {shown!r} is not a usable address ({e}).",
                          URL_HINT + " A port is a number from 1 to 65535.") from None
    if parsed.scheme not in ("http", "https") or not host:
        raise ConfigError(f"Cluster URL {shown!r} is not an http(s) address with a host.",
                          URL_HINT)
    if not _AUTHORITY.fullmatch(parsed.netloc) or len(host) > 253:
        raise ConfigError(f"Cluster URL {shown!r}: {parsed.netloc!r} is not a host name or "
                          "address with an optional :port.", URL_HINT)
    if port == 0:
        raise ConfigError(f"Cluster URL {shown!r}: port 0 is not a port to connect to.",
                          "Give the dashboard's port, 1 to 65535 (8265 by default).")
    if parsed.query or parsed.fragment or url.endswith(("?", "#")):
        raise ConfigError(f"Cluster URL {shown!r} has a query or fragment (?, #).", URL_HINT)
    return url.rstrip("/")


def _normalise_prefix(prefix: str) -> str:
    """'/mnt/runs/' -> '/mnt/runs' (POSIX form; the root stays '/')."""
    text = str(PurePosixPath(prefix))
    if not text.startswith("/"):
        raise ConfigError(f"Path map prefix {prefix!r} is not an absolute path.",
                          "Write both sides of each pair as absolute paths, e.g. "
                          "/home/me/runs=/mnt/shared/runs.")
    return text


def _under(path: str, prefix: str) -> bool:
    return path == prefix or prefix == "/" or path.startswith(prefix + "/")


def _swap(path: str, old: str, new: str) -> str:
    rest = path[len(old):].lstrip("/") if old != "/" else path.lstrip("/")
    return str(PurePosixPath(new) / rest) if rest else new


@dataclass(frozen=True)
class PathMap:
    """(local prefix, cluster prefix) pairs; the longest matching prefix wins."""
    pairs: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "pairs", tuple((_normalise_prefix(a), _normalise_prefix(b))
                                                for a, b in self.pairs))

    @classmethod
    def parse(cls, text: str) -> "PathMap":
        """'LOCAL=CLUSTER[,LOCAL=CLUSTER...]' (the CLI's and the settings field's form)."""
        pairs = []
        for item in filter(None, (part.strip() for part in text.split(","))):
            local, sep, remote = item.partition("=")
            if not sep or not local.strip() or not remote.strip():
                raise ConfigError(f"Path map entry {item!r} is not LOCAL=CLUSTER.",
                                  "Example: /home/me/runs=/mnt/shared/runs")
            pairs.append((local.strip(), remote.strip()))
        return cls(tuple(pairs))

    def __str__(self) -> str:
        return ",".join(f"{a}={b}" for a, b in self.pairs)

    def _match(self, path: str, side: int) -> tuple[str, str] | None:
        matches = [p for p in self.pairs if _under(path, p[side])]
        return max(matches, key=lambda p: len(p[side])) if matches else None

    def _local(self, local_path: str | os.PathLike) -> tuple[str, tuple[str, str] | None]:
        """(the path as matched, its pair). The path as given first; else both it and the
        local prefixes resolved through links (the queue keys runs by their resolved path, so
        a run under a linked shared folder arrives resolved)."""
        path = os.path.abspath(local_path)
        pair = self._match(path, 0)
        if pair is not None:
            return path, pair
        real = os.path.realpath(path)
        resolved = PathMap(tuple((os.path.realpath(a), b) for a, b in self.pairs))
        return real, resolved._match(real, 0)

    def covers(self, local_path: str | os.PathLike) -> bool:
        return self._local(local_path)[1] is not None

    def to_cluster(self, local_path: str | os.PathLike) -> str:
        path, pair = self._local(local_path)
        if pair is None:
            raise ConfigError(f"{path} is not under a shared folder of this cluster's path map.",
                              "Put the run on storage the cluster sees, and map it in Settings "
                              "> Clusters (LOCAL=CLUSTER).")
        return _swap(path, pair[0], pair[1])

    def to_local(self, cluster_path: str) -> str:
        path = str(PurePosixPath(cluster_path))
        pair = self._match(path, 1)
        if pair is None:
            raise ConfigError(f"{cluster_path} is not under a shared folder of this cluster's "
                              "path map.", "Map its folder in Settings > Clusters.")
        return _swap(path, pair[1], pair[0])


@dataclass(frozen=True)
class Cluster:
    """A Ray cluster as the workbench sees it. `url`: the dashboard's HTTP address (the Jobs API
    is under /api/jobs/). `python`: the interpreter the cluster runs the job with (one that has
    the workbench installed). `num_cpus`/`num_gpus`: what each run's entrypoint asks for."""
    name: str
    url: str
    path_map: PathMap = field(default_factory=PathMap)
    python: str = "python"
    num_cpus: float = 1.0
    num_gpus: float = 0.0

    def __post_init__(self):
        if not NAME_PATTERN.match(self.name or ""):
            raise ConfigError(f"Cluster name {self.name!r} is not usable.",
                              "Use letters, digits, '.', '_' or '-' (up to 64), starting with a "
                              "letter or digit.")
        object.__setattr__(self, "url", check_url(self.url))
        for what, value in (("CPUs", self.num_cpus), ("GPUs", self.num_gpus)):
            if not isinstance(value, (int, float)) or not 0 <= value <= MAX_RESOURCES:
                raise ConfigError(f"{what} per run must be a number from 0 to {MAX_RESOURCES:g}, "
                                  f"not {value!r}.", "Give how many each run asks, e.g. 1.")
        if not isinstance(self.python, str) or not self.python.strip() \
                or not self.python.isprintable():
            raise ConfigError(f"The cluster's Python {self.python!r} is not a command.",
                              "Give the interpreter that has the workbench on the cluster's "
                              "nodes, e.g. /opt/wb/bin/python.")
        if isinstance(self.path_map, str):
            object.__setattr__(self, "path_map", PathMap.parse(self.path_map))
        elif not isinstance(self.path_map, PathMap):
            object.__setattr__(self, "path_map", PathMap(tuple(map(tuple, self.path_map))))

    @property
    def is_loopback(self) -> bool:
        """A head on this machine: it sees this machine's paths as they are."""
        return urlparse(self.url).hostname in LOOPBACK_HOSTS

    def cluster_path(self, local_path: str | os.PathLike) -> str:
        """Where the cluster finds `local_path`; a ConfigError when it cannot (see PathMap)."""
        if self.is_loopback and not self.path_map.covers(local_path):
            return os.path.abspath(local_path)
        return self.path_map.to_cluster(local_path)

    def local_path(self, cluster_path: str) -> str:
        if self.is_loopback and self.path_map._match(cluster_path, 1) is None:
            return cluster_path
        return self.path_map.to_local(cluster_path)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["path_map"] = [list(p) for p in self.path_map.pairs]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Cluster":
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


class ClusterStore:
    """clusters.json (default: in the user's state folder) plus the tokens in the keyring."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = os.fspath(path) if path is not None else str(user_state_dir() / "clusters.json")

    def _read(self) -> dict[str, dict]:
        if not os.path.exists(self.path):
            return {}
        data = read_json(self.path, what="cluster list")
        if not isinstance(data, dict) or not isinstance(data.get("clusters"), list):
            raise ConfigError(f"{self.path} is not a cluster list.",
                              "Remove the file and add the clusters again.")
        clusters = {c["name"]: c for c in data["clusters"]
                    if isinstance(c, dict) and isinstance(c.get("name"), str)}
        for entry in clusters.values():
            # credentials in the URL of an entry from before `check_url` refused them: left
            # out (never shown, never sent: the head's token is the way in), and out of the
            # file at its next write
            if isinstance(entry.get("url"), str):
                entry["url"] = without_credentials(entry["url"])
        return clusters

    def _write(self, clusters: dict[str, dict]) -> None:
        atomic_write_json(state_file(self.path), {"clusters": [clusters[k] for k in sorted(clusters)]})

    def list(self) -> list[Cluster]:
        return [self._cluster(c) for c in self._read().values()]

    def _cluster(self, entry: dict) -> Cluster:
        """The Cluster of an entry; one that is not usable (written before its fields were
        checked, or by hand) is a ConfigError naming it and how to get rid of it."""
        try:
            return Cluster.from_dict(entry)
        except (ConfigError, TypeError, ValueError) as e:  # a field of the wrong type
            why = e.message if isinstance(e, ConfigError) else str(e)
            raise ConfigError(f"Cluster {entry.get('name')!r} in {self.path} is not usable: "
                              f"{why}", f"Remove it (`workbench cluster remove "
                                        f"{entry.get('name')}`) and add it again.") from e

    def names(self) -> list[str]:
        return sorted(self._read())

    def get(self, name: str) -> Cluster:
        clusters = self._read()
        if name not in clusters:
            known = ", ".join(sorted(clusters)) or "none yet"
            raise ClusterError(f"No cluster named {name!r} (known: {known}).",
                               "Add it with `workbench cluster add NAME URL` or in Settings.")
        return self._cluster(clusters[name])

    def save(self, cluster: Cluster, token: str | None = None) -> str | None:
        """Add or replace `cluster`; a token given is stored in the keyring, or, without one,
        in the token file. Returns a warning to show the user (where the token went when it is
        not the keyring), else None."""
        clusters = self._read()
        clusters[cluster.name] = cluster.to_dict()
        warning = None
        if token:
            warning = self._set_token(cluster.name, check_token(cluster.name, token))
        self._write(clusters)
        return warning

    def remove(self, name: str) -> None:
        clusters = self._read()
        if clusters.pop(name, None) is None:
            raise ClusterError(f"No cluster named {name!r}.", "`workbench cluster list` shows them.")
        self._write(clusters)
        self._delete_token(name)

    # ---------------------------------------------------------------- tokens
    @property
    def token_file(self) -> str:
        """Where tokens are kept on a machine without a keyring: beside clusters.json."""
        return os.path.join(os.path.dirname(self.path), TOKEN_FILE)

    def token(self, name: str) -> str | None:
        """The token of cluster `name`: its environment variable, the keyring, the token file."""
        env = os.environ.get(cluster_token_env(name))
        if env:
            return check_token(name, env, f" (in {cluster_token_env(name)})")
        try:
            token = _keyring().get_password(KEYRING_SERVICE, f"cluster:{name}")
        except Exception:        # keyring.errors.KeyringError and backend-specific failures
            token = None
        if token is not None:
            return check_token(name, token, " (in the keyring)")
        token = self._file_tokens().get(name)
        return None if token is None else check_token(name, token, f" (in {self.token_file})")

    def _set_token(self, name: str, token: str) -> str | None:
        try:
            _keyring().set_password(KEYRING_SERVICE, f"cluster:{name}", token)
        except Exception as e:   # no backend (keyring.errors.NoKeyringError) or a failing one
            tokens = self._file_tokens()
            tokens[name] = token
            self._write_tokens(tokens)
            return (f"No OS keyring is available ({e}): the token of cluster {name!r} is kept "
                    f"in {self.token_file}, a file only you can read.")
        tokens = self._file_tokens()
        if tokens.pop(name, None) is not None:   # the keyring holds it now: no second copy
            self._write_tokens(tokens)
        return None

    def _delete_token(self, name: str) -> None:
        try:
            _keyring().delete_password(KEYRING_SERVICE, f"cluster:{name}")
        except Exception:        # no such password, or no keyring: nothing to delete
            pass
        tokens = self._file_tokens()
        if tokens.pop(name, None) is not None:
            self._write_tokens(tokens)

    def _file_tokens(self) -> dict[str, str]:
        if not os.path.exists(self.token_file):
            return {}
        data = read_json(self.token_file, what="cluster token file")
        if not isinstance(data, dict):
            raise ConfigError(f"{self.token_file} is not a token file.",
                              "Remove it and save the clusters' tokens again.")
        return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}

    def _write_tokens(self, tokens: dict[str, str]) -> None:
        atomic_write_json(state_file(self.token_file), tokens, mode=0o600)


def _keyring():
    import keyring

    return keyring

