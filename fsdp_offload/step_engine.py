"""The step: grads in, the norm and scale, each subgroup updated in order, new params back to the model.

`StepEngine` runs one optimizer step in named phases, as OffloadAdamW's face calls them:
- `stage_grads`: backward's hooks hand in each FSDP unit's grads (with overlap="backward" the update starts at the
  first and takes each subgroup as soon as its grads are in);
- `begin`: grads that no hook took, the FP32 grad path's writes, the global norm and the factor every
  grad is scaled by (None: an fp16 overflow, the step skipped);
- `run`: the store walks the subgroups in the order order.py gives; each is updated by the kernel on
  the CPU (or the GPU for its GPU share), its new low-precision params copied back into the model;
- `finish`: step counts, metrics, the grads cleared.
With an FSDP2 model `run` goes on a worker thread (`UpdateInFlight`) while the next forward waits per
unit for its params. A failed step keeps what it finished; the next call finishes the rest.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter, deque
from typing import Any, Callable

import torch

from .config import OffloadConfig
from .fsdp import CopyStream, local_data
from .gpu_share import grow_gpu_share
from .grads import StepGrads
from .interrupts import interrupts_between_subgroups
from .held_grad import is_held
from .kernels import split_step_of, triton_kernel
from .kernels.contract import AdamWHyper
from .learned_rate import UpdateRateLearner, kernel_label, step_walk
from .metrics import StepMetrics, step_metrics, traced
from .optimizer_args import hyperparameters
from .order import update_order
from .overlap import UpdateInFlight
from .store import SubgroupStore
from .subgroups import SubgroupLayout, kernel_runs


class StepEngine:
    """One rank's step over its subgroups; built once by OffloadAdamW from what it wired."""

    def __init__(
        self, cfg: OffloadConfig, param_groups: list[dict[str, Any]], params: list[torch.Tensor], layout: SubgroupLayout,
        forward: list[int], store: SubgroupStore, grads: StepGrads, copies: CopyStream, kernels: tuple[Callable, Callable | None],
        inflight: UpdateInFlight | None, during_backward: bool, root, size_gpu_share: bool, rate_learner: UpdateRateLearner | None,
    ) -> None:  # fmt: skip
        self.cfg, self.param_groups, self.params, self.layout = cfg, param_groups, params, layout
        self.device = local_data(params[0]).device
        self.group_of = [gi for gi, g in enumerate(param_groups) for _ in g["params"]]
        self.forward, self.forward_rank = forward, {sg: k for k, sg in enumerate(forward)}
        self.store, self.grads, self.copies = store, grads, copies
        self.cpu_kernel, self.gpu_kernel = kernels
        self.split_kernel = split_step_of(self.cpu_kernel)
        store.lowp_of = self.model_lowp
        self.inflight, self.during_backward, self.root = inflight, during_backward, root
        self.size_gpu_share = size_gpu_share  # gpu_fraction="auto" without a plan: sized after the first step
        self.rate_learner = rate_learner  # keeps the CPU kernel's rate for the planner (with offload.bandwidth_profile)
        self.subgroups_of = [sorted({sg for sg, _ in segs}) for segs in layout.param_segments]
        # overlap="backward": per subgroup, how many of its params that take grads have yet to hand them in
        expected = Counter(sg for p, sgs in zip(params, self.subgroups_of) if p.requires_grad for sg in sgs)
        self.grads_expected = [expected[sg] for sg in range(len(layout))]
        self._grads_missing: list[int] = []
        self.grads_taken: set[int] = set()  # params whose grad this step's backward handed in (overlap="backward")
        self.steps = [0] * len(params)  # AdamW step count of each param
        self.step_count = 0  # optimizer steps taken: picks the update order
        self.pending: list[int] | None = None  # subgroups left of a step begun and not finished
        self.unwritten: set[int] = set()  # updated subgroups whose params did not reach the model yet
        self._scale = 1.0
        self._hyper: list[dict[str, float]] = []  # each group's hyperparameters, taken when the step began
        self._after_backward = None  # CUDA event after the work queued before step(): the update's copies follow it
        self._begin_s = 0.0  # time step() took before the update could start
        self._norm_s = 0.0  # time this step took to take the grad norm (metrics.norm_s)
        self._cpu_kernel_s = 0.0  # time in the CPU kernel this step (metrics.cpu_kernel_s)
        self._cpu_kernel_run = (0, 0, 0, None)  # this step's CPU kernel: params and subgroups updated, threads, grad dtype
        self._finished: StepMetrics | None = None  # the last update's metrics, before finish_update publishes them
        self.last_metrics: StepMetrics | None = None  # the last finished update's
        self.untaken: deque[StepMetrics] = deque(maxlen=1024)  # finished steps' metrics, for take_metrics()
        self.skipped_steps = 0  # fp16 steps skipped for inf/nan grads

    # -- grads in ---------------------------------------------------------------------------------

    def stage_grads(self, indices: list[int], grads: list[torch.Tensor]) -> None:
        """One grad each for params `indices` (an FSDP unit's from the hooks, or one handed in)."""
        if self.during_backward:
            self._stage_grads_during_update(indices, grads)
            return
        self.ready_for_grads()
        self.grads.stage(indices, grads)

    def stage_hooked_grads(self, indices: list[int], grads: list[torch.Tensor], fresh: list[bool]) -> None:
        """Grads from the FSDP2 hooks; `fresh[k]`: grad k found p.grad empty. Where such a param took grads
        this step, p.grad was cleared since (model.zero_grad(), p.grad = None): as torch, its earlier grads
        are dropped."""
        if not self.during_backward:
            self.ready_for_grads()  # (an update in flight clears its step's clip as it ends: before it is read here)
        self.grads.after_clip += len(indices) if self.grads.step_clip is not None else 0
        for index, first in zip(indices, fresh):
            if first and self.grads.backwards[index]:
                self.ready_for_grads()
                if self.grads.backwards[index]:  # (an update that was in flight cleared the last step's as it ended)
                    self.grads.forget(index)
        self.stage_grads(indices, grads)

    def clip(self, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
        """opt.clip_grad_norm_: the global L2 norm of this step's grads, which the step then clips to
        `max_norm` in flight."""
        if norm_type != 2.0:
            raise ValueError(f"clip_grad_norm_(norm_type={norm_type}): OffloadAdamW clips by the L2 norm (2.0) only")
        if not (max_norm > 0 and math.isfinite(max_norm)):
            raise ValueError(f"clip_grad_norm_(max_norm={max_norm}): give a positive number")
        if self.inflight is not None and self.inflight.awaiting_grads:
            raise RuntimeError(
                "clip_grad_norm_() with offload.overlap='backward': backward has already updated subgroups with "
                "unclipped grads; use offload.overlap='next_forward' to clip"
            )
        self.finish_update()
        self.stage_param_grads()
        if not any(self.grads.staged):
            raise RuntimeError("clip_grad_norm_() called before any backward: no param has a grad")
        if error_if_nonfinite and not math.isfinite(self.grads.norm()):
            raise RuntimeError(f"the total norm of the grads is {self.grads.norm()}: clip_grad_norm_(error_if_nonfinite=True)")
        norm = self.grads.clip_to(max_norm)
        return torch.tensor(norm, dtype=torch.float64, device=self.device)  # the value the step clips by

    def stage_param_grads(self) -> None:
        """Stages the `.grad` of params that no hook handed over (params without model=)."""
        grads = [None if p.grad is None or is_held(p.grad) else p.grad for p in self.params]
        self.grads.stage_param_grads(grads, self.copies)

    def ready_for_grads(self) -> None:
        """Before a backward's grads go into the staging buffer: the last update has ended (it writes
        the new params there) and did not stop part-way (its buffers are still its own)."""
        self.finish_update()
        if self.pending is not None:
            raise RuntimeError(
                f"step {self.step_count} stopped part-way ({len(self.pending)} subgroups left to update) and "
                "its buffers are still in use: call step() again to finish it before the next backward"
            )

    def _stage_grads_during_update(self, indices: list[int], grads: list[torch.Tensor]) -> None:
        """overlap="backward": the step's first grad starts its update; a subgroup whose grads are all in
        is handed to it at once."""
        if not self.inflight.awaiting_grads:
            self._start_update_in_backward()
        again = [(i, g) for i, g in zip(indices, grads) if i in self.grads_taken]
        if again:
            index, grad = again[0]
            chosen = " (what offload.overlap='auto' chose for offload.micro_batches=1)" if self.cfg.overlap == "auto" else ""
            fix = "set offload.micro_batches to the backward calls a step" if chosen else "use offload.overlap='next_forward'"
            raise RuntimeError(
                f"param {index} (shape {tuple(grad.shape)}) got a second grad before step(): with "
                f"offload.overlap='backward'{chosen} a subgroup is updated as soon as its grads are in, so grads cannot "
                f"accumulate over several backwards; {fix}, or call step() after each backward"
            )
        self.grads.stage(indices, grads)
        self.grads_taken.update(indices)
        complete = []
        for index in indices:
            for sg in self.subgroups_of[index]:
                self._grads_missing[sg] -= 1
                if self._grads_missing[sg] == 0:
                    complete.append(sg)
        if complete:
            after_copies = self.copies.record_current()  # after the grads' copies, on the current stream (FSDP2's in a hook)
            for sg in complete:
                self.inflight.grads_in(sg, after_copies)

    def _start_update_in_backward(self) -> None:
        self.ready_for_grads()
        start = time.perf_counter()
        self.store.require_loaded()
        self._maybe_grow_gpu_share()
        self._plan(1.0)  # no clipping, bf16: the factor is known before the grads
        self._grads_missing, self.grads_taken = list(self.grads_expected), set()
        self._after_backward = self.copies.mark_current()
        self.inflight.start(lambda: self.run(start), before_grads=True)

    def hand_in_last_grads(self) -> None:
        """overlap="backward": the update started during backward; the rest of the subgroups may go now.
        Hyperparameters changed since backward began are refused: the subgroups updated so far took the
        old ones, and torch would apply the new ones to this step."""
        changed = [(i, k, self._hyper[i][k], v) for i, group in enumerate(hyperparameters(self.param_groups))
                   for k, v in group.items() if v != self._hyper[i][k]]  # fmt: skip
        if changed:
            i, key, began, now = changed[0]
            raise RuntimeError(
                f"param group {i}'s {key} changed from {began} to {now} between backward and step(): with "
                "offload.overlap='backward' this step's update began at backward's first grad with the values then "
                "in effect. Set hyperparameters before backward (as a scheduler stepped after step() does), or use "
                f"offload.overlap='next_forward'; to apply this step as it began, set {key} back to {began} and call step()"
            )
        start = time.perf_counter()
        self.stage_param_grads()
        self.inflight.all_grads_in()
        self._begin_s = time.perf_counter() - start

    # -- the step ---------------------------------------------------------------------------------

    def step(self) -> None:
        """Begins the step (or the rest of a failed one) and runs its update, here or in flight."""
        self.finish_update()
        start = time.perf_counter()
        self.store.require_loaded()
        if self.pending is None:
            self._maybe_grow_gpu_share()
            if not self._begin(start):
                return  # fp16 overflow: no state was touched
        self._begin_s = time.perf_counter() - start
        if self.inflight is None:
            self.run(start)
            self._publish(0.0)
            return
        self._after_backward = self.copies.mark_current()
        everything = range(len(self.layout))  # a retry: what the failed try finished is in the model
        done = set(everything) - set(self.pending) - self.unwritten
        self.inflight.start(lambda: self.run(start), in_model=done)

    def _maybe_grow_gpu_share(self) -> None:
        if self.size_gpu_share and self.last_metrics is not None:
            self.size_gpu_share = False  # once, between the first two updates
            if grow_gpu_share(self.cfg, self.layout, self.store, self.grads.staging, self.copies, self.device):
                self.gpu_kernel = self.gpu_kernel or triton_kernel()

    @traced("fsdp_offload.step_begin")
    def _begin(self, start: float) -> bool:
        """Stages what backward left, writes the FP32 grads (that path only) and takes the grad scale;
        False when fp16 grads overflowed and the step is skipped."""
        self.stage_param_grads()  # (the face steps only where some param has a grad: torch_idioms.step_has_grads)
        # first: if it fails, the step has changed nothing yet
        self.store.record_io(self.grads.before_update(self.store.host_subgroups))
        taken = time.perf_counter()
        scale = self.grads.grad_scale()
        self._norm_s = time.perf_counter() - taken
        if scale is None:
            self.skipped_steps += 1
            self.grads.clear()
            transfers, _ = self.store.take_io()  # the FP32 grads written before the overflow was seen
            m = step_metrics(self.step_count, time.perf_counter() - start, 0, len(self.layout), 0, transfers, {})
            m.skipped, m.exposed_update_s = True, m.update_s
            m.norm_s, self._norm_s = self._norm_s, 0.0
            self._keep(m)
            return False
        self._plan(scale)
        return True

    def _plan(self, grad_scale: float) -> None:
        """The grad factor, each group's hyperparameters, and the order of the subgroups."""
        self._scale = grad_scale
        self._hyper = hyperparameters(self.param_groups)  # taken now: a scheduler may change them while the update runs
        self.pending = update_order(self.forward, self.step_count, self.cfg.update_order, self.store.resident())

    @torch.no_grad()  # grad mode is per thread: this may run on the update's own
    @traced("fsdp_offload.update")
    def run(self, start: float) -> None:
        """Updates the subgroups of `pending` and copies their params back into the model."""
        params = [local_data(p) for p in self.params]
        self._cpu_kernel_s, self._cpu_kernel_run = 0.0, (0, 0, 0, None)  # a failed try's kernels are not in this try's update_s
        updated: set[int] = set()

        def update(sg: int, state: torch.Tensor) -> None:
            if self.inflight is not None:
                self.inflight.wait_grads(sg)
            with interrupts_between_subgroups():  # the kernel writes params over the grads: no retry may see half
                self.update_subgroup(sg, state, self._scale)
                updated.add(sg)  # its state is new now: a retry must not update it again
                self.unwritten.add(sg)
            self._copy_back(sg, params)

        with self.copies.after(self._after_backward) if self.inflight is not None else contextlib.nullcontext():
            try:
                for sg in sorted(self.unwritten):  # params a failed try updated but did not copy back
                    self._copy_back(sg, params)
                if self.during_backward:
                    self._update_as_grads_arrive(update)
                left = [sg for sg in self.pending if sg not in updated]
                if not self.during_backward:  # (there grads still arrive: each subgroup's come down when it is updated)
                    self.grads.plan_cpu_updates([sg for sg in left if sg not in self.store.gpu_state], params)
                self.store.run_update(left, update)
            finally:
                # [] until _finish: every subgroup is new, the step is not closed (a retry closes it)
                self.pending = [sg for sg in self.pending if sg not in updated]
                if self.inflight is None:
                    self.params_written()
            self._finish(start)

    def _update_as_grads_arrive(self, update: Callable[[int, torch.Tensor], None]) -> None:
        """overlap="backward": the subgroups in memory, each as soon as its grads are in; of those whose
        grads are in, the one the next forward needs first (backward hands in the root unit's grads,
        which the forward needs first, last of all)."""
        resident = self.store.resident()
        left = [sg for sg in self.pending if sg in resident]
        while left:
            sg = self.inflight.next_with_grads(left, self.forward_rank.__getitem__)
            left.remove(sg)
            self.store.run_update([sg], update)

    @traced("fsdp_offload.update_subgroup")
    def update_subgroup(self, sg: int, state: torch.Tensor, grad_scale: float) -> None:
        subgroup, staging = self.layout.subgroups[sg], self.grads.staging
        split = self.store.splits(sg)  # the masters' low halves, the model's params their high halves
        p, m, v = subgroup.stored_parts(state) if split else subgroup.parts(state)
        lowp = staging.model_params_for_update(sg, [local_data(p) for p in self.params]) if split else None
        # the kernel writes the new low-precision params over the staged grads
        out = staging.view(sg) if state.is_cuda else staging.for_cpu_update(sg)
        g, transfer = self.grads.for_update(sg, out, state.is_cuda)
        if transfer is not None:
            self.store.record_io([transfer])
        kernel = self.gpu_kernel if state.is_cuda else self.split_kernel if split else self.cpu_kernel
        staged = self.grads.staged
        # each param group's at the step this update takes
        runs = kernel_runs(subgroup, lambda i: (self.group_of[i], self.steps[i] + 1) if staged[i] else None)
        began = time.perf_counter()
        for lo, hi, (group, step) in runs:
            piece, hyper = slice(lo, hi), AdamWHyper(**self._hyper[group], step=step, grad_scale=grad_scale)
            high = (lowp[piece],) if split else ()  # (the split step's model params)
            kernel(p[piece], m[piece], v[piece], g[piece], *high, out[piece], hyper)
        if not state.is_cuda:
            self._cpu_kernel_s += time.perf_counter() - began
            updated, subgroups = self._cpu_kernel_run[0] + sum(hi - lo for lo, hi, _ in runs), self._cpu_kernel_run[1] + 1
            self._cpu_kernel_run = (updated, subgroups, torch.get_num_threads(), g.dtype)  # (this worker thread's count)
            self.grads.after_update(sg)
            staging.after_cpu_update(sg, out)

    def model_lowp(self, sg: int) -> torch.Tensor:
        """Subgroup `sg`'s params, the last step's copies landed (on the caller's stream): its split masters' high halves."""
        assert not self.unwritten, "a step that stopped part-way is finished before its state is read"
        self.copies.current_waits()
        return self.grads.staging.model_params(sg, [local_data(p) for p in self.params])

    @traced("fsdp_offload.copy_back")
    def _copy_back(self, sg: int, params: list[torch.Tensor]) -> None:
        with self.copies.after_current():
            self.grads.staging.copy_params_to_model(sg, params)
        self.unwritten.discard(sg)
        if self.inflight is not None:
            self.inflight.params_ready(sg, self.copies.record())

    def params_written(self) -> None:
        """Makes the next forward wait for the params copied back so far."""
        event = self.copies.record()
        if event is None:
            return
        if self.root is not None:
            self.root.set_post_optim_event(event)
        else:
            torch.cuda.current_stream().wait_event(event)

    def _finish(self, start: float) -> None:
        transfers, hits = self.store.take_io()
        updated = sum(n for n, has in zip(self.layout.numels, self.grads.staged) if has)
        m = step_metrics(self.step_count, time.perf_counter() - start, updated, len(self.layout), hits, transfers,
                         self.store.stored_locations())  # fmt: skip
        m.subgroups_on_gpu = len(self.store.gpu_state)
        m.norm_s, self._norm_s = self._norm_s, 0.0
        m.cpu_kernel_s, self._cpu_kernel_s = self._cpu_kernel_s, 0.0
        (updated, subgroups, threads, grad_dtype), self._cpu_kernel_run = self._cpu_kernel_run, (0, 0, 0, None)
        if self.rate_learner is not None and updated:
            # (an update started in backward waits there for its grads: its walk is not a step's alone)
            self.rate_learner.observe(kernel_label(self.cpu_kernel, self.layout.split_masters), threads, grad_dtype, updated, m.cpu_kernel_s,
                                      None if self.during_backward else step_walk(m, subgroups))  # fmt: skip
        self._finished = m
        for i, has in enumerate(self.grads.staged):
            self.steps[i] += has
        self.step_count += 1
        self.grads.clear()
        self.pending = None

    # -- waiting for it, and its metrics ------------------------------------------------------------

    def finish_update(self) -> None:
        """Waits until the update of the last step has finished and its params are in the model;
        raises its error, if it had one."""
        if self.inflight is None or not self.inflight.busy:
            return
        if self.inflight.awaiting_grads:
            raise RuntimeError(
                "backward has started this step's update (offload.overlap='backward') and step() has not been "
                "called: call step() first, then save, load or read the params"
            )
        try:
            self.inflight.finish()
        finally:
            self.copies.current_waits()  # the params copied so far (all, or a failed try's), for what reads them next
            self._publish(self.inflight.waited_s)

    def _publish(self, waited_s: float) -> None:
        m, self._finished = self._finished, None
        if m is None:
            return  # the update raised before it ended
        m.exposed_update_s = m.update_s if self.inflight is None else self._begin_s + waited_s
        m.lock_wait_s = self.store.lock_waits()
        self._keep(m)
        m.log()

    def _keep(self, m: StepMetrics) -> None:
        self.last_metrics = m
        self.untaken.append(m)
