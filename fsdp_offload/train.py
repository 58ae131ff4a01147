"""Train a LLaMA-style model with FSDP2 and the out-of-core OffloadAdamW (Hydra recipes in
fsdp_offload/recipes/). The same job three ways: the console command, the script, and `run(cfg)`.

    fsdp-offload-train                                        # tiny model (CPU, or a visible GPU), state in a temp dir
    torchrun --nproc-per-node 8 scripts/train.py model=13b offload=multipath train.steps=1000
    python scripts/train.py offload=none                      # plain FSDP2 + torch AdamW, to compare
    run(compose("train", overrides=[...]))                    # from Python (a notebook, a test)

Every rank logs per-step metrics as JSONL (rank 0 also to the console, with a progress bar) and
checkpoints are saved and resumed through fsdp_offload.checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from datetime import datetime, timezone

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.distributed.fsdp import MixedPrecisionPolicy
from tqdm import tqdm

from .checkpoint import (
    check_checkpoint, hold_run_dirs, load_checkpoint, release_run_dirs, resume_point, save_checkpoint,
)  # fmt: skip
from .config import register_recipe_resolvers
from .data import TokenBatches
from .job_errors import (JobError, a_collective_timed_out, a_peer_stopped, error_line, note_sigterm, printed_by_another_rank,
                         raise_on_every_rank, wait_for_rank0_to_say_it)
from .models import compile_blocks, num_params, preset_name
from .models.llama import STEP_CHOICES
from .node import node_peers, node_ranks
from .optimizer import OffloadAdamW
from .memory import node_host_bytes, resolve_host_budget, stated_host_problem
from .parallelize import build_fsdp_model, build_offloaded_model
from .machine import MachineConfig
from .node_plan import make_plan, optimizer_config
from .command_errors import refuse_bad_overrides
from .plan import plan_summary, split_rate_words
from .resume_config import follow_config, train_hyper
from .recipe import read_config
from .run_setup import check_writable_dir, init_distributed, lr_lambda, rng_state, run_dir, set_rng_state
from .run_rows import (
    add_scalars, add_update_metrics, drop_rows_from, host_peak_gib, process_now, rows_file, start_fresh, tensorboard_writer,
)  # fmt: skip
from .step_memory import describe, fsdp_step_bytes, fsdp_step_memory, plan_step_memory, same_on_every_rank, step_overflow
from .storage import TierError
from .storage.chunked import tier_root_problem
from .storage.private_files import remove_dead_files
from .storage.lock import lock_root_problem
from .train_step import profiled, run_step
from .threads import cpu_threads_per_rank, use_cpu_threads
from .watchdog import start_watchdog, stop_watchdog
from .tier_speeds import starting_speeds
from .units import GIB, format_count, format_seconds
from .bandwidth_profile import profile_problem
from .learned_rate import learned_rate_for
from .update_costs import learned_walk

log = logging.getLogger("train")  # Hydra sends it to the console and the run dir's train.log

def run(cfg: DictConfig) -> list[dict]:
    """Trains as the composed config `cfg` says; returns this rank's per-step rows. Callable again
    in the same process: a process group it started is destroyed when it returns or raises (one that
    was there before is the caller's, and stays)."""
    owned = not dist.is_initialized()
    try:
        return _run(cfg)
    finally:
        release_run_dirs()
        stop_watchdog()
        if owned and dist.is_initialized():
            dist.destroy_process_group()


def _run(cfg: DictConfig) -> list[dict]:
    tcfg, margs, dcfg, recipe, ckcfg = read_config(cfg)
    for option, path in (("train.out_dir", tcfg.out_dir), ("checkpoint.dir", ckcfg.dir)):
        if path is not None:
            check_writable_dir(path, option)

    device = init_distributed(tcfg.device, tcfg.collective_timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD if world > 1 else None
    local = node_ranks(group)  # by host name: srun and mp.spawn set no LOCAL_WORLD_SIZE
    use_cpu_threads(cpu_threads_per_rank(tcfg.cpu_threads, local))
    # Bad data fails here, before the model is built (missing file, wrong dtype, too short, ids >= vocab).
    batches = TokenBatches(dcfg, vocab_size=margs.vocab_size, rank=rank, world_size=world)
    # what a checkpoint must agree with to be resumed (check_checkpoint leaves out what changes the compute only)
    run_key = {"model": dataclasses.asdict(margs), "world_size": world, "optimizer": recipe.optimizer,
               "subgroup_numel": recipe.config.subgroup_numel}  # fmt: skip
    # which checkpoint first: a resume that cannot be honoured is refused before the dir (and its lock) is made
    resume_from, resume_line = resume_point(ckcfg)
    out_dir = run_dir(tcfg.out_dir)
    hold_run_dirs({"checkpoint.dir": ckcfg.dir, "train.out_dir": out_dir})  # one run writes each at a time
    start_watchdog(tcfg.watchdog_s)
    if resume_from:
        first_step = check_checkpoint(resume_from, run_key)
        if tcfg.profile_step is not None and tcfg.profile_step < first_step:
            fix = f"profile one of steps {first_step} to {tcfg.steps - 1}" if first_step < tcfg.steps else f"raise train.steps past {first_step}"
            raise JobError(f"train.profile_step={tcfg.profile_step} is not a step of this run: it resumes from {resume_from} "
                           f"at step {first_step}; {fix}")  # fmt: skip
        if first_step >= tcfg.steps:  # said before a model is built for nothing
            if rank == 0:
                log.info(f"{resume_line}: nothing to run, the checkpoint is at step {first_step}, train.steps={tcfg.steps} "
                         "(raise train.steps to train on)")  # fmt: skip
            return []

    t_build = time.perf_counter()
    agree = lambda choice: same_on_every_rank(choice, group, device)  # noqa: E731  (else the frugal step for all)
    if recipe.optimizer == "offload":
        # A tier dir, the tier lock dir or the bandwidth profile unusable on any rank's node ends the job first, said once.
        ocfg = recipe.config
        problems = [tier_root_problem(spec.dir, str(spec)) for spec in ocfg.tier_specs]
        if ocfg.tier_specs and ocfg.tier_access != "shared":  # the node's tier locks live there
            problems.append(lock_root_problem(ocfg.tier_lock_dir))
        problems += [profile_problem(ocfg.bandwidth_profile), stated_host_problem(tcfg.host_memory_bytes)]
        raise_on_every_rank(next((p for p in problems if p), None), group)
        for spec in ocfg.tier_specs:  # before the plan counts their free space
            remove_dead_files(spec.dir, str(spec))
        # Whether the state fits (GPU, host, each tier's free space) is checked before anything is built.
        # The host budget is sized once, now, for the plan and the optimizer alike: what this process
        # takes from here on (the CUDA context, the model's build) is the headroom's share.
        budget = resolve_host_budget(recipe.config, group, device, tcfg.host_memory_bytes)
        if rank == 0 and recipe.config.host_budget.auto:
            log.info("%s", budget[1])
        speeds = starting_speeds(recipe.config, group=group).speeds  # once a node
        # this node's ranks, each planned for its own shard of the job's (another node's may be smaller)
        node = node_peers(group) if group is not None else [0]
        machine = MachineConfig(ranks_per_node=local, nodes=max(1, world // local),
                                host_gib=None if tcfg.host_memory_bytes is None else tcfg.host_memory_bytes / GIB)  # fmt: skip
        planned = lambda args, rate=None, split=None: make_plan(  # noqa: E731
            preset_name(args), args, recipe.config, machine, dcfg.seq_len, dcfg.micro_batch, device.type,
            None if rate is None else rate.params_per_s, speeds, host_budget=budget, costs=None if rate is None else learned_walk(rate),
            node_ranks=node, world_size=world, split_cpu_rate=None if split is None else split.params_per_s)  # fmt: skip
        # a plan short on one node alone (its free space, its memory) is said once, by every rank
        settle = lambda short: raise_on_every_rank(None if short is None else str(short), group)  # noqa: E731
        plan, margs = plan_step_memory(margs, planned, recipe.config.gpu_headroom_gb, agree, settle, tcfg.micro_batches)
        # the optimizer's config as planned: one grad a step where FSDP2 sums the micro-batches unsharded
        recipe = dataclasses.replace(recipe, config=optimizer_config(recipe.config, margs))
        # the update is predicted where an earlier run here saved the CPU rate of this kernel on these grads (bf16,
        # or FP32 sums), with its steps' walk (nothing timed here: it would slow the start)
        learned, learned_split = (learned_rate_for(recipe.config, local, cpu_threads_per_rank(tcfg.cpu_threads, local), split)
                                  for split in (False, True))  # fmt: skip
        if learned is not None or learned_split is not None:
            plan = dataclasses.replace(planned(margs, learned, learned_split), step_memory_why=plan.step_memory_why)
        mine, step_memory_why = plan.ranks[node.index(rank)], plan.step_memory_why
        if rank == 0:
            log.info("plan: %s", plan_summary(mine, recipe.config))
            if step_overflow(plan):
                log.warning("plan: %s", step_overflow(plan))
            if plan.predicted_update_s is not None:
                log.info("plan: update %s a step predicted, from the CPU rate an earlier run saved (%s)%s%s",
                         format_seconds(plan.predicted_update_s), "; ".join(r.detail for r in (learned, learned_split) if r),
                         split_rate_words(plan),
                         (" and its steps' walk a subgroup; the grad norm and tier transfers not counted" if plan.update_costs else
                          "; the update's fixed costs not counted") + " (the plan command times them)")  # fmt: skip
        # The plan's choices, made with the step's activations in view, are what the optimizer builds (its
        # memory plan: the budget, where the grad sums live, the GPU share placed now so the first steps
        # run at speed), from the plan's tier speeds (the profile, if set, keeps what the run learns);
        # the FP32 init goes to it one module at a time (none at all when a checkpoint follows).
        model, optimizer = build_offloaded_model(margs, device, seed=tcfg.seed, init=not resume_from, lr=tcfg.lr,
                                                 betas=tuple(tcfg.betas), weight_decay=tcfg.weight_decay, offload=recipe.config,
                                                 tier_speeds=speeds, memory_plan=mine.memory_plan(recipe.config))  # fmt: skip
    else:
        # (on the CPU the node's ranks share its host memory: stated, or available now)
        if device.type == "cpu":
            raise_on_every_rank(stated_host_problem(tcfg.host_memory_bytes), group)
        room = (torch.cuda.mem_get_info(device)[1] - int(recipe.config.gpu_headroom_gb * GIB) if device.type == "cuda"
                else node_host_bytes(tcfg.host_memory_bytes) // local)  # fmt: skip
        margs, step_memory_why = fsdp_step_memory(margs, lambda args: fsdp_step_bytes(args, world, dcfg.seq_len, dcfg.micro_batch),
                                                      room, agree, tcfg.micro_batches)  # fmt: skip
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = build_fsdp_model(margs, device, seed=tcfg.seed, mp_policy=mp)
        optimizer = torch.optim.AdamW(model.parameters(), lr=tcfg.lr, betas=tuple(tcfg.betas), weight_decay=tcfg.weight_decay,
                                      fused=device.type == "cuda")  # fmt: skip
    if tcfg.compile:
        compile_blocks(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(tcfg))
    startup = {"startup_s": time.perf_counter() - t_build, "host_peak_startup_gib": host_peak_gib()}
    if device.type == "cuda":  # the steps' rows then report the training peak alone
        startup["gpu_peak_startup_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()

    start_step, hyper = 0, train_hyper(tcfg, dcfg.micro_batch, recipe.config.max_grad_norm)
    if resume_from:
        t0 = time.perf_counter()
        rank_state = load_checkpoint(resume_from, model, optimizer)
        if rank == 0:
            log.info("resumed from %s in %.1f s", resume_from, time.perf_counter() - t0)
        try:
            batches.load_state_dict(rank_state["data"])
        except JobError as exc:  # (said by the data, which does not know which checkpoint)
            raise JobError(f"checkpoint {resume_from}: {exc}") from None
        base_lrs = list(scheduler.base_lrs)  # this run's, before the checkpoint's replace them
        scheduler.load_state_dict(rank_state["scheduler"])
        follow_config(optimizer, scheduler, base_lrs, tcfg, hyper, rank_state.get("hyper"), rank)
        set_rng_state(rank_state["rng"])
        start_step = rank_state["step"]
        raise_on_every_rank(None if start_step == first_step else  # (both digested by the manifest: made up of two)
                            f"checkpoint {resume_from}: its trainer state is of step {start_step}, its run.json of step "
                            f"{first_step}; resume from another checkpoint", group)  # fmt: skip

    if rank == 0:
        log.info("start-up: %s", ", ".join(f"{k} {v:.2f}" for k, v in startup.items()))
        # what the step keeps on its device and, for this optimizer, what the planner said and what was built
        built = {"plan": dataclasses.asdict(plan.ranks[0]), "built": optimizer.placement()} if recipe.optimizer == "offload" else {}
        with open(os.path.join(out_dir, "placement.json"), "w") as f:
            json.dump({**built, **{name: getattr(margs, name) for name in STEP_CHOICES}, "step_memory_why": step_memory_why,
                       **startup}, f, indent=1)  # fmt: skip
    metrics_path = rows_file(out_dir, tcfg.metrics_file, rank)
    tokens_per_step = world * tcfg.micro_batches * dcfg.micro_batch * dcfg.seq_len
    if rank == 0:
        log.info(f"{format_count(num_params(margs))} params, {world} rank(s) on {device.type}, optimizer {recipe.optimizer}, "
                 f"{describe(margs)} ({step_memory_why})"
                 + (", each block's math compiled (train.compile: the first step compiles it)" if tcfg.compile else "")
              + (f" (kernel {optimizer.kernel_name}, {len(optimizer.layout)} subgroups/rank, "
                 f"{optimizer.store.cache.num_slots} in host memory, tiers {recipe.config.tiers})" if recipe.optimizer == "offload" else "")
              + f"; {resume_line}; metrics in {out_dir}")  # fmt: skip
    bar = tqdm(total=tcfg.steps, initial=start_step, disable=rank != 0 or not tcfg.progress, dynamic_ncols=True)
    rows = []
    waiting: list[dict] = []  # rows whose update may still run (overlapped with the next step's forward)
    board = tensorboard_writer(os.path.join(out_dir, "tensorboard")) if tcfg.tensorboard and rank == 0 else None
    if resume_from:
        drop_rows_from(metrics_path, start_step)  # a resumed run redoes the steps after its checkpoint
    else:  # a fresh run's rows are its own: every earlier run's, of any rank count, moved aside before any rank writes
        for path, aside in start_fresh(out_dir, tcfg.metrics_file, group):
            log.info("an earlier run's rows in %s moved to %s: this run starts fresh", path, aside)
    with open(metrics_path, "a") as jsonl, contextlib.closing(board) if board is not None else contextlib.nullcontext():

        def write_finished() -> None:
            # An OffloadAdamW publishes each update's metrics once it has finished, in step order
            # (torch's optimizers' rows have theirs already).
            if isinstance(optimizer, OffloadAdamW):
                for row, m in zip([r for r in waiting if "update_s" not in r], optimizer.take_metrics()):
                    add_update_metrics(row, m)
            while waiting and "update_s" in waiting[0]:
                row = waiting.pop(0)
                if row["step"] % tcfg.log_every == 0 or row["step"] == tcfg.steps - 1:
                    jsonl.write(json.dumps(row) + "\n")
                    jsonl.flush()
                    if board is not None:
                        add_scalars(board, row)

        for step in range(start_step, tcfg.steps):
            profiling = step == tcfg.profile_step
            with profiled(os.path.join(out_dir, f"trace_step{step}_rank{rank}"), device) if profiling else contextlib.nullcontext():
                row = run_step(model, optimizer, batches, tcfg, recipe.config.max_grad_norm, device)
                if profiling and isinstance(optimizer, OffloadAdamW):
                    optimizer.finish_update()  # the trace holds this step's whole update, whatever the overlap
            if profiling:
                row["profiled"] = True  # its times carry the profiler's cost: left out of the summary below
            lr = optimizer.param_groups[0]["lr"]  # the lr this step's update took
            scheduler.step()
            row.update(step=step, rank=rank, time=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
                       lr=lr, tokens_per_s=tokens_per_step / row["step_s"],
                       host_peak_gib=host_peak_gib(), **process_now(), cpu_threads=torch.get_num_threads())  # fmt: skip
            if device.type == "cuda":
                row["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            rows.append(row)
            waiting.append(row)
            last = step + 1 == tcfg.steps
            save = ckcfg.dir and (last or (ckcfg.every and (step + 1) % ckcfg.every == 0))
            write_finished()
            if (last or save) and isinstance(optimizer, OffloadAdamW):
                # the rows of the steps a checkpoint holds are written before it exists: a run resumed
                # from it never lacks one
                optimizer.finish_update()
                write_finished()
            bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
            bar.update(1)
            if save:
                rank_state = {"step": step + 1, "data": batches.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng_state(),
                              "hyper": hyper}  # fmt: skip
                t0 = time.perf_counter()
                path = save_checkpoint(ckcfg.dir, step + 1, model, optimizer, run_key, rank_state, keep=ckcfg.keep,
                                       io_threads=ckcfg.io_threads)
                if rank == 0:
                    log.info("saved %s in %.1f s", path, time.perf_counter() - t0)
            if tcfg.kill_at_step is not None and step + 1 == tcfg.kill_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
    bar.close()
    if rank == 0 and rows:
        tail = [r for r in rows[len(rows) // 2 :] if not r.get("profiled")] or rows[len(rows) // 2 :]
        mean = {k: sum(r[k] for r in tail) / len(tail) for k in ("forward_s", "backward_s", "update_s", "tokens_per_s")}
        log.info(f"loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}; second half: "
                 + ", ".join(f"{k} {v:.3f}" for k, v in mean.items()) + f"; metrics in {metrics_path}")  # fmt: skip
    if isinstance(optimizer, OffloadAdamW):
        optimizer.close()
    return rows


register_recipe_resolvers()  # `${tmpdir:}` in the recipes, resolved when the config is read


def main() -> None:
    """The `fsdp-offload-train` command and scripts/train.py: Hydra overrides on the command line (one
    that does not compose is answered in one line first, naming the nearest key)."""
    refuse_bad_overrides(sys.argv[1:])
    signal.signal(signal.SIGTERM, end_on_sigterm)
    run_from_hydra()


def end_on_sigterm(signum: int, frame: object) -> None:
    """A SIGTERM (torchrun passes its own to every rank; `timeout`, a scheduler's cancel) ends the run as an
    error would: the optimizer's tier files (RAM, on /dev/shm) and the run dirs' locks go now, not at a
    later start. A rank blocked in a collective takes it when the collective returns, or the launcher's
    SIGKILL ends it as before. Once: a second SIGTERM (scancel's, then torchrun's) would cut the cleanup short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


@hydra.main(config_path="recipes", config_name="train", version_base="1.3")
def run_from_hydra(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except (ValueError, OSError, TierError) as exc:  # bad input, a full or read-only dir: one line, once a job
        # the launcher's SIGTERM to the ranks left leaves their cleanup whole; one that comes before a rank's wait for
        # rank 0 is noted, and ends the wait at once (the wait puts SIG_IGN back)
        signal.signal(signal.SIGTERM, note_sigterm if printed_by_another_rank(exc) else signal.SIG_IGN)
        line = error_line(exc, cfg)
        if line is None:  # an OSError of no dir the options chose: its traceback says more
            raise
        if printed_by_another_rank(exc):
            wait_for_rank0_to_say_it()
        else:
            print(f"error: {line}", file=sys.stderr)
        sys.exit(2)
    except RuntimeError as exc:  # a collective broken by another rank's end: that rank says why
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if a_collective_timed_out(exc):  # said by each rank that waited: the one that did not answer is not among them
            first = str(exc).strip().splitlines()[0][:300]
            print(f"error: rank {os.environ.get('RANK', '0')}: a collective waited train.collective_timeout_s="
                  f"{cfg.train.collective_timeout_s} s for a rank that neither answered nor ended (the watchdog's lines above name "
                  f"a stopped one); find that rank, or raise train.collective_timeout_s where a step or a save takes longer ({first})",
                  file=sys.stderr)  # fmt: skip
            sys.exit(2)
        if not a_peer_stopped(exc):
            raise
        print(f"rank {os.environ.get('RANK', '0')} stops: another rank of the job ended first (its error above, or the launcher's report of its exit, says why)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
