"""The executor interface and what `poll` answers (see the package's docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

POLL_STATES = ("pending", "running", "succeeded", "failed", "stopped", "lost")
ENDED = ("succeeded", "failed", "stopped", "lost")


@dataclass(frozen=True)
class Poll:
    state: str         # one of POLL_STATES; "lost": the executor does not know the handle
    message: str = ""  # the executor's own words (Ray's job message), for the user

    @property
    def ended(self) -> bool:
        return self.state in ENDED


class Executor(Protocol):
    name: str

    def check(self) -> str: ...

    def submit(self, job, run_dir) -> dict: ...

    def poll(self, handle: dict) -> Poll: ...

    def cancel(self, handle: dict) -> None: ...

    def logs(self, handle: dict) -> str: ...

