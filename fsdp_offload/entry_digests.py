"""A CRC32 of every entry a checkpoint's DCP parts hold, so that one flipped bit in the model, the
trainer state (step, data position, RNG) or the optimizer's meta entry is refused rather than trained
on, and an entry from another save is refused too.

- An entry's digest is the CRC32 of its bytes as stored in its file: each rank reads back what it wrote
  once DCP has written it (`DigestingFileSystemWriter`), and a reader checks an entry before DCP
  parses it (dcp_reader.SafeFileSystemReader).
- A subgroup's entry carries CRC32s of its 8 MiB chunks (optimizer_state.py), checked as it streams in;
  its digest is the CRC32 of those CRC32s, taken when it is written and checked as it is read, so the
  subgroups are never read twice.
The digests of all ranks go to the checkpoint's manifest (checkpoint/manifest.py).
"""

from __future__ import annotations

import os
import zlib
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

READ_BLOCK = 8 << 20


def entry_key(index: MetadataIndex) -> str:
    """An entry's name in the manifest: its key and, for a chunk of a sharded tensor, the chunk's offset."""
    offset = "" if index.offset is None else ",".join(str(int(o)) for o in index.offset)
    return f"{index.fqn}@{offset}"


def crc_of_range(path: str, offset: int, length: int) -> int:
    """CRC32 of `length` bytes of the file at `path` from `offset` (never through a symlink)."""
    crc = 0
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        while length > 0:
            block = os.pread(fd, min(READ_BLOCK, length), offset)
            if not block:
                raise EOFError(f"{path} ends at {offset}, {length} bytes before the entry's end")
            crc = zlib.crc32(block, crc)
            offset += len(block)
            length -= len(block)
    finally:
        os.close(fd)
    return crc


class DigestingFileSystemWriter(FileSystemWriter):
    """FileSystemWriter that fails the save when one of its writer threads failed (torch 2.13's drops
    such an error, pytorch/pytorch#191391, and would commit metadata for entries never written), and
    keeps a digest of each entry this rank wrote in `digests` (entry_key -> CRC32): the planner's
    `self_digests` where it has one (a subgroup's), else the CRC32 of the entry's bytes read back."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Any:
        future = super().write_data(plan, planner)
        results = future.wait()
        written = {r.index for r in results}
        missing = [item.index.fqn for item in plan.items if item.index not in written]
        if missing:
            raise RuntimeError(
                f"checkpoint {self.path}: {len(missing)} of {len(plan.items)} entries were not written (a writer "
                f"thread failed; its traceback is above), e.g. {missing[:3]}; nothing was committed"
            )
        own: dict[str, int] = getattr(planner, "self_digests", {})
        self.digests: dict[str, int] = {}
        self.self_checked: set[str] = set()
        for result in results:
            key = entry_key(result.index)
            if key in own:
                self.digests[key] = own[key]
                self.self_checked.add(key)
            else:
                info = result.storage_data
                self.digests[key] = crc_of_range(os.path.join(str(self.path), info.relative_path), info.offset, info.length)
        return future
