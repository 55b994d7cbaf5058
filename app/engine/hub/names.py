"""What a GGUF file's name says: its quant type, whether it is one part of a split model; and
what a user types for a model on the Hub (`owner/name[:FILE|:QUANT][@REVISION]`).

Pure functions over strings: no network, no files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from app.engine.errors import ConfigError

# llama.cpp's quant names (llama_ftype, LLAMA_FTYPE_MOSTLY_*) and the common variants of the
# repositories' names (Unsloth's "UD-" dynamic quants, "_XL" mixes): matched case-insensitively
# between separators (-, ., _ before; -, . after), the last match in the name winning.
_QUANT = re.compile(
    r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q[1-8](?:_[A-Z0-9]{1,3}){1,2}|B?F(?:16|32)|TQ[12]_0"
    r"|MXFP4(?:_MOE)?))(?=[-.]|$)", re.IGNORECASE)
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)

# general.file_type (llama.h's llama_ftype) -> the quant's name, for confirming the file name.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
              10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M",
              16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S",
              22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M",
              28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0",
              37: "TQ2_0", 38: "MXFP4_MOE"}


def quant_of(filename: str) -> str:
    """The quant type a GGUF file's name says ("Q4_K_M", "F16", "UD-Q4_K_XL"), upper-case;
    "" when the name says none."""
    base = filename.rsplit("/", 1)[-1]
    m = _SPLIT.match(base)
    stem = m.group("stem") if m else re.sub(r"\.gguf$", "", base, flags=re.IGNORECASE)
    found = _QUANT.findall(stem)
    return found[-1].upper() if found else ""


def split_part(filename: str) -> tuple[str, int, int] | None:
    """(the name without `-0000k-of-0000n.gguf`, k, n) for a part of a split model, else None."""
    m = _SPLIT.match(filename)
    if not m:
        return None
    return m.group("stem"), int(m.group("part")), int(m.group("count"))


def is_gguf(filename: str) -> bool:
    base = filename.rsplit("/", 1)[-1].lower()
    return base.endswith(".gguf") and not base.startswith(("mmproj", "ggml-vocab"))


@dataclass(frozen=True)
class ModelSpec:
    """A model on the Hub as the user typed it: `repo_id`, `select` (a file name, a quant
    type, or "" for "the one GGUF model of the repository") and `revision` (a branch, tag or
    commit of the repository; "main" unless `@REVISION` ends the text)."""

    repo_id: str
    select: str = ""
    revision: str = "main"

    def __str__(self) -> str:
        text = f"{self.repo_id}:{self.select}" if self.select else self.repo_id
        return text if self.revision == "main" else f"{text}@{self.revision}"


_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
# a branch, a tag (git's rules, less what a name here would not need) or a commit hash
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+/-]{0,199}$")


def looks_like_repo(text: str) -> bool:
    """Whether `text` reads as `owner/name[:x][@rev]` (and not as a path: no leading ./, / or
    ~)."""
    repo = text.split(":", 1)[0].split("@", 1)[0]
    return bool(_REPO.match(repo)) and ".." not in repo and not repo.endswith(".gguf")


def check_revision(revision: str) -> str:
    """`revision` if it reads as a branch, a tag or a commit; ConfigError otherwise."""
    if not _REVISION.match(revision) or ".." in revision or revision.endswith((".", "/")) \
            or "//" in revision:
        raise ConfigError(f"{revision!r} is not a revision (a branch, a tag or a commit).",
                          "Write it as @main, @v1.0 or @<commit>, at the end: "
                          "owner/name:Q4_K_M@v1.0.")
    return revision


def parse_spec(text: str, revision: str | None = None) -> ModelSpec:
    """`owner/name`, `owner/name:Q4_K_M` or `owner/name:file.gguf`, each optionally ending in
    `@REVISION` (a branch, tag or commit: `owner/name:Q4_K_M@v1.0`) -> ModelSpec; `revision`
    (a --revision option) when given, which must agree with an @ in the text. ConfigError for
    anything else."""
    text = text.strip()
    base, at, typed = text.rpartition("@") if "@" in text else (text, "", "")
    if at and revision is not None and typed != revision:
        raise ConfigError(f"{text!r} names revision {typed!r} and --revision {revision!r}.",
                          "Give the revision once.")
    repo, _, select = base.partition(":")
    if not looks_like_repo(repo) or "@" in base:
        raise ConfigError(f"{text!r} is not a Hugging Face model "
                          "(owner/name[:FILE|:QUANT][@REVISION]).",
                          "Write it as owner/name, e.g. unsloth/Qwen3-0.6B-GGUF:Q4_K_M.")
    if "/" in select and ".." in select.split("/"):
        raise ConfigError(f"{select!r} is not a file of a repository.", "Name a .gguf file.")
    return ModelSpec(repo, select, check_revision(typed if at else (revision or "main")))
