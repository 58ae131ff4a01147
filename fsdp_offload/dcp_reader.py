"""Reading a DCP checkpoint without running anything it holds.

DCP's FileSystemReader reads `.metadata` with a plain `pickle.load`: a crafted file runs code on load.
`SafeFileSystemReader` reads it through `MetadataUnpickler`, which builds only the classes DCP's
metadata is made of (found by pickling real metadata of torch 2.11 and 2.13: the dataclasses of
torch.distributed.checkpoint.metadata, filesystem's _StorageInfo, torch.Size, dtypes, layouts, paths)
and plain values; anything else is refused, naming the file. It also reads each data file only when
it is a regular file inside the checkpoint (never through a symlink, nor a path leading out of it),
and names the file when reading it fails. The entries themselves are loaded by the planners in
optimizer_state.py (tensors and plain values only).

    dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=WeightsOnlyLoadPlanner())
"""

from __future__ import annotations

import importlib
import os
import pickle
import stat
import struct
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from .entry_digests import crc_of_range, entry_key
from .storage import TierError

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # a layout by its name, from a fixed table
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # StorageMeta.checkpoint_id
    "pathlib._local": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}  # fmt: skip


class CheckpointFileError(ValueError):
    """A file of a checkpoint that cannot be read or is not what it should be; `path` names it."""

    def __init__(self, path: str, problem: str, message: str | None = None) -> None:
        super().__init__(message or f"{path}: {problem}")
        self.path = path
        self.problem = problem

    def __reduce__(self):  # DCP gathers a rank's error to the others by pickling it
        return (type(self), (self.path, self.problem, str(self)))


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: its own classes, torch's dtypes and plain values, nothing that could
    run code (a class outside the list is refused before anything of it is built)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # dtypes pickle as torch.<name>
        if name in _METADATA_CLASSES.get(module, ()):
            return getattr(importlib.import_module(module), name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP metadata never holds (it could run code)")


def read_dcp_metadata(path: str) -> Metadata:
    """The Metadata in the file at `path`, read through MetadataUnpickler; a CheckpointFileError that
    names the file when it is not plain DCP metadata (or not a regular file)."""
    _regular_file(path)
    try:
        with open(path, "rb", opener=_no_follow) as f:
            metadata = MetadataUnpickler(f).load()
    except CheckpointFileError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a damaged or crafted file raises, it is refused
        raise CheckpointFileError(path, f"not loaded as DCP metadata ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointFileError(path, f"holds a {type(metadata).__name__}, not DCP metadata")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not name or os.path.basename(name) != name or name in (".", ".."):
            raise CheckpointFileError(path, f"names the data file {name!r}, which is not a file of this checkpoint")
    return metadata


def reading_failed(exc: BaseException, path: str) -> bool:
    """Whether `exc` says that a file of the checkpoint under `path` could not be read or parsed (and
    not that a tier failed as subgroups went to it, nor a bug)."""
    if isinstance(exc, TierError):  # where the state goes, not the checkpoint
        return False
    if isinstance(exc, OSError):
        if exc.filename is None:
            return False
        where = os.path.abspath(path)
        return os.path.commonpath([os.path.abspath(os.fsdecode(exc.filename)), where]) == where
    # a file cut short or garbled: torch.load's zip reader (RuntimeError), pickle's end of data or a
    # refused class, a short header, DCP's size check of a tensor read back
    return isinstance(exc, (EOFError, pickle.UnpicklingError, struct.error)) or (
        isinstance(exc, RuntimeError) and "PytorchStreamReader" in str(exc)) or (
        isinstance(exc, AssertionError) and "mismatch sizes" in str(exc))  # fmt: skip


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)


def _regular_file(path: str) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise CheckpointFileError(path, "missing") from None
    if stat.S_ISLNK(mode):
        raise CheckpointFileError(path, "is a symlink; a checkpoint's files are never followed through links")
    if not stat.S_ISREG(mode):
        raise CheckpointFileError(path, "is not a regular file")


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is read through MetadataUnpickler, and whose data files are
    read only as regular files of the checkpoint, with a failure named by its file."""

    def __init__(self, path: str | os.PathLike, metadata: Metadata | None = None, digests: dict[str, int] | None = None,
                 self_checked: set[str] | frozenset[str] = frozenset()) -> None:  # fmt: skip
        """`metadata`: read already (and checked) by the caller. `digests` (entry_key -> CRC32 of the
        entry's bytes, from the manifest): each entry is checked before DCP parses it, but those in
        `self_checked` (subgroups, which the planner checks as they stream in)."""
        super().__init__(path)
        self._metadata = metadata
        self._digests = digests
        self._self_checked = self_checked

    def read_metadata(self) -> Metadata:
        # No rank argument: DCP then never falls back to per-rank metadata files (which our checkpoints
        # never have) after a refusal, and the refusal is the error the load ends with.
        metadata = self._metadata or read_dcp_metadata(os.path.join(str(self.path), ".metadata"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        done = None
        for name, items in per_file.items():
            path = os.path.join(str(self.path), name)
            _regular_file(path)
            self._check_digests(path, items)
            try:
                done = super().read_data(LoadPlan(items, plan.storage_data, plan.planner_data), planner)
            except ValueError:  # the planner's verdict on an entry, naming it (or this reader's)
                raise
            except Exception as exc:  # a file cut short or garbled is named; a tier's or a bug's error stays
                if isinstance(exc, pickle.UnpicklingError):  # torch.load(weights_only=True) refused a class
                    raise CheckpointFileError(path, "holds more than tensors where a tensor is, so it is not loaded (it could run code)") from None
                if reading_failed(exc, str(self.path)):
                    raise CheckpointFileError(path, f"cannot be read ({type(exc).__name__}: {exc})") from exc
                raise
        if done is None:
            done = super().read_data(plan, planner)
        return done

    def _check_digests(self, path: str, items: list) -> None:
        """Refuses the first entry of `items` (all in the file at `path`) whose bytes differ from the
        manifest's CRC32 or which the manifest does not name."""
        if self._digests is None:
            return
        for item in items:
            key = entry_key(item.storage_index)
            if key in self._self_checked:
                continue
            info = self.storage_data[item.storage_index]
            where = f"at offset {info.offset} ({item.storage_index.fqn})"
            expected = self._digests.get(key)
            if expected is None:
                raise CheckpointFileError(path, f"{where}: not in the checkpoint's manifest (a part of another checkpoint?)")
            try:
                crc = crc_of_range(path, info.offset, info.length)
            except (OSError, EOFError) as exc:
                raise CheckpointFileError(path, f"{where}: cannot be read ({exc})") from None
            if crc != expected:
                raise CheckpointFileError(path, f"{where}: its CRC32 differs from the manifest's (damaged, or from another save)")
