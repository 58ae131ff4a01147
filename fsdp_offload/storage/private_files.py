"""This user's private dir in a tier dir (`<dir>/fsdp-offload-<uid>`, 0700, checked to be ours and not
a symlink) and the files in it: each rank's tier file, a calibration's, the node's tier locks.

The last user of the dir removes it (remove_private_dir: an rmdir, which fails harmlessly while any
other file is in it), so nothing of ours is left in a tier dir after a run or a planner's measurement.
That rmdir may land between another process's check of the dir and its create in it (another rank, a
job of the same user, a measurement): so files are made through a dir fd, opened without following
symlinks and checked by fstat, and a create that finds its checked dir removed (ENOENT; ESTALE from
another NFS client) makes and checks the dir again (in_private_dir), a bounded number of times. A file
is thus only ever made in the dir that was checked, and a dir with a file in it is never removed.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import socket
import stat
import uuid
from typing import Callable, TypeVar

from .base import TierError

log = logging.getLogger(__name__)
T = TypeVar("T")

_DIR_GONE = (errno.ENOENT, errno.ESTALE)  # the checked dir was removed: its last user took it away
# Each retry needs another process to empty and remove the dir inside this one's few system calls.
CREATE_ATTEMPTS = 16


def tier_root_problem(root: str, spec: str) -> str | None:
    """What keeps `root` from holding tier `spec`'s files (missing, not a dir, not writable), or None.
    Tiers never create it: a mistyped path must not fill another file system."""
    if not os.path.exists(root):
        return f"{spec}: tier dir {root} does not exist; create it or pick another path"
    if not os.path.isdir(root):
        return f"{spec}: {root} is not a directory; give a directory for the tier"
    if os.statvfs(root).f_flag & os.ST_RDONLY:  # no mode would help
        return f"{spec}: tier dir {root} is on a read-only file system; pick a path on a writable one"
    if not os.access(root, os.W_OK | os.X_OK):
        return f"{spec}: tier dir {root} is not writable by uid {os.getuid()}; fix its mode or pick another path"
    return None


def private_dir(root: str) -> str:
    """This user's dir under a tier dir `root`: `root`/fsdp-offload-<uid>."""
    return os.path.join(root, f"fsdp-offload-{os.getuid()}")


def open_private_dir(root: str, spec: str) -> int:
    """`root`/fsdp-offload-<uid>, made 0700 if missing, opened as a dir fd (never through a symlink) and
    checked by fstat to be ours and 0700. An OSError with ENOENT or ESTALE when it vanished between the
    mkdir and the open (in_private_dir tries again); a TierError naming the fix for anything else."""
    problem = tier_root_problem(root, spec)
    if problem is not None:
        raise TierError(problem)
    path = private_dir(root)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise TierError(f"{spec}: cannot create {path}: {exc.strerror}; check the file system") from exc
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in _DIR_GONE:
            raise
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP, errno.EACCES):  # (a symlink, a file, someone else's)
            raise TierError(f"{spec}: cannot open {path}: {exc.strerror}; check the file system") from exc
        fd = -1
    st = os.fstat(fd) if fd >= 0 else None
    if st is None or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        if fd >= 0:
            os.close(fd)
        raise TierError(
            f"{spec}: {path} exists but is not a 0700 directory owned by uid {os.getuid()} "
            "(a symlink or someone else's); remove it"
        )
    return fd


def in_private_dir(root: str, spec: str, make: Callable[[int], T]) -> T:
    """`make(dir_fd)` in `root`'s private dir (open_private_dir), run again in a new one where the dir
    was removed before `make` created its file (an OSError with ENOENT or ESTALE)."""
    for _ in range(CREATE_ATTEMPTS):
        try:
            dir_fd = open_private_dir(root, spec)
        except OSError as exc:
            if exc.errno not in _DIR_GONE:
                raise
            continue
        try:
            return make(dir_fd)
        except OSError as exc:
            if exc.errno not in _DIR_GONE:
                raise
        finally:
            os.close(dir_fd)
    raise TierError(
        f"{spec}: {private_dir(root)} was removed {CREATE_ATTEMPTS} times while this process made its file in "
        "it: another process keeps removing it; stop it or pick another tier dir"
    )


def make_private_dir(root: str, spec: str) -> str:
    """Makes and checks `root`'s private dir (open_private_dir) and returns its path: what a tier or a
    lock checks when built, so that a bad path fails before any training."""
    in_private_dir(root, spec, lambda dir_fd: None)
    return private_dir(root)


def remove_private_dir(root: str) -> bool:
    """Removes `root`'s private dir if it is empty (its last user takes it away); whether it did. Any
    other file in it keeps it; a process about to make one meanwhile makes the dir again (in_private_dir)."""
    try:
        os.rmdir(private_dir(root))  # (never a symlink's target: rmdir does not follow one)
    except OSError:  # ENOTEMPTY / EEXIST / EBUSY: in use; ENOENT: already gone
        return False
    return True


def create_private_file(path: str, dir_fd: int | None = None) -> int:
    """Creates `path` (relative to `dir_fd` if given) 0600 for reading and writing: never an existing
    file, never through a symlink."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(path, flags, 0o600, dir_fd=dir_fd)


_TIER_FILE = re.compile(r"^(?:rank\d+|calibrate)-(.+)-pid(\d+)-[0-9a-f]+\.subgroups$")  # host, pid


def host_tag() -> str:
    """This host's name as a file name's part (what names a process's files beside its pid)."""
    return "".join(c if c.isalnum() or c in "._" else "_" for c in socket.gethostname())


def tier_file_tag(owner: str) -> str:
    """`<owner>-<host>-pid<p>-<id>` (owner: rank<r> or calibrate), the name of a process's tier file:
    unique per process, and what tells a later start on this host whether the file's process is gone."""
    return f"{owner}-{host_tag()}-pid{os.getpid()}-{uuid.uuid4().hex[:8]}"


def remove_stale_files(directory: str, tag: str, dir_fd: int | None = None) -> list[str]:
    """Removes the files that killed processes of this host (named in `tag`, see tier_file_tag) left in
    `directory` (opened as `dir_fd`, if given), any rank's or calibration's: those whose process is gone
    and whose lock no process holds. Live files are held, and their processes alive, so they stay; other
    hosts' files (a shared file system) are never judged."""
    mine = _TIER_FILE.match(f"{tag}.subgroups")
    if mine is None:
        return []
    removed = []
    for name in os.listdir(directory if dir_fd is None else dir_fd):
        m = _TIER_FILE.match(name)
        if m is None or m.group(1) != mine.group(1) or process_alive(int(m.group(2))):
            continue
        path = os.path.join(directory, name)
        at = path if dir_fd is None else name
        try:
            # read-write: where flock is emulated by POSIX locks (NFS), an exclusive lock needs write access
            fd = os.open(at, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while any owner holds it
            os.unlink(at, dir_fd=dir_fd)
            removed.append(path)
            log.info("removed %s: left by process %s, which is gone", path, m.group(2))
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def remove_dead_files(root: str, spec: str) -> list[str]:
    """remove_stale_files for tier dir `root` (tier `spec`), where this user's dir is there: what killed
    processes of this host left, removed before a plan counts the file system's free space (a run
    killed mid-step would otherwise have the next one refused for the space its files hold)."""
    try:
        if not stat.S_ISDIR(os.lstat(private_dir(root)).st_mode):
            return []
    except OSError:
        return []  # none yet: nothing left there
    try:
        fd = open_private_dir(root, spec)  # (checked ours, never through a symlink)
    except (TierError, OSError):
        return []  # the tier's own open says what is wrong there
    try:
        return remove_stale_files(private_dir(root), tier_file_tag("rank0"), fd)
    finally:
        os.close(fd)


def process_alive(pid: int) -> bool:
    """Whether process `pid` of this host runs (another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
