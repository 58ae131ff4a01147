"""Fault injection: a tier wrapper whose reads and writes fail, stall or tear as a schedule says, and
which damages its file behind the optimizer's back. For tests and fault campaigns:

    tier = FaultyTier.around(opt.store, 0, [Fault("eio", op="write", after=3)])   # the 4th write fails
    ...
    tier.damage(sg, "bitflip")                                                 # a later read must notice

Kinds: "eio" and "enospc" (the op fails with that errno), "latency" (it completes `delay_s` late),
"torn_write" (the write reports success but the second half of its slot holds garbage, as after a lost
write-back), "vanish" (the tier is gone: this op and every later one fails with ENOENT).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from .base import Tier

FAULT_KINDS = ("eio", "enospc", "latency", "torn_write", "vanish")
_ERRNO = {"eio": errno.EIO, "enospc": errno.ENOSPC, "vanish": errno.ENOENT}


@dataclass(frozen=True)
class Fault:
    """`kind` on `op` ("read" or "write"): the ops of that kind after the first `after` go wrong,
    `times` of them (0: every one from then on)."""

    kind: str
    op: str = "write"
    after: int = 0
    times: int = 1
    delay_s: float = 0.05  # "latency" only

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {self.kind!r}: choose one of {FAULT_KINDS}")
        if self.op not in ("read", "write"):
            raise ValueError(f"fault op {self.op!r}: choose 'read' or 'write'")
        if self.kind == "torn_write" and self.op != "write":
            raise ValueError("a torn_write fault applies to op='write'")
        if self.after < 0 or self.times < 0 or self.delay_s < 0:
            raise ValueError(f"{self}: after, times and delay_s must be >= 0")

    def hits(self, n: int) -> bool:
        """Whether the n-th op (from 0) of its kind goes wrong."""
        return n >= self.after and (self.times == 0 or n < self.after + self.times)


class FaultyTier(Tier):
    """`inner` (an attached tier) with `faults` injected; `injected` counts the ops that went wrong."""

    def __init__(self, inner: Tier, faults: list[Fault]) -> None:
        super().__init__(inner.spec)
        self.inner = inner
        self.faults = list(faults)
        self._slot_offsets, self._slot_bytes = inner._slot_offsets, inner._slot_bytes
        self._count = {"read": 0, "write": 0}
        self._lock = threading.Lock()
        self._gone = False
        self.injected = 0

    @classmethod
    def around(cls, store, index: int, faults: list[Fault]) -> FaultyTier:
        """Wraps tier `index` of a SubgroupStore (its pipeline shares the list) and returns the wrapper."""
        tier = cls(store.tiers[index], faults)
        store.tiers[index] = tier
        return tier

    @property
    def path(self) -> str:
        return self.inner.path

    @property
    def lock_wait_s(self) -> float | None:
        return self.inner.lock_wait_s

    def _open(self, tag: str, total_bytes: int) -> None:
        raise RuntimeError("FaultyTier wraps a tier that is already attached")

    def _due(self, op: str) -> Fault | None:
        with self._lock:
            n = self._count[op]
            self._count[op] += 1
            fault = next((f for f in self.faults if f.op == op and f.hits(n)), None)
            if fault is not None and fault.kind == "vanish":
                self._gone = True
            if fault is not None or self._gone:
                self.injected += 1
            return fault if fault is not None or not self._gone else Fault("vanish", op)

    def _slot(self, key: int) -> tuple[int, int]:
        return self._slot_offsets[key], self._slot_bytes[key]

    def _run(self, fault: Fault | None, start) -> Future:
        if fault is None:
            return start()
        out: Future = Future()
        if fault.kind in _ERRNO:
            code = _ERRNO[fault.kind]
            out.set_exception(OSError(code, f"{os.strerror(code)} (injected)", self.path))
            return out

        def later() -> None:
            time.sleep(fault.delay_s)
            try:
                out.set_result(start().result())
            except BaseException as exc:
                out.set_exception(exc)

        threading.Thread(target=later, daemon=True).start()
        return out

    def write(self, key: int, buf: torch.Tensor) -> Future:
        fault = self._due("write")
        if fault is not None and fault.kind == "torn_write":
            fut = self.inner.write(key, buf)
            fut.result()
            offset, nbytes = self._slot(key)
            self._scribble(offset + nbytes // 2, nbytes - nbytes // 2)
            return fut
        return self._run(fault, lambda: self.inner.write(key, buf))

    def read(self, key: int, buf: torch.Tensor) -> Future:
        return self._run(self._due("read"), lambda: self.inner.read(key, buf))

    def damage(self, key: int, how: str) -> None:
        """Damages subgroup `key`'s stored copy in the file: "bitflip" (one byte of it inverted) or
        "truncate" (the file cut at the slot's start)."""
        offset, nbytes = self._slot(key)
        if how == "bitflip":
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                byte = os.pread(fd, 1, offset + nbytes // 3)
                os.pwrite(fd, bytes([byte[0] ^ 0xFF]), offset + nbytes // 3)
            finally:
                os.close(fd)
        elif how == "truncate":
            os.truncate(self.path, offset)
        else:
            raise ValueError(f"damage {how!r}: choose 'bitflip' or 'truncate'")

    def _scribble(self, offset: int, nbytes: int) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.pwrite(fd, b"\xa5" * nbytes, offset)
        finally:
            os.close(fd)

    def discard(self, key: int) -> None:
        self.inner.discard(key)

    def close(self) -> None:
        self.inner.close()
