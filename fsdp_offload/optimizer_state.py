"""OffloadAdamW's state as a torch.distributed.checkpoint Stateful, one subgroup at a time.

(checkpoint.py builds a training run's checkpoints from this and the model's DCP state.)

The optimizer's state never fits in memory all at once, so its DCP state dict holds placeholders: one
per subgroup and one for the rest (step counts, hyperparameters, loss scale, learned bandwidths). The
planners below resolve a placeholder only when DCP writes or reads that entry: a save reads the
subgroup from the GPU, the host cache or its tier into a buffer that is gone once written; a load
checks each subgroup as it arrives and writes it into the cache or a tier (the tiers may be other dirs
than when it was saved). Each subgroup is one entry of raw bytes under a rank's own key, followed by
CRC32s of its 8 MiB chunks, so a damaged checkpoint is refused rather than trained on.

    state = {"model": get_model_state_dict(model), "optim": OffloadOptimizerState(optimizer)}
    dcp.save(state, checkpoint_id=path, planner=StreamingSavePlanner())
    dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=StreamingLoadPlanner())

(SafeFileSystemReader, from dcp_reader.py, reads the metadata without unpickling code; DCP's own
FileSystemReader, which `checkpoint_id=path` picks, would run whatever a crafted .metadata holds.)

With more than one writer thread, save through `CheckedFileSystemWriter`.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, WriteItem

from .cache import aligned_host_buffer
from .dcp_reader import CheckpointFileError
from .entry_digests import DigestingFileSystemWriter, entry_key
from .optimizer import OffloadAdamW
from .store import LAYOUT_FIX, size_mismatch

_HINT = (
    "save and load OffloadOptimizerState with dcp.save / dcp.load and planner=StreamingSavePlanner() / "
    "StreamingLoadPlanner() (dcp.async_save is not supported: it would copy the whole state into memory)"
)
CHUNK_BYTES = 8 << 20  # one CRC32 per chunk
_MAGIC = b"FOSG"
_crc_pool: ThreadPoolExecutor | None = None


def _chunk_crcs(data: memoryview) -> list[int]:
    """CRC32 of each CHUNK_BYTES of `data`, in parallel (zlib lets the GIL go)."""
    global _crc_pool
    if _crc_pool is None:
        _crc_pool = ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="fsdp-offload-crc")
    return list(_crc_pool.map(lambda lo: zlib.crc32(data[lo : lo + CHUNK_BYTES]), range(0, len(data), CHUNK_BYTES)))


def trailer_bytes(state_bytes: int) -> int:
    """Size of what follows a subgroup's state in its entry: magic, chunk count, one CRC32 per chunk."""
    return 8 + 4 * -(-state_bytes // CHUNK_BYTES)


class _Placeholder(io.BytesIO):
    """An entry of the optimizer's DCP state dict that the planners fill in (never pickled). A
    BytesIO, as DCP keeps only tensors and plain values in a state dict it loads into."""

    def __init__(self, optimizer: OffloadAdamW) -> None:
        super().__init__()
        self.optimizer = optimizer

    def __reduce__(self):
        raise TypeError(f"{self!r} is a placeholder for offloaded optimizer state: {_HINT}")


class SubgroupEntry(_Placeholder):
    """Subgroup `index`'s FP32 state ([params | exp_avg | exp_avg_sq]) and its chunks' CRC32s."""

    def __init__(self, optimizer: OffloadAdamW, index: int) -> None:
        super().__init__(optimizer)
        self.index = index

    @property
    def state_bytes(self) -> int:
        return self.optimizer.store.layout.subgroups[self.index].state_bytes

    @property
    def nbytes(self) -> int:
        return self.state_bytes + trailer_bytes(self.state_bytes)

    def __repr__(self) -> str:
        return f"SubgroupEntry({self.index}, {self.nbytes} bytes)"


class MetaEntry(_Placeholder):
    """Everything of the optimizer but its subgroups (`OffloadAdamW.checkpoint_meta`)."""

    def __repr__(self) -> str:
        return "MetaEntry()"


class OffloadOptimizerState:
    """OffloadAdamW as a DCP Stateful. Its entries sit under `rank<r>` (taken when DCP asks for them):
    every rank's subgroups are its own, never deduplicated as replicated."""

    def __init__(self, optimizer: OffloadAdamW) -> None:
        if not isinstance(optimizer, OffloadAdamW):
            raise TypeError(f"OffloadOptimizerState wraps an OffloadAdamW, got {type(optimizer).__name__}")
        self.optimizer = optimizer

    @staticmethod
    def _key() -> str:
        return f"rank{dist.get_rank() if dist.is_initialized() else 0}"

    def state_dict(self) -> dict[str, Any]:
        opt = self.optimizer
        entries: dict[str, Any] = {"meta": MetaEntry(opt)}
        entries.update({f"subgroup_{sg:06d}": SubgroupEntry(opt, sg) for sg in range(len(opt.store.layout))})
        return {self._key(): entries}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        meta = state_dict[self._key()]["meta"]
        if isinstance(meta, MetaEntry):
            raise RuntimeError(f"the optimizer's subgroups were loaded but not its meta entry: {_HINT}")
        self.optimizer.load_checkpoint_meta(meta)


class _TensorBytes(io.BytesIO):
    """A BYTE_IO payload over a tensor's memory, not a copy of it. DCP's writer calls `getbuffer()`
    once and writes what it gives before it takes the next entry; the tensor is let go then. Its
    digest is taken by the planner that made it (`self_checked`)."""

    self_checked = True

    def __init__(self, data: torch.Tensor) -> None:
        super().__init__()
        self._data: torch.Tensor | None = data

    @property
    def pending(self) -> bool:
        """Not handed out yet: its memory may not be reused."""
        return self._data is not None

    def getbuffer(self) -> memoryview:
        data, self._data = self._data, None
        if data is None:
            raise RuntimeError("a subgroup's payload was already handed out")
        return memoryview(data.numpy()).cast("B")


class _ThreadBuffers:
    """One page-aligned payload buffer per DCP I/O thread, reused: a fresh one per subgroup would cost
    its page faults each time. A buffer whose last payload (`hold`) was not handed to the file yet is
    never reused: that thread gets a new one."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._local = threading.local()

    def take(self, nbytes: int) -> torch.Tensor:
        local = self._local
        held = getattr(local, "held", None)
        if getattr(local, "buffer", None) is None or (held is not None and held.pending):
            local.buffer = aligned_host_buffer(self.nbytes)
        local.held = None
        return local.buffer[:nbytes]

    def hold(self, payload: "_TensorBytes") -> "_TensorBytes":
        self._local.held = payload
        return payload


def _optimizers(entries: dict[str, Any]) -> list[OffloadAdamW]:
    seen: dict[int, OffloadAdamW] = {}
    for value in entries.values():
        if isinstance(value, _Placeholder):
            seen.setdefault(id(value.optimizer), value.optimizer)
    return list(seen.values())


class StreamingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, reading each subgroup only when its entry is written; a subgroup's
    digest (the CRC32 of its chunks' CRC32s) goes to `self_digests` for DigestingFileSystemWriter."""

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.self_digests: dict[str, int] = {}
        entries = [v for v in self.state_dict.values() if isinstance(v, SubgroupEntry)]
        self._payloads = _ThreadBuffers(max((e.nbytes for e in entries), default=0))
        for opt in _optimizers(self.state_dict):
            opt.checkpoint_meta()  # fails here, before any file is written, if a step is half done
            if opt.store.gpu_state:  # DCP's writer threads copy them on their own streams: the step must be done
                torch.cuda.synchronize()

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        if isinstance(object, SubgroupEntry):
            n = object.state_bytes
            payload = self._payloads.take(object.nbytes)
            object.optimizer.store.read(object.index, payload[:n])
            crcs = _chunk_crcs(memoryview(payload[:n].numpy()))
            trailer = bytearray(struct.pack(f"<4sI{len(crcs)}I", _MAGIC, len(crcs), *crcs))
            self.self_digests[entry_key(write_item.index)] = zlib.crc32(trailer)  # one key per entry: threads never share one
            payload[n:].copy_(torch.frombuffer(trailer, dtype=torch.uint8))
            return self._payloads.hold(_TensorBytes(payload))
        if isinstance(object, MetaEntry):
            object = object.optimizer.checkpoint_meta()
        return super().transform_object(write_item, object)


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that an object entry (anything not a tensor) is unpickled
    with `weights_only=True`: tensors and plain types load, and a crafted checkpoint cannot run code.
    (DCP's own planner unpickles them with weights_only=False.) The object is checked, then handed on
    re-serialised from what was loaded, so nothing of the file's pickle reaches the unsafe load.

    (With a manifest, every entry's bytes are checked by dcp_reader.SafeFileSystemReader before this.)"""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise self._refused(read_item, "holds more than tensors and plain values, so it is not loaded (it could run code)") from None
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)

    def _refused(self, read_item: ReadItem, problem: str, fix: str = "") -> CheckpointFileError:
        """The error for an entry that is not loaded, naming its file (relative to the part's dir), its
        offset and key."""
        info = getattr(self.metadata, "storage_data", {}).get(read_item.storage_index)
        where = f"at offset {getattr(info, 'offset', '?')} ({read_item.dest_index.fqn})"
        name = getattr(info, "relative_path", "?")
        return CheckpointFileError(name, f"{where}: {problem}", f"checkpoint file {name} {where}: {problem}{fix}")

    def _where(self, read_item: ReadItem) -> str:
        """'checkpoint file <file> at offset <o> (<key>)' of an entry, for messages."""
        info = getattr(self.metadata, "storage_data", {}).get(read_item.storage_index)
        path = getattr(info, "relative_path", "?")
        return f"checkpoint file {path} at offset {getattr(info, 'offset', '?')} ({read_item.dest_index.fqn})"


class StreamingLoadPlanner(WeightsOnlyLoadPlanner):
    """DCP's default load planner, checking each subgroup and writing it into the optimizer as it is
    read. The checkpoint must hold exactly this optimizer's subgroups at their sizes; else a
    ValueError says what differs before any rank changes anything. With `digests` (entry_key -> CRC32
    of a subgroup's chunk CRC32s, from the checkpoint's manifest), a subgroup whose CRC32s differ from
    the manifest's is refused: one from another save."""

    def __init__(self, digests: dict[str, int] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.digests = digests

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        entries = {fqn: v for fqn, v in self.state_dict.items() if isinstance(v, SubgroupEntry)}
        if metadata is not None:
            _check_subgroups(entries, metadata)
        # DCP hands each entry over, and is done with it, before reading the next: buffers are reused
        self._payloads = _ThreadBuffers(max((e.nbytes for e in entries.values()), default=0))

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        # Every rank planned without error: from here on the optimizers are being overwritten.
        for opt in _optimizers(self.state_dict):
            opt.begin_load()
        return super().finish_plan(new_plan)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        entry = self.state_dict.get(read_item.dest_index.fqn)
        if not isinstance(entry, SubgroupEntry):
            return super().load_bytes(read_item, value)
        size = value.seek(0, io.SEEK_END)
        value.seek(0)
        if size != entry.nbytes:
            raise size_mismatch(entry.index, size, entry.nbytes, where=f"{self._where(read_item)}: ")
        payload = self._payloads.take(entry.nbytes)
        value.readinto(memoryview(payload.numpy()))
        n = entry.state_bytes
        crcs = _chunk_crcs(memoryview(payload[:n].numpy()))
        magic, count = struct.unpack_from("<4sI", payload[n:].numpy())
        if magic != _MAGIC or count != len(crcs):
            problem = "its checksums are damaged"
        else:
            saved = struct.unpack_from(f"<{count}I", payload[n:].numpy(), 8)
            bad = [i for i, (a, b) in enumerate(zip(crcs, saved)) if a != b]
            problem = f"checksum mismatch in its {CHUNK_BYTES}-byte chunk at offset {bad[0] * CHUNK_BYTES}" if bad else ""
            if not bad and self.digests is not None and self.digests.get(entry_key(read_item.storage_index)) != zlib.crc32(payload[n:].numpy()):
                problem = "its checksums differ from the manifest's: it comes from another save"
        if problem:
            raise self._refused(read_item, f"subgroup {entry.index} is corrupted ({problem})",
                                ": restore the checkpoint from a good copy or resume from an older one")
        opt = entry.optimizer
        opt.store.overwrite(entry.index, payload[:n], then=opt.load_params_from_master)


def _check_subgroups(entries: dict[str, SubgroupEntry], metadata: Metadata) -> None:
    """The saved subgroups under each prefix must be exactly the expected ones, of the same sizes."""
    saved = metadata.state_dict_metadata
    sizes = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    saved_len = {index.fqn: info.length for index, info in sizes.items() if hasattr(info, "length")}
    problems = []
    for prefix in sorted({fqn.rsplit(".", 1)[0] for fqn in entries}):
        mine = {fqn for fqn in entries if fqn.rsplit(".", 1)[0] == prefix}
        theirs = {fqn for fqn in saved if fqn.startswith(prefix + ".subgroup_")}
        if mine != theirs:
            problems.append(f"{prefix}: the checkpoint has {len(theirs)} subgroups, this optimizer {len(mine)}")
            continue
        for fqn in sorted(mine):
            if fqn in saved_len and saved_len[fqn] != entries[fqn].nbytes:
                problems.append(f"{fqn}: {saved_len[fqn]} bytes saved, {entries[fqn].nbytes} expected")
                break
    if problems:
        raise ValueError(
            "the checkpoint's optimizer state does not fit this optimizer (" + "; ".join(problems) + f"): {LAYOUT_FIX}"
        )


# The writer a save with more than one thread needs (it fails the save when a writer thread failed).
CheckedFileSystemWriter = DigestingFileSystemWriter
