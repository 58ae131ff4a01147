"""What an optimizer owns beyond its memory (tier files, threads, pinned buffers), released once: by its
close(), on the caller's thread; or, where it was dropped without one, by its finalizer.

The garbage collector runs a finalizer on whichever thread it is collecting on, in the middle of whatever
that thread does: one of the threads the resources own (the update's worker, a tier's I/O thread, in a
job that reads them), or the main thread inside one of the optimizer's own hooks on a model that lives
on (holding the lock that the update's worker needs to end). Closing there would wait for itself, or
free a buffer under a job. So a finalizer hands the closing to a thread of its own, on the optimizer's
device, which waits for the owned threads' jobs as close() does. At interpreter exit (the main thread
has ended, and no thread would be waited for) it closes in place.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from typing import Protocol

import torch

log = logging.getLogger(__name__)
_closers: set[threading.Thread] = set()  # the finalizers' closing threads still running


class Closable(Protocol):
    def close(self) -> None: ...


class OwnedResources:
    """What `owner` holds that must be closed, in reverse order of `add`, once. `device`: where its
    buffers were registered (a closing thread starts on the first GPU)."""

    def __init__(self, owner: object, device: torch.device) -> None:
        self._resources: list[Closable | None] = []
        self._finalizer = weakref.finalize(owner, _close_dropped, self._resources, device)

    def add(self, *resources: Closable | None) -> None:
        self._resources.extend(resources)

    @property
    def open(self) -> bool:
        return self._finalizer.alive

    def close(self) -> None:
        """Closes them now, on this thread (a no-op once closed)."""
        if self._finalizer.detach() is not None:
            close_in_reverse(self._resources)


def close_in_reverse(resources: list[Closable | None]) -> None:
    """Closes each of `resources`, the last first; one that fails leaves the others to be closed, and the
    first failure is raised at the end."""
    failures = []
    for r in reversed(resources):
        try:
            if r is not None:
                r.close()
        except BaseException as exc:  # the rest still hold tier files and pinned pages
            failures.append(exc)
    if failures:
        raise failures[0]


def join_closing(timeout_s: float | None = None) -> None:
    """Waits for the closing of dropped optimizers under way (their tier files removed, threads ended)."""
    for thread in list(_closers):
        thread.join(timeout_s)


def _close_dropped(resources: list[Closable | None], device: torch.device) -> None:
    if not threading.main_thread().is_alive():  # interpreter exit: nothing would wait for a new thread
        close_in_reverse(resources)
        return

    def close() -> None:
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                close_in_reverse(resources)
        except BaseException:
            log.exception("closing a dropped OffloadAdamW failed; what it held is freed when the process ends")
        finally:
            _closers.discard(threading.current_thread())

    # a daemon: a close that waits long (a tier lock held elsewhere) must not hold the process at its exit, where
    # what it leaves is a killed run's (the next run on the host removes those tier files)
    thread = threading.Thread(target=close, name="fsdp-offload-close", daemon=True)
    _closers.add(thread)
    try:
        thread.start()
    except RuntimeError as exc:  # no thread to be had: closing here could wait for itself
        _closers.discard(thread)
        log.warning("could not start a thread to close a dropped OffloadAdamW (%s): its tier files and pinned memory "
                    "stay until the process ends; call opt.close() to release them at once", exc)  # fmt: skip
