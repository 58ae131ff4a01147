"""The file system calls a checkpoint's commit makes, in one object, so that their order (every file
and dir fsynced before the rename that commits them, the parent fsynced after it) is stated once and
a test can record it (tests/test_checkpoint_commit.py)."""

from __future__ import annotations

import os


class FileOps:
    """fsync, write and rename as a commit uses them; a test's subclass records the calls."""

    def fsync_file(self, path: str) -> None:
        _fsync(path, os.O_RDONLY | os.O_NOFOLLOW)

    def fsync_dir(self, path: str) -> None:
        _fsync(path, os.O_RDONLY | os.O_DIRECTORY)

    def write_file(self, path: str, data: bytes) -> None:
        """A new file holding `data`, on disk when this returns (0600, never through a symlink)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)


def sync_tree(root: str, ops: FileOps) -> None:
    """fsyncs every file under `root`, then every dir, deepest first, then `root`: what DCP wrote (it
    fsyncs its files, not their names) and what the commit wrote, before the rename that commits it."""
    for here, dirs, files in os.walk(root, topdown=False):
        for name in sorted(files):
            ops.fsync_file(os.path.join(here, name))
        ops.fsync_dir(here)


def commit_dir(tmp: str, final: str, ops: FileOps) -> None:
    """Makes `tmp` durable, renames it to `final`, and makes the rename durable."""
    sync_tree(tmp, ops)
    ops.replace(tmp, final)
    ops.fsync_dir(os.path.dirname(final) or ".")


def _fsync(path: str, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
