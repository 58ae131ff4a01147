"""OffloadAdamW through torch.distributed.checkpoint, one subgroup at a time.

The optimizer's state never fits in memory all at once, so its DCP state dict holds placeholders: one
per subgroup and one for the rest (step counts, hyperparameters, loss scale, learned bandwidths). The
planners below resolve a placeholder only when DCP writes or reads that entry: a save reads the
subgroup from the GPU, the host cache or its tier into a buffer that is gone once written; a load
writes each subgroup into the cache or a tier as it arrives (the tiers may be other dirs than when it
was saved). Each subgroup is one entry of raw bytes under a rank-unique key.

    state = {"model": get_model_state_dict(model), "optim": OffloadOptimizerState(optimizer)}
    dcp.save(state, checkpoint_id=path, planner=StreamingSavePlanner())
    dcp.load(state, checkpoint_id=path, planner=StreamingLoadPlanner())
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem, WriteItem

from .optimizer import OffloadAdamW

_PLANNER_HINT = "save and load OffloadOptimizerState with planner=StreamingSavePlanner() / StreamingLoadPlanner()"


class _Placeholder(io.BytesIO):
    """An entry of the optimizer's DCP state dict that the planners fill in (never pickled). A
    BytesIO, as DCP keeps only tensors and plain values in a state dict it loads into."""

    def __init__(self, optimizer: OffloadAdamW) -> None:
        super().__init__()
        self.optimizer = optimizer

    def __reduce__(self):
        raise TypeError(f"{self!r} is a placeholder for offloaded optimizer state: {_PLANNER_HINT}")


class SubgroupEntry(_Placeholder):
    """Subgroup `index`'s FP32 state: [params | exp_avg | exp_avg_sq] as raw bytes."""

    def __init__(self, optimizer: OffloadAdamW, index: int) -> None:
        super().__init__(optimizer)
        self.index = index

    @property
    def nbytes(self) -> int:
        return self.optimizer.layout.subgroups[self.index].state_bytes

    def __repr__(self) -> str:
        return f"SubgroupEntry({self.index}, {self.nbytes} bytes)"


class MetaEntry(_Placeholder):
    """Everything of the optimizer but its subgroups (`OffloadAdamW.checkpoint_meta`)."""

    def __repr__(self) -> str:
        return "MetaEntry()"


class OffloadOptimizerState:
    """OffloadAdamW as a DCP Stateful. Its entries sit under `key` (default `rank<r>`): every rank's
    subgroups are its own, never deduplicated as replicated."""

    def __init__(self, optimizer: OffloadAdamW, key: str | None = None) -> None:
        if not isinstance(optimizer, OffloadAdamW):
            raise TypeError(f"OffloadOptimizerState wraps an OffloadAdamW, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.key = key or f"rank{dist.get_rank() if dist.is_initialized() else 0}"

    def state_dict(self) -> dict[str, Any]:
        opt = self.optimizer
        entries: dict[str, Any] = {"meta": MetaEntry(opt)}
        entries.update({f"subgroup_{sg:06d}": SubgroupEntry(opt, sg) for sg in range(len(opt.layout))})
        return {self.key: entries}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        meta = state_dict[self.key]["meta"]
        if isinstance(meta, MetaEntry):
            raise RuntimeError(f"the optimizer's subgroups were loaded but not its meta entry: {_PLANNER_HINT}")
        self.optimizer.load_checkpoint_meta(meta)


class _TensorBytes(io.BytesIO):
    """A BYTE_IO payload over a tensor's memory, not a copy of it (DCP writes `getbuffer()`)."""

    def __init__(self, data: torch.Tensor) -> None:
        super().__init__()
        self._data = data

    def getbuffer(self) -> memoryview:
        return memoryview(self._data.numpy()).cast("B")


def _optimizers(entries: dict[str, Any]) -> list[OffloadAdamW]:
    seen: dict[int, OffloadAdamW] = {}
    for value in entries.values():
        if isinstance(value, _Placeholder):
            seen.setdefault(id(value.optimizer), value.optimizer)
    return list(seen.values())


class StreamingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, reading each subgroup only when its entry is written."""

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        for opt in _optimizers(self.state_dict):
            opt.checkpoint_meta()  # fails here, before any file is written, if a step is half done

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        if isinstance(object, SubgroupEntry):
            return _TensorBytes(object.optimizer.read_subgroup(object.index))
        if isinstance(object, MetaEntry):
            object = object.optimizer.checkpoint_meta()
        return super().transform_object(write_item, object)


class StreamingLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, writing each subgroup into the optimizer as it is read.

    Before anything is read, the checkpoint must hold exactly this optimizer's subgroups at their
    sizes; else a ValueError says what differs and nothing is changed."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        entries = {fqn: v for fqn, v in self.state_dict.items() if isinstance(v, SubgroupEntry)}
        if metadata is not None:
            _check_subgroups(entries, metadata)
        for opt in _optimizers(self.state_dict):
            opt._begin_load()

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        entry = self.state_dict.get(read_item.dest_index.fqn)
        if not isinstance(entry, SubgroupEntry):
            return super().load_bytes(read_item, value)
        with value.getbuffer() as view:
            data = torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)
            entry.optimizer.write_subgroup(entry.index, data)
            del data


def _check_subgroups(entries: dict[str, SubgroupEntry], metadata: Metadata) -> None:
    """The saved subgroups under each prefix must be exactly the expected ones, of the same sizes."""
    saved = metadata.state_dict_metadata
    sizes = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    saved_len = {index.fqn: info.length for index, info in sizes.items() if hasattr(info, "length")}
    prefixes = {fqn.rsplit(".", 1)[0] for fqn in entries}
    problems = []
    for prefix in sorted(prefixes):
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
            "the checkpoint's optimizer state does not fit this optimizer (" + "; ".join(problems) + "): "
            "resume with the same model, world size and offload.subgroup_numel"
        )
