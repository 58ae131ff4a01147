"""closing.OwnedResources: an optimizer's tier files, threads and pinned buffers are released once, in
reverse order, by close() on the caller's thread, or by its finalizer where it was dropped without one; a
finalizer that the garbage collector runs on another thread than the main one (which may be a thread the
resources own, in the middle of a job) hands the closing to a thread of its own."""

from __future__ import annotations

import gc
import threading

from fsdp_offload.closing import OwnedResources


class Owner:
    pass


class Resource:
    def __init__(self, name: str, log: list, done: threading.Event | None = None, join: list | None = None) -> None:
        self.name, self.log, self.done, self.join = name, log, done, join

    def close(self) -> None:
        if self.join:  # a resource that waits for a thread it owns, as the update's worker or a tier's I/O threads
            self.join[0].join()
        self.log.append((self.name, threading.current_thread().name))
        if self.done is not None:
            self.done.set()


def test_close_releases_in_reverse_once_on_the_callers_thread():
    log: list = []
    owner = Owner()
    owned = OwnedResources(owner, [Resource("a", log), None, Resource("b", log)])
    assert owned.open
    owned.close()
    owned.close()
    assert log == [("b", "MainThread"), ("a", "MainThread")] and not owned.open
    del owner
    gc.collect()
    assert len(log) == 2  # the finalizer does not close them again


def test_a_dropped_owner_is_closed_by_its_finalizer_on_the_main_thread():
    log: list = []
    owner = Owner()
    owner.owned = OwnedResources(owner, [Resource("a", log)])
    del owner
    gc.collect()
    assert log == [("a", "MainThread")]


def test_a_finalizer_run_on_a_thread_the_resources_own_closes_them_from_a_thread_of_its_own():
    """The owner is dropped on a worker thread whose end one resource's close() waits for: closed there,
    it would wait for itself (Python raises, and the rest stays open)."""
    log: list = []
    done = threading.Event()
    worker: list = []
    go = threading.Event()

    def job() -> None:
        owner = Owner()
        owner.owned = OwnedResources(owner, [Resource("buffers", log, done), Resource("threads", log, join=worker)])
        go.wait(60)
        del owner  # the last reference: the finalizer runs here, on the worker
        log.append(("job goes on", threading.current_thread().name))

    worker.append(threading.Thread(target=job, name="owned-worker"))
    worker[0].start()
    go.set()
    assert done.wait(60), "the finalizer's closing did not finish"
    worker[0].join(60)
    assert log == [("job goes on", "owned-worker"), ("threads", "fsdp-offload-close"), ("buffers", "fsdp-offload-close")]
