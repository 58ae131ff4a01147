"""Who holds a set of flock()ed files: the processes /proc/locks names, for a lock wait's message."""

from __future__ import annotations

import contextlib
import os


def file_lock_holders(paths: list[str]) -> str:
    """The processes other than this one holding a lock on any of `paths` now, from /proc/locks
    ('pid N (command)', comma-separated), or 'unknown'."""
    inodes = set()
    for path in paths:
        with contextlib.suppress(OSError):
            inodes.add(os.stat(path).st_ino)
    pids = []
    with contextlib.suppress(OSError):
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if "->" in parts or len(parts) < 6:  # a waiter, not a holder
                    continue
                if int(parts[5].rsplit(":", 1)[-1]) in inodes and parts[4] != str(os.getpid()):
                    pids.append(int(parts[4]))
    if not pids:
        return "unknown"
    return ", ".join(f"pid {pid} ({_command(pid)})" for pid in sorted(set(pids)))


def _command(pid: int) -> str:
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    return "?"
