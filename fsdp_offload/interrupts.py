"""Ctrl-C between subgroups, not inside one: a subgroup's update overwrites its grads with the new
params, so it must run whole or not at all for a retried step() to be right."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator


@contextlib.contextmanager
def interrupts_between_subgroups() -> Iterator[None]:
    """Holds a Ctrl-C (SIGINT) that arrives inside the block until the block has finished, then raises
    it: a subgroup's update, which overwrites its grads with the new params run by run, is then done
    whole or not at all, and a retried step() never takes params for grads. Off the main thread (the
    overlapped update's worker) no signal is delivered, so there is nothing to hold."""
    previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if previous is None:  # a worker thread, or a handler not set from Python: leave it be
        yield
        return
    held: list[tuple[int, Any]] = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held and callable(previous):
            previous(*held[0])  # the default handler raises KeyboardInterrupt here, between subgroups
        elif held and previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)
