"""SubgroupStore: the one owner of where each subgroup's FP32 state lives.

A subgroup's state ([params | exp_avg | exp_avg_sq], see subgroups.py) lives at one of three levels:
- GPU memory: the last `gpu_fraction` of the subgroups stay there and are updated there;
- the host cache: slots under the host budget (cache.py);
- a tier: one file per rank on each storage path, the tier picked by the placement (placement.py).
Off the GPU, where the layout splits masters (bf16 params), a subgroup is held split: the masters' low
halves, their high halves being the model's params (`lowp_of`, which the step engine gives); every pass
but the update sees it FP32, joined and split here.
levels.py builds the cache, the placement and the tiers from the memory plan and hands them over;
the store owns them from then on, walks subgroups through them for a pass (`run_update` for a step,
`visit` for a fill or a save; the pipeline does the moving), reads and overwrites one subgroup at a
time for checkpoints, and knows when a load has left the state half written.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.distributed as dist

from .cache import HostCache, aligned_host_buffer
from .closing import close_in_reverse
from .kernels.split_masters import join_masters, split_masters
from .pipeline import Placement, SubgroupPipeline
from .storage import Tier, Transfer
from .storage.base import ALIGN
from .storage.chunked import tier_file_tag
from .subgroups import SubgroupLayout
from .units import format_bytes

Visit = Callable[[int, torch.Tensor], None]
STATE_KEYS = ("master_param", "exp_avg", "exp_avg_sq")  # the parts of a subgroup's state, in order
log = logging.getLogger(__name__)
LAYOUT_FIX = "resume with the same model, world size and offload.subgroup_numel"


def size_mismatch(sg: int, got: int, want: int, where: str = "") -> ValueError:
    """The error for a saved subgroup of the wrong size."""
    return ValueError(
        f"{where}subgroup {sg} holds {got} bytes, {want} expected: the checkpoint is truncated, or was written "
        "for another model, world size or offload.subgroup_numel"
    )


class SubgroupStore:
    """Every subgroup's FP32 state, at the GPU, host-cache or tier level.

    `gpu_subgroups` (the last ones) live in GPU memory on `device`; the others in `cache` and, beyond
    its slots, on the `tiers` that `placement` picks. `extra_slot_bytes` are slots a tier file keeps
    after the subgroups' (the FP32 grad path's); `prefetch` is how many subgroups a pass reads ahead.
    """

    def __init__(
        self, layout: SubgroupLayout, gpu_subgroups: frozenset[int], device: torch.device, cache: HostCache,
        placement: Placement, tiers: list[Tier], extra_slot_bytes: list[int], prefetch: int,
    ) -> None:  # fmt: skip
        # What close() releases, in reverse; a build that fails part-way releases it at once (tier files too).
        # No finalizer of its own: the optimizer owning it closes it, whose finalizer waits for the update in
        # flight first (closing.py), where the store's could have fired first and freed the cache under it.
        self._owned: list | None = [cache, placement, *tiers]
        try:
            self.layout, self.cache, self.placement, self.tiers = layout, cache, placement, tiers
            self.host_subgroups = [sg for sg in range(len(layout)) if sg not in gpu_subgroups]
            # GPU-resident subgroups are the last ones: the placement and the tiers plan for the ones before them
            assert self.host_subgroups == list(range(len(self.host_subgroups)))
            self.gpu_state = {
                sg: torch.zeros(layout.subgroups[sg].state_bytes, dtype=torch.uint8, device=device) for sg in sorted(gpu_subgroups)
            }
            self.pipeline = SubgroupPipeline(layout, cache, tiers, placement, prefetch)
            tag = tier_file_tag(f"rank{dist.get_rank() if dist.is_initialized() else 0}")
            for t in tiers:
                t.attach(tag, [sg.stored_bytes for sg in layout.subgroups] + list(extra_slot_bytes))
        except BaseException:
            self.close()
            raise
        self._loading = False  # a load has begun overwriting subgroups and not finished
        self._lock_wait_seen: dict[str, float] = {}
        # subgroup -> its bf16 params as the model holds them (host, padded): the split masters' high halves
        self.lowp_of: Callable[[int], torch.Tensor] | None = None

    # -- split masters ---------------------------------------------------------------------------------

    def splits(self, sg: int) -> bool:
        """Whether subgroup `sg` is held split now (off the GPU, where the layout splits masters)."""
        return self.layout.subgroups[sg].split and sg not in self.gpu_state

    def _fp32_buffer(self) -> torch.Tensor:
        """A host buffer to join split subgroups into, for one pass (outside the host budget, as a
        checkpoint's writer buffers are: held while a fill, a gather or a load runs)."""
        return aligned_host_buffer(max(s.state_bytes for s in self.layout.subgroups))

    def _lowp(self, sg: int) -> torch.Tensor:
        if self.lowp_of is None:
            raise RuntimeError("split masters are read before the optimizer gave the store its model's params")
        return self.lowp_of(sg)

    def join(self, sg: int, stored: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Subgroup `sg`'s FP32 state in `out`, from `stored` as a host slot holds it; returns `out`."""
        subgroup = self.layout.subgroups[sg]
        if not self.splits(sg):
            return out.copy_(stored)
        low, m, v = subgroup.stored_parts(stored)
        master, m_out, v_out = subgroup.parts(out)
        m_out.copy_(m)
        v_out.copy_(v)
        join_masters(low, self._lowp(sg), v_out, master)
        return out

    def split(self, sg: int, state: torch.Tensor, stored: torch.Tensor) -> None:
        """Writes subgroup `sg`'s FP32 `state` into `stored` as a host slot holds it."""
        subgroup = self.layout.subgroups[sg]
        if not self.splits(sg):
            stored.copy_(state)
            return
        master, m, v = subgroup.parts(state)
        if bool((v < 0).any()):  # its sign bit carries a master's rounding: a negative one cannot be kept
            raise ValueError(f"subgroup {sg}'s exp_avg_sq holds negative values (a mean of squares never is): the "
                             "optimizer state given is corrupt")  # fmt: skip
        low, m_out, v_out = subgroup.stored_parts(stored)
        m_out.copy_(m)
        v_out.copy_(v)
        split_masters(master, low, v_out)

    # -- passes over subgroups ----------------------------------------------------------------------

    def run_update(self, order: list[int], update: Visit) -> None:
        """Calls `update(sg, state)` on every subgroup of `order`: GPU-resident ones first (no I/O), then
        the others through the host cache and tiers. Its I/O counts towards the step (`take_io`)."""
        self.require_loaded()
        for sg in order:
            if sg in self.gpu_state:
                update(sg, self.gpu_state[sg])
        self.pipeline.run([sg for sg in order if sg not in self.gpu_state], update)

    def visit(self, order: list[int], visit: Visit, *, load: bool = True, dirty: bool = True, in_order: bool = False) -> None:
        """Like `run_update`, for a pass that is not a step (a fill or a gather): its I/O is not counted, and
        `visit` sees FP32 states (a split one joined before, and split again after if it may have changed).
        `load=False`: the visit overwrites whole states; `dirty=False`: it only reads them; `in_order`: no
        subgroup of the prefetch window goes before its turn (see SubgroupPipeline.run). The GPU-resident
        subgroups (the last ones) come after the others, so an ascending `order` stays ascending."""

        scratch: list[torch.Tensor] = []  # made at the first split subgroup, freed with the pass

        def fp32(sg: int, stored: torch.Tensor) -> None:
            if not self.splits(sg):
                return visit(sg, stored)
            scratch[:] = scratch or [self._fp32_buffer()]
            state = scratch[0][: self.layout.subgroups[sg].state_bytes]
            if load:
                self.join(sg, stored, state)
            visit(sg, state)
            if dirty:
                self.split(sg, state, stored)

        try:
            self.pipeline.run([sg for sg in order if sg not in self.gpu_state], fp32, load=load, dirty=dirty, in_order=in_order)
        finally:
            self.pipeline.take_transfers()
        for sg in order:
            if sg in self.gpu_state:
                visit(sg, self.gpu_state[sg])

    def fill(self, order: list[int], sources: dict[str, Callable[[int], torch.Tensor]], then: Visit | None = None) -> None:
        """Overwrites every subgroup, strictly in `order` (a streamed source gives its tensors in order),
        from flat per-param FP32 tensors: `sources[key](param)` for each key of STATE_KEYS it has (a
        missing key: zeros); then calls `then(sg, masters)`."""

        def fill(sg: int, state: torch.Tensor) -> None:
            state.zero_()
            parts = self.layout.subgroups[sg].parts(state)
            for seg in self.layout.subgroups[sg].segments:
                for key, part in zip(STATE_KEYS, parts):
                    if key in sources:
                        part[seg.in_subgroup].copy_(sources[key](seg.param)[seg.in_param])
            if then is not None:
                then(sg, parts[0])

        self.visit(order, fill, load=False, in_order=True)

    def gather(self, order: list[int], out: list[dict[str, torch.Tensor]]) -> None:
        """Copies every subgroup's state, in `order`, into per-param FP32 tensors `out[param][key]` (the
        keys of STATE_KEYS that `out[param]` has)."""

        def gather(sg: int, state: torch.Tensor) -> None:
            parts = self.layout.subgroups[sg].parts(state)
            for seg in self.layout.subgroups[sg].segments:
                for key, part in zip(STATE_KEYS, parts):
                    if key in out[seg.param]:
                        out[seg.param][key].view(-1)[seg.in_param].copy_(part[seg.in_subgroup])

        self.require_loaded()
        self.visit(order, gather, dirty=False)

    def _bounce_buffer(self, copied: dict[int, torch.Tensor]) -> tuple[torch.Tensor, int | None]:
        """A host slot to read stored subgroups through, and the cached subgroup whose slot it is (None:
        a free slot, or a buffer of its own when no slot is free and nothing cached has been copied)."""
        free = self.cache.take_free()
        if free is not None:
            self.cache.give_back(free)  # stays free: only read through, before anything else takes it
            return self.cache.slots[free], None
        lender = next(iter(copied), None)
        if lender is None:
            return aligned_host_buffer(self.layout.slot_bytes), None
        return self.cache.slots[self.cache.slot_of[lender]], lender

    def move_to_gpu(self, count: int, device: torch.device) -> list[int]:
        """Moves the last `count` subgroups kept off the GPU into GPU memory, between steps (the state is
        copied from the host cache, or read from its tier through one host slot), and frees their cache
        slots for the others. All or nothing: if a copy or a read fails, nothing has moved."""
        chosen = self.host_subgroups[len(self.host_subgroups) - count :]
        copies: dict[int, torch.Tensor] = {}
        # host buffer for the stored ones: a free slot, else the slot of a cached one already copied
        # (restored from its copy if the move fails), else one of its own
        bounce, lent_by = None, None
        scratch = None  # split ones are joined into one FP32 buffer, made at the first
        try:
            for sg in sorted(chosen, key=lambda sg: not self.cache.is_resident(sg)):  # cached ones first
                held = self.pipeline.resident_state(sg)
                if held is None:
                    if bounce is None:
                        bounce, lent_by = self._bounce_buffer(copies)
                    held = bounce[: self.layout.subgroups[sg].stored_bytes]
                    self.pipeline.read_stored(sg, held)
                if self.splits(sg):
                    scratch = self._fp32_buffer() if scratch is None else scratch
                    held = self.join(sg, held, scratch[: self.layout.subgroups[sg].state_bytes])
                copies[sg] = held.to(device)  # from pageable memory: done when it returns
        except BaseException:
            if lent_by is not None:
                self.split(lent_by, copies[lent_by].cpu(), self.pipeline.resident_state(lent_by))
            raise
        for sg, state in copies.items():
            self.gpu_state[sg] = state
            self.pipeline.forget(sg)
        del self.host_subgroups[len(self.host_subgroups) - count :]  # the subgroups off the GPU stay 0..n-1
        try:
            released = self.cache.release_spare(len(self.host_subgroups))
        except OSError as exc:  # an economy only: the slots stay allocated, training goes on
            log.warning("%s; the host cache keeps %d slots for %d subgroups", exc, self.cache.num_slots, len(self.host_subgroups))
        else:
            if released:
                log.info("gave %s of host cache back to the OS: %d subgroups stay off the GPU, %d slots hold them",
                         format_bytes(released), len(self.host_subgroups), self.cache.num_slots)  # fmt: skip
        return chosen

    def placement_summary(self) -> dict:
        """Where the subgroups live now: on the GPU, in host cache slots, and by tier (the one each would
        be written to), as the planner predicts it."""
        streams = self.cache.num_slots < len(self.host_subgroups)  # else no subgroup reaches a tier
        tiers = [self.placement.tier_for(sg) for sg in self.host_subgroups] if streams else []
        return {"subgroups": len(self.layout), "gpu_subgroups": len(self.gpu_state), "cache_slots": self.cache.num_slots,
                "tier_subgroups": {t.name: tiers.count(i) for i, t in enumerate(self.tiers)}}  # fmt: skip

    def resident(self) -> set[int]:
        """The subgroups held in memory (GPU or host cache) now: a step finds them without I/O."""
        return set(self.gpu_state) | set(self.cache.slot_of)

    def take_io(self) -> tuple[list[Transfer], int]:
        """The transfers and cache hits since the last call."""
        return self.pipeline.take_transfers()

    def record_io(self, transfers: list[Transfer]) -> None:
        """Counts transfers made beside the pipeline (the FP32 grad path's) towards the step."""
        self.pipeline.transfers.extend(transfers)

    def stored_locations(self) -> dict[int, str]:
        """Tier name of each subgroup that lives only on a tier now."""
        return {sg: self.tiers[t].name for sg, t in self.pipeline.location.items() if not self.cache.is_resident(sg)}

    def lock_waits(self) -> dict[str, float]:
        """Seconds spent waiting for each locked tier's node lock since the last call."""
        out = {}
        for t in self.tiers:
            total = t.lock_wait_s
            if total is not None:
                out[t.name] = total - self._lock_wait_seen.get(t.name, 0.0)
                self._lock_wait_seen[t.name] = total
        return out

    # -- one subgroup at a time (checkpoints) -------------------------------------------------------

    def read(self, sg: int, out: torch.Tensor) -> None:
        """Copies subgroup `sg`'s FP32 state into `out`, a page-aligned host buffer of its size, from the
        GPU, the host cache or its tier. The cache is left as it is: the next step finds what it would have."""
        self.require_loaded()
        held = self.gpu_state.get(sg)
        if held is None:
            held = self.pipeline.resident_state(sg)
        if held is not None:
            self.join(sg, held, out)
        elif self.splits(sg):  # into `out` itself (DCP's writer threads read at once), its moments where FP32 has them
            subgroup = self.layout.subgroups[sg]
            stored = out[subgroup.state_bytes - subgroup.stored_bytes :]  # (page-aligned: 4n less the low halves' 4 KiB pages)
            self.pipeline.read_stored(sg, stored)
            low = subgroup.stored_parts(stored)[0].clone()  # the masters are joined over it
            master, _, v = subgroup.parts(out)
            join_masters(low, self._lowp(sg), v, master)
        else:
            self.pipeline.read_stored(sg, out)

    def overwrite(self, sg: int, state: torch.Tensor, then: Visit) -> None:
        """Replaces subgroup `sg`'s state with `state` (host bytes laid out as `read` gives them), then
        calls `then(sg, masters)` (the model's params follow). Only between `begin_load` and `end_load`."""
        if not self._loading:
            raise RuntimeError("a subgroup is overwritten only during a load: use OffloadOptimizerState with dcp.load")
        want = self.layout.subgroups[sg].state_bytes
        if state.dtype != torch.uint8 or state.numel() != want:
            raise size_mismatch(sg, state.numel() * state.element_size(), want)
        dest = self.gpu_state.get(sg)
        if dest is None:
            dest = self.pipeline.resident_state(sg)
            if dest is not None:
                self.cache.mark_dirty(sg)  # newer than its stored copy now
        if dest is not None:
            self.split(sg, state.to(dest.device), dest)
        else:
            dest = state
            if self.splits(sg) or state.is_cuda or state.data_ptr() % ALIGN:  # O_DIRECT wants page-aligned host memory
                dest = aligned_host_buffer(self.layout.subgroups[sg].stored_bytes)
                self.split(sg, state.cpu(), dest)
            self.pipeline.store(sg, dest)
        then(sg, self.layout.subgroups[sg].parts(state)[0])

    # -- loads ----------------------------------------------------------------------------------------

    def begin_load(self) -> None:
        """From here until `end_load`, subgroups are a mix of old and new: passes and reads refuse."""
        self._loading = True

    def end_load(self) -> None:
        self._loading = False

    @property
    def loading(self) -> bool:
        """Between `begin_load` and `end_load` (a load in progress, or one that failed part-way)."""
        return self._loading

    def require_loaded(self) -> None:
        if self._loading:
            raise RuntimeError(
                "loading optimizer state failed part-way, so its subgroups are a mix of old and new; load a "
                "state again (load_state_dict or a checkpoint) before using it"
            )

    def layout_signature(self) -> dict:
        return {"numels": list(self.layout.numels), "subgroup_numel": self.layout.subgroup_numel}

    def check_layout(self, saved: dict) -> None:
        """Raises when a checkpoint's subgroups were cut from other params than this store's."""
        mine = self.layout_signature()
        if saved != mine:
            raise ValueError(
                f"the checkpoint's optimizer state was laid out for {len(saved['numels'])} local params of "
                f"{sum(saved['numels'])} elements in subgroups of {saved['subgroup_numel']}, this rank has "
                f"{len(mine['numels'])} params of {sum(mine['numels'])} elements in subgroups of "
                f"{mine['subgroup_numel']}: {LAYOUT_FIX}"
            )

    def close(self) -> None:
        """Deletes this rank's tier files and saves what the placement learned (once)."""
        owned, self._owned = self._owned, None
        if owned is not None:
            close_in_reverse(owned)
