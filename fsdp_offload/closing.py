"""What an optimizer owns beyond its memory (tier files, threads, pinned buffers), released once: by its
close(), on the caller's thread; or, where it was dropped without one, by its finalizer.

The garbage collector runs a finalizer on whichever thread it is collecting on. That may be one of the
threads the resources own (the update's worker, a tier's I/O thread), in the middle of a job that reads
them: closing them there would wait for that thread to end, or free a buffer under it. So a finalizer
that runs on any thread but the main one hands the closing to a thread of its own, which waits for the
owned threads' jobs as close() does.
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol


class Closable(Protocol):
    def close(self) -> None: ...


class OwnedResources:
    """`resources` (None for one not built) of `owner`, closed in reverse order, once."""

    def __init__(self, owner: object, resources: list[Closable | None]) -> None:
        self._resources = resources
        self._finalizer = weakref.finalize(owner, _close_where_safe, resources)

    @property
    def open(self) -> bool:
        return self._finalizer.alive

    def close(self) -> None:
        """Closes them now, on this thread (a no-op once closed)."""
        if self._finalizer.detach() is not None:
            close_in_reverse(self._resources)


def close_in_reverse(resources: list[Closable | None]) -> None:
    for r in reversed(resources):
        if r is not None:
            r.close()


def _close_where_safe(resources: list[Closable | None]) -> None:
    if threading.current_thread() is threading.main_thread():
        close_in_reverse(resources)
        return
    try:
        threading.Thread(target=close_in_reverse, args=(resources,), name="fsdp-offload-close").start()
    except RuntimeError:  # no new thread at interpreter shutdown: the process is ending, and its memory with it
        pass
