"""Node-level tier access: at most k processes of a node do I/O on one tier at a time.

Concurrent processes on one disk lose aggregate bandwidth (DEVICE.md: 4 processes lose a fifth of the
reads), so by default a process must hold the tier's lock to issue I/O on it. The lock is one of k
flock()ed files in a node-local dir: the kernel drops a flock when its holder dies, even by SIGKILL.
A process holds the lock only while it has requests on the tier in flight, so a holder never waits
for anything else while holding, and processes waiting for one tier keep using the others.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from typing import Callable

import torch

from .base import Tier, TierError
from .lock_holders import file_lock_holders
from .private_files import in_private_dir, make_private_dir, remove_private_dir, tier_root_problem

_POLL_S = 0.001  # how often a waiting process retries the lock files
log = logging.getLogger(__name__)
_open_locks: weakref.WeakSet[NodeTierLock] = weakref.WeakSet()


def access_slots(access: str | int) -> int | None:
    """Processes allowed on a tier at once: "exclusive" -> 1, "shared" -> None (no limit), k -> k."""
    if access == "exclusive":
        return 1
    if access == "shared":
        return None
    if isinstance(access, str) and access.isdigit():
        access = int(access)
    if isinstance(access, int) and not isinstance(access, bool) and access >= 1:
        return access
    raise ValueError(f"offload.tier_access={access!r}: choose 'exclusive', 'shared' or a number of processes k >= 1")


def lock_root_problem(lock_root: str) -> str | None:
    """What keeps `lock_root` (offload.tier_lock_dir) from holding the node's tier locks, or None."""
    problem = tier_root_problem(lock_root, "tier lock")
    return None if problem is None else _lock_dir_error(lock_root, problem)


def _lock_dir_error(lock_root: str, problem: str) -> str:
    return f"offload.tier_lock_dir={lock_root!r}: {problem}; set it to a node-local directory"


class NodeTierLock:
    """`slots` flock()ed files for one tier dir in `lock_root`: holding any one of them is a licence
    to do I/O on the tier. Keeps a log of its holds in perf_counter times (CLOCK_MONOTONIC on Linux:
    comparable across processes).

    A slot is taken under the tier's gate file, whole for an exclusive process and shared by those of
    several slots: an exclusive job holds the tier alone against a job of any offload.tier_access (jobs of
    unlike counts above one are bounded by the larger). An exclusive waiter holds the intent file, which the
    others take shared to enter the gate: new holds stop, those under way end, and it gets in.

    The last user removes the files (tier dirs come and go; their lock files should too), and the dir
    when nothing else is in it. Removing a file that another process has open and waits on would give
    two holders, one on the removed file: so a lock taken is only good if its file is still the one at
    the path, else it is opened anew (in the dir made again, if it went too: private_files.py).
    """

    def __init__(self, tier_dir: str, lock_root: str, slots: int, timeout_s: float = 1800.0) -> None:
        if slots < 1:
            raise ValueError(f"tier lock for {tier_dir}: slots must be >= 1, got {slots}")
        try:
            lock_dir = make_private_dir(lock_root, "tier lock")
        except TierError as exc:
            raise TierError(_lock_dir_error(lock_root, str(exc))) from exc
        self.lock_root = lock_root
        real = os.path.realpath(tier_dir)
        name = f"{os.path.basename(real) or 'root'}-{hashlib.sha1(real.encode()).hexdigest()[:12]}"
        self.tier_dir = real
        self.paths = [os.path.join(lock_dir, f"{name}.slot{j}.lock") for j in range(slots)]
        self.gate_path = os.path.join(lock_dir, f"{name}.gate.lock")
        self.intent_path = os.path.join(lock_dir, f"{name}.intent.lock")
        self._exclusive = slots == 1
        self._fd = {path: self._open(path) for path in [*self.paths, self.gate_path, self.intent_path]}  # (-1: closed)
        self._held: int | None = None  # index of the slot this process holds
        self._since = 0.0
        self.holds: deque[tuple[float, float]] = deque(maxlen=4096)  # (acquired, released)
        self.wait_s = 0.0  # total time spent waiting for the lock
        self.timeout_s = timeout_s  # how long wait() waits before it fails, naming who holds the lock
        _open_locks.add(self)

    def _open(self, path: str) -> int:
        name = os.path.basename(path)
        try:
            return in_private_dir(self.lock_root, "tier lock", lambda dir_fd: os.open(
                name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd))  # fmt: skip
        except TierError as exc:
            raise TierError(_lock_dir_error(self.lock_root, str(exc))) from exc
        except OSError as exc:
            raise TierError(
                f"cannot open tier lock file {path}: {exc.strerror}; set offload.tier_lock_dir to a writable "
                "node-local dir"
            ) from exc

    def _is_current(self, path: str) -> bool:
        """Whether `path`'s open file is still the one at the path (not removed by a last user)."""
        try:
            at_path = os.stat(path)
        except FileNotFoundError:
            return False
        mine = os.fstat(self._fd[path])
        return (at_path.st_dev, at_path.st_ino) == (mine.st_dev, mine.st_ino)

    def _take(self, path: str, mode: int) -> bool:
        """Takes `path`'s file in `mode` (LOCK_SH or LOCK_EX) where no process holds it otherwise (opened
        anew where a last user removed it)."""
        try:
            fcntl.flock(self._fd[path], mode | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        try:
            if self._is_current(path):
                return True
        except BaseException:  # (not left held where the check fails)
            self._let_go(path)
            raise
        fcntl.flock(self._fd[path], fcntl.LOCK_UN)
        os.close(self._fd[path])
        self._fd[path] = -1  # never leave a closed (and maybe reused) fd number behind
        self._fd[path] = self._open(path)
        return self._take(path, mode)

    def _let_go(self, path: str) -> None:
        fcntl.flock(self._fd[path], fcntl.LOCK_UN)

    def _try(self, j: int) -> bool:
        """Takes slot j under the gate (whole for an exclusive process; shared otherwise, while no
        exclusive one waits), or nothing."""
        if self._exclusive:
            if not self._take(self.gate_path, fcntl.LOCK_EX):
                return False
        else:
            if not self._take(self.intent_path, fcntl.LOCK_SH):
                return False  # an exclusive process waits: let the holds under way end
            try:
                entered = self._take(self.gate_path, fcntl.LOCK_SH)
            finally:
                self._let_go(self.intent_path)
            if not entered:
                return False
        try:
            if self._take(self.paths[j], fcntl.LOCK_EX):
                return True
        except BaseException:
            self._let_go(self.gate_path)  # (a slot file that cannot be opened again: the gate is not kept)
            raise
        self._let_go(self.gate_path)
        return False

    @property
    def held(self) -> bool:
        return self._held is not None

    def acquire(self, timeout: float | None = None) -> bool:
        """Takes a free slot, waiting up to `timeout` seconds (None: as long as it takes)."""
        if self._held is not None:
            raise RuntimeError(f"tier lock for {self.tier_dir} is already held by this process")
        start, announced = time.perf_counter(), False
        try:
            while True:
                for j in range(len(self.paths)):
                    if not self._try(j):
                        continue
                    self._held, self._since = j, time.perf_counter()
                    self.wait_s += self._since - start
                    return True
                if timeout is not None and time.perf_counter() - start >= timeout:
                    self.wait_s += time.perf_counter() - start
                    return False
                if self._exclusive:  # (a free tier is taken at the first pass, with none of this)
                    announced = self._hold_intent(announced)
                time.sleep(_POLL_S)
        finally:
            if announced:
                self._let_go(self.intent_path)

    def _hold_intent(self, holding: bool) -> bool:
        """A waiting exclusive process's intent file: held while others share the gate, so that they start
        no new hold; let go while another exclusive process has it whole (held then, it would keep the
        others out for nothing). Returns whether it is held."""
        shared = self._take(self.gate_path, fcntl.LOCK_SH)
        if shared:
            self._let_go(self.gate_path)
        if shared and not holding:
            return self._take(self.intent_path, fcntl.LOCK_EX)
        if not shared and holding:
            self._let_go(self.intent_path)
            return False
        return holding

    def wait(self) -> None:
        """acquire(), saying once (after a tenth of timeout_s) who holds the lock, and raising a
        TierError that names them when timeout_s has passed."""
        if self.acquire(timeout=self.timeout_s / 10):
            return
        log.warning("waited %.0f s for the node lock of %s (%s, held by %s); waiting up to %.0f s",
                    self.timeout_s / 10, self.tier_dir, self.gate_path, self.holders(), self.timeout_s)  # fmt: skip
        if not self.acquire(timeout=self.timeout_s * 0.9):
            raise TierError(
                f"waited {self.timeout_s:.0f} s for the node lock of {self.tier_dir} ({self.gate_path} and its slots), "
                f"held by {self.holders()}: another job's process (of any offload.tier_access on this tier dir), or a rank "
                "that a killed launcher left behind, holds it. End that process, or raise offload.tier_lock_timeout_s, or set "
                "offload.tier_access=shared"
            )

    def holders(self) -> str:
        """The processes holding this lock's files now ('pid N (command)'), or 'unknown'."""
        return file_lock_holders(list(self._fd))

    def release(self) -> None:
        if self._held is None:
            raise RuntimeError(f"tier lock for {self.tier_dir} is not held")
        self.holds.append((self._since, time.perf_counter()))
        self._let_go(self.paths[self._held])
        self._let_go(self.gate_path)
        self._held = None

    def close(self) -> None:
        """Lets go, and removes the lock files that no other process holds."""
        if self._held is not None:
            self.release()
        failed: BaseException | None = None
        for path in list(self._fd):  # the slots, the gate, the intent
            error = self._close_file(path)
            failed = failed or error
        remove_private_dir(self.lock_root)
        _open_locks.discard(self)
        if failed is not None:
            raise failed

    def _close_file(self, path: str) -> BaseException | None:
        """Closes `path`'s file, removing it where no other process holds it (one waiting on it finds it
        removed and opens a new one); returns the error it met, if any: the other files are closed all
        the same. A file closed before (a second close, a forked child's) is left be."""
        if self._fd[path] < 0:
            return None
        try:
            if self._take(path, fcntl.LOCK_EX):
                os.unlink(path)
                self._let_go(path)
            return None
        except (OSError, TierError) as exc:
            return exc
        finally:
            if self._fd[path] >= 0:
                os.close(self._fd[path])
            self._fd[path] = -1


def _drop_inherited_locks() -> None:
    """A forked child (a data loader worker, say) must not keep its parent's lock files open: a flock
    lives until the last descriptor of it closes, so the child would hold the tier after the parent died."""
    for lock in list(_open_locks):
        for path, fd in lock._fd.items():
            if fd >= 0:
                os.close(fd)
            lock._fd[path] = -1
        lock._held = None


os.register_at_fork(after_in_child=_drop_inherited_locks)


class LockedTier(Tier):
    """A tier whose requests run only while this process holds the tier's node lock.

    A gate thread takes the lock when requests arrive and queue up; while the lock is held, new
    requests are issued at once by whoever makes them; the gate lets the lock go as soon as none is in
    flight. Transfers are timed from when they are issued to the wrapped tier, so lock waits never
    count as I/O time.
    """

    def __init__(self, inner: Tier, lock: NodeTierLock) -> None:
        super().__init__(inner.spec)
        self.inner = inner
        self.lock = lock
        self._cv = threading.Condition()
        self._queue: deque[tuple[Callable[[], Future], Future]] = deque()
        self._in_flight = 0
        self._holding = False  # the lock is held and the gate is not letting it go
        self._closing = False
        self._gate = threading.Thread(target=self._run, name=f"{inner.spec}-lock", daemon=True)

    @property
    def path(self) -> str:
        return self.inner.path

    @property
    def lock_wait_s(self) -> float:
        return self.lock.wait_s

    def _open(self, tag: str, total_bytes: int) -> None:
        self.inner.attach(tag, self._slot_bytes)
        self._gate.start()

    def write(self, key: int, buf: torch.Tensor) -> Future:
        self._check_slot(key, buf)
        return self._enqueue(lambda: self.inner.write(key, buf))

    def read(self, key: int, buf: torch.Tensor) -> Future:
        self._check_slot(key, buf)
        return self._enqueue(lambda: self.inner.read(key, buf))

    def discard(self, key: int) -> None:
        self.inner.discard(key)  # file metadata, no bandwidth: not behind the node lock

    def _enqueue(self, issue: Callable[[], Future]) -> Future:
        out: Future = Future()
        with self._cv:
            if self._closing:
                raise TierError(f"{self.spec}: the tier is closed")
            direct = self._holding
            if direct:
                self._in_flight += 1  # keeps the gate from letting the lock go before it is issued
            else:
                self._queue.append((issue, out))
                self._cv.notify_all()
        if direct:
            self._issue(issue, out)
        return out

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # no request may wait forever on a gate that has stopped
            with self._cv:
                self._closing = True
                failed, self._queue = list(self._queue), type(self._queue)()
            error = TierError(f"{self.spec}: the node-level tier lock failed ({exc}); the tier is unusable")
            for _, out in failed:
                if not out.done():
                    out.set_exception(error)

    def _serve(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
            self.lock.wait()
            try:
                with self._cv:
                    batch, self._queue = self._queue, type(self._queue)()
                    self._in_flight += len(batch)
                    self._holding = True
                while batch:  # popped as issued: the gate holds on to no request, nor to its buffer
                    self._issue(*batch.popleft())
                with self._cv:
                    self._cv.wait_for(lambda: self._in_flight == 0)
                    self._holding = False
            finally:
                self.lock.release()

    def _issue(self, issue: Callable[[], Future], out: Future) -> None:
        try:
            fut = issue()
        except BaseException as exc:
            self._finished(out, None, exc)
            return
        fut.add_done_callback(lambda f: self._finished(out, f, f.exception()))

    def _finished(self, out: Future, fut: Future | None, error: BaseException | None) -> None:
        # The result goes out before the request stops counting: a follow-up request that the caller
        # makes from its callback then runs under this same hold.
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(fut.result())
        with self._cv:
            self._in_flight -= 1
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._gate.is_alive():
            self._gate.join()
        try:
            self.inner.close()
        finally:  # the node's lock files go whatever the tier's close raised
            self.lock.close()
