"""A hung rank found within a minute or two, not after the collective timeout (30 minutes by default).

Each rank runs a thread that beats into a TCPStore of the job's own (rank 0 hosts it on a port the OS
picks; the others learn it through the process group) every `silence_s / 6` seconds, and reads the
others' beats. A rank whose beat has not changed for `silence_s` (a process stopped by SIGSTOP,
swapped out, its host gone) is named in one warning: by the lowest rank that still answers, so the job
logs it once; again when it answers. A rank stuck in a collective while its process lives beats on:
that is the collective timeout's to end (train.collective_timeout_s, which names the collective).
Clocks are never compared: a beat is a counter, its age the watcher's own.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger("train")


class RankWatchdog:
    """The heartbeat thread of this rank: `start()` (a collective: every rank calls it), `stop()`."""

    def __init__(self, silence_s: float) -> None:
        if silence_s <= 0:
            raise ValueError(f"a watchdog needs silence_s > 0, got {silence_s}")
        self.silence_s = float(silence_s)
        self.beat_s = max(0.2, self.silence_s / 6)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reported: set[int] = set()  # ranks named as silent and not heard from since

    def start(self) -> "RankWatchdog":
        """Sets up the store (rank 0 hosts it) and starts beating; every rank must call it."""
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        store = dist.TCPStore(host, 0, self.world, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False) if self.rank == 0 else None
        port = [store.port if store is not None else 0]
        dist.broadcast_object_list(port, src=0)
        if store is None:
            store = dist.TCPStore(host, port[0], self.world, is_master=False, timeout=timedelta(seconds=30))
        store.set_timeout(timedelta(seconds=max(1.0, self.beat_s)))
        self._store = store
        self._me = f"{socket.gethostname()} pid {os.getpid()}"
        store.set(f"beat/{self.rank}", f"0|{self._me}")  # every rank's first beat is there before any is watched
        dist.barrier()
        self._thread = threading.Thread(target=self._run, name="fsdp-offload-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        count = 0
        seen: dict[int, tuple[bytes, float]] = {}  # rank -> (its last beat, when it changed, by our clock)
        started = time.monotonic()
        store_silent_since: float | None = None
        while not self._stop.wait(self.beat_s):
            count += 1
            now = time.monotonic()
            try:
                self._store.set(f"beat/{self.rank}", f"{count}|{self._me}")
                beats = self._store.multi_get([f"beat/{r}" for r in range(self.world)])
                store_silent_since = None
            except Exception:  # noqa: BLE001 - the store's host (rank 0) does not answer: that is the news
                store_silent_since = store_silent_since or now
                if now - store_silent_since >= self.silence_s and 0 not in self.reported and self.rank == min(range(1, self.world), default=1):
                    self.reported.add(0)
                    log.warning("watchdog: rank 0 (host of the heartbeat store) has not answered for %.0f s: it may be stopped, "
                                "swapped out or its host gone; the other ranks wait in their collectives until "
                                "train.collective_timeout_s", now - store_silent_since)  # fmt: skip
                continue
            for r, beat in enumerate(beats):
                if r not in seen or seen[r][0] != beat:
                    if r in self.reported:
                        self.reported.discard(r)
                        if self._reporter(seen, now):
                            log.warning("watchdog: rank %d answers again", r)
                    seen[r] = (beat, now)
            for r, (beat, since) in seen.items():
                quiet = now - max(since, started)
                if r != self.rank and quiet >= self.silence_s and r not in self.reported:
                    self.reported.add(r)
                    if self._reporter(seen, now):
                        who = beat.decode(errors="replace").split("|", 1)[-1]
                        log.warning("watchdog: rank %d (%s) has not answered for %.0f s: it may be stopped (SIGSTOP), swapped "
                                    "out or its host gone; the other ranks wait in their collectives until "
                                    "train.collective_timeout_s", r, who, quiet)  # fmt: skip

    def _reporter(self, seen: dict[int, tuple[bytes, float]], now: float) -> bool:
        """Whether this rank is the lowest one still answering (so one rank logs what it sees)."""
        alive = [r for r, (_, since) in seen.items() if r == self.rank or now - since < self.silence_s]
        return self.rank == min(alive, default=self.rank)


_running: list[RankWatchdog] = []


def start_watchdog(silence_s: float | None) -> None:
    """Starts this rank's watchdog for the run (none with one rank or silence_s null/0)."""
    if silence_s and dist.is_initialized() and dist.get_world_size() > 1:
        _running.append(RankWatchdog(silence_s).start())


def stop_watchdog() -> None:
    while _running:
        _running.pop().stop()
