"""The update of one step, run on a worker thread while the training loop goes on to the next forward.

`step()` hands the update to `UpdateInFlight.start` and returns. As each subgroup's new params are
copied back into the model, the worker calls `params_ready`; the forward pre-hook of each FSDP unit
calls `wait_unit`, which returns once every subgroup holding that unit's params is back (the copy's
CUDA event included), so the forward of the first units runs while the last subgroups are updated.
Everything else that needs the whole update (the next step, a backward's first grad, a save or a
load) calls `finish`, which also raises the worker's error, if it had one.

With overlap="backward" the update starts at backward's first grad, before its grads are all in: the
worker waits per subgroup (`wait_grads`) until the grad hooks say its grads are staged (`grads_in`),
or until `step()` says that all of them are (`all_grads_in`).
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Iterable

import torch

from .threads import use_cpu_threads


class UpdateAborted(RuntimeError):
    """The update was closed while it waited for grads that will not come."""


class UpdateInFlight:
    """At most one update at a time, on one worker thread. `unit_subgroups[u]`: the subgroups whose
    params FSDP unit `u` all-gathers.

    The worker is a daemon thread: an update left waiting for grads (backward raised before step())
    must not keep the interpreter from exiting; `close()`, which the optimizer's finalizer calls at
    exit too, aborts such an update and lets one that is running end."""

    def __init__(self, unit_subgroups: list[frozenset[int]]) -> None:
        self._units = unit_subgroups
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="fsdp-offload-update", daemon=True)
        self._thread.start()
        self._aborted = False
        self._cond = threading.Condition()
        self._ready: dict[int, torch.cuda.Event | None] = {}  # subgroup -> the event after its copy
        self._ended = False
        self._future: Future | None = None
        self._grads: dict[int, torch.cuda.Event | None] | None = None  # subgroup -> event after its grads' copy
        self.waited_s = 0.0  # time the caller's thread spent waiting for the update in flight

    @property
    def busy(self) -> bool:
        """An update was started and not yet finished (it may have ended on its thread)."""
        return self._future is not None

    @property
    def awaiting_grads(self) -> bool:
        """An update started during backward whose grads are not all in yet."""
        return self._future is not None and self._grads is not None

    def start(self, run: Callable[[], None], *, before_grads: bool = False, in_model: Iterable[int] = ()) -> None:
        """Runs `run` on the worker. `before_grads`: it starts while backward is still handing in grads,
        and calls `wait_grads(sg)` before it reads subgroup `sg`'s. `in_model`: subgroups whose params
        are already in the model (a retry's, which an earlier try updated)."""
        if self._future is not None:
            raise RuntimeError("an update is already in flight: finish() it first")
        self._ready, self._ended, self.waited_s = dict.fromkeys(in_model), False, 0.0
        self._grads = {} if before_grads else None
        self._aborted = False
        threads = torch.get_num_threads()
        self._future = Future()
        self._jobs.put((lambda: self._run(run, threads), self._future))

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            try:
                future.set_result(fn())
            except BaseException as exc:  # raised where the update is waited for
                future.set_exception(exc)
            del job, fn, future  # the job holds the optimizer: nothing of it waits here for the next one

    def _run(self, run: Callable[[], None], threads: int) -> None:
        use_cpu_threads(threads)  # the intra-op thread count is per thread: give the worker the caller's
        try:
            run()
        finally:
            with self._cond:
                self._ended = True
                self._cond.notify_all()

    def grads_in(self, sg: int, event: torch.cuda.Event | None) -> None:
        """Subgroup `sg`'s grads are all staged (their copy queued before `event`; None on CPU)."""
        with self._cond:
            self._grads[sg] = event
            self._cond.notify_all()

    def all_grads_in(self) -> None:
        """Every grad of the step is staged and has landed: no subgroup waits any more."""
        with self._cond:
            self._grads = None
            self._cond.notify_all()

    def next_with_grads(self, subgroups: list[int], rank: Callable[[int], int]) -> int:
        """On the worker: of `subgroups`, the one ranked first by `rank` among those whose grads are in,
        waiting until one's are."""
        with self._cond:
            while True:
                self._check_aborted()
                ready = subgroups if self._grads is None else [sg for sg in subgroups if sg in self._grads]
                if ready:
                    return min(ready, key=rank)
                self._cond.wait()

    def wait_grads(self, sg: int) -> None:
        """On the worker: returns once subgroup `sg`'s grads are in host (or device) memory."""
        with self._cond:
            while self._grads is not None and sg not in self._grads:
                self._check_aborted()
                self._cond.wait()
            event = None if self._grads is None else self._grads[sg]
        if event is not None:
            event.synchronize()

    def params_ready(self, sg: int, event: torch.cuda.Event | None) -> None:
        """Called on the worker once subgroup `sg`'s new params are queued for the model (`event`
        recorded after the copy, None on CPU)."""
        with self._cond:
            self._ready[sg] = event
            self._cond.notify_all()

    def wait_unit(self, unit: int) -> None:
        """Returns once unit `unit`'s params are all updated and in the model; raises the update's
        error if it stopped before them."""
        if self._future is None or self._grads is not None:
            return  # nothing in flight, or a forward during backward (a recompute): it needs the old params
        need = self._units[unit]
        start = time.perf_counter()
        with self._cond:
            while not self._ended and not need <= self._ready.keys():
                self._cond.wait()
            missing = not need <= self._ready.keys()
            events = [self._ready[sg] for sg in need if sg in self._ready]
        if missing:
            self.finish()  # the update ended without them: raises its error
            raise RuntimeError(f"the update ended without updating subgroups {sorted(need - self._ready.keys())}")
        for event in events:
            if event is not None:
                # On the CPU: FSDP's all-gather copies the shard on a stream of its own, after this.
                event.synchronize()
        self.waited_s += time.perf_counter() - start

    def finish(self) -> None:
        """Waits for the whole update and raises its error, if any (once)."""
        if self._future is None:
            return
        if self._grads is not None and not self._aborted:
            raise RuntimeError("the update in flight still waits for grads: call all_grads_in() first")
        start = time.perf_counter()
        future, self._future = self._future, None
        try:
            future.result()
        finally:
            self.waited_s += time.perf_counter() - start

    def _check_aborted(self) -> None:
        if self._aborted:
            raise UpdateAborted("closed while the update waited for grads: the step was not finished")

    def abort(self) -> None:
        """Makes an update that waits for grads stop with UpdateAborted (one that runs goes on)."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    def close(self) -> None:
        """Aborts an update left waiting for grads, lets a running one end, and stops the worker."""
        if self._grads is not None:
            self.abort()
        self._jobs.put(None)
        self._thread.join()
