"""closing.OwnedResources: an optimizer's tier files, threads and pinned buffers are released once, in
reverse order, by close() on the caller's thread, or by its finalizer where it was dropped without one. The
garbage collector runs a finalizer wherever it is collecting (a thread the resources own, mid-job; the main
thread inside a hook, holding a lock the resources' threads need): the finalizer closes from a thread of its
own, which waits for them."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from fsdp_offload.closing import OwnedResources, join_closing

CPU = torch.device("cpu")


class Owner:
    pass


class Resource:
    def __init__(self, name: str, log: list, *, join: list | None = None, lock: threading.Lock | None = None,
                 fails: bool = False) -> None:  # fmt: skip
        self.name, self.log, self.join, self.lock, self.fails = name, log, join, lock, fails

    def close(self) -> None:
        if self.join:  # one that waits for a thread it owns, as the update's worker or a tier's I/O threads
            self.join[0].join()
        if self.lock is not None:  # one whose close needs a lock, as the update's worker needs its condition's
            with self.lock:
                pass
        self.log.append((self.name, threading.current_thread().name))
        if self.fails:
            raise OSError(f"{self.name} failed to close")


def owned_by(owner: Owner, *resources: Resource | None) -> OwnedResources:
    owned = OwnedResources(owner, CPU)
    owned.add(*resources)
    return owned


def test_close_releases_in_reverse_once_on_the_callers_thread():
    log: list = []
    owner = Owner()
    owned = owned_by(owner, Resource("a", log), None, Resource("b", log))
    assert owned.open
    owned.close()
    owned.close()
    assert log == [("b", "MainThread"), ("a", "MainThread")] and not owned.open
    del owner
    gc.collect()
    join_closing(60)
    assert len(log) == 2  # the finalizer does not close them again


def test_one_that_fails_to_close_leaves_the_others_closed_and_its_error_raised():
    log: list = []
    owner = Owner()
    owned = owned_by(owner, Resource("a", log), Resource("b", log, fails=True), Resource("c", log, fails=True))
    with pytest.raises(OSError, match="c failed to close"):  # the first failure
        owned.close()
    assert [name for name, _ in log] == ["c", "b", "a"]


def test_a_dropped_owner_is_closed_from_a_thread_of_its_own_even_where_the_dropping_thread_holds_a_lock():
    """Dropped inside one of the optimizer's hooks, which holds a lock that the update's worker needs to end:
    closed in place, the close would wait for that lock for good."""
    log: list = []
    lock = threading.Lock()
    owner = Owner()
    owner.owned = owned_by(owner, Resource("buffers", log), Resource("worker", log, lock=lock))
    with lock:
        del owner  # the last reference: the finalizer runs here
        log.append(("dropped", threading.current_thread().name))
    join_closing(60)
    assert log == [("dropped", "MainThread"), ("worker", "fsdp-offload-close"), ("buffers", "fsdp-offload-close")]


def test_a_finalizer_run_on_a_thread_the_resources_own_waits_for_its_job():
    """Dropped on a worker whose end one resource's close() waits for: closed there, it would wait for
    itself (Python raises, and the rest stays open)."""
    log: list = []
    worker: list = []

    def job() -> None:
        owner = Owner()
        owner.owned = owned_by(owner, Resource("buffers", log), Resource("threads", log, join=worker))
        del owner  # the last reference: the finalizer runs here, on the worker
        log.append(("job goes on", threading.current_thread().name))

    worker.append(threading.Thread(target=job, name="owned-worker"))
    worker[0].start()
    worker[0].join(60)
    join_closing(60)
    assert log == [("job goes on", "owned-worker"), ("threads", "fsdp-offload-close"), ("buffers", "fsdp-offload-close")]
