"""Processes on this host: is a pid alive, when did it start (to tell a reused pid)."""

from __future__ import annotations

import os
import socket


def this_host() -> str:
    return socket.gethostname()


def pid_alive(pid: int | None) -> bool:
    """Is process `pid` alive on this host? Zombies count as dead; unknown counts as alive."""
    if not pid or pid <= 0:
        return False
    if os.name == "nt":  # no cheap portable check: rely on the heartbeat timeout
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def process_started(pid: int) -> str | None:
    """When process `pid` started (clock ticks after boot, from Linux's /proc); None where
    /proc is not there, and for a process that is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in (b"Z", b"X") else fields[19].decode()
