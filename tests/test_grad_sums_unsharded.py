"""A step's micro-batches summed unsharded in FP32 by FSDP2 (`model.sum_grads_unsharded`): train.py's step
keeps the gradient sync off until the last backward, so each unit reduce-scatters once a step, not once a
micro-batch, and the optimizer takes one grad a step; the run matches the one that reduces every
micro-batch (FSDP2 on CPU, gloo, 2 ranks). A user's own loop may do the same with units that reduce in
float32; units that reduce in low precision are still refused. The entry keeps the sums where the device
holds them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_utils import run_ranks

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload import machine as machine_module
from fsdp_offload.data import DataConfig, TokenBatches
from fsdp_offload.fsdp import local_data
from fsdp_offload.machine import MachineConfig
from fsdp_offload.models import MODEL_PRESETS, LlamaArgs
from fsdp_offload.node_plan import make_plan, optimizer_config
from fsdp_offload.parallelize import build_fsdp_model
from fsdp_offload.recipe import TrainConfig
from fsdp_offload.step_memory import fsdp_step_bytes, plan_step_memory
from fsdp_offload.train_step import run_step, sums_grads_unsharded

ARGS = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=32)
MICRO, STEPS, LR = 3, 2, 3e-3


def train(rank: int, world: int, sums: bool, optimizer: str) -> dict:
    """STEPS steps of MICRO micro-batches through train.py's step, counting FSDP2's reduce-scatters."""
    model = build_fsdp_model(dataclasses.replace(ARGS, sum_grads_unsharded=sums), torch.device("cpu"))
    if optimizer == "offload":
        cfg = OffloadConfig(kernel="torch", subgroup_numel=4096, micro_batches=MICRO, max_grad_norm=0.5)
        opt = OffloadAdamW(model.parameters(), lr=LR, model=model, offload=optimizer_config(cfg, model.args))
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = TokenBatches(DataConfig(seq_len=16, micro_batch=2), vocab_size=ARGS.vocab_size, rank=rank, world_size=world)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        rows = [run_step(model, opt, batches, TrainConfig(micro_batches=MICRO), 0.5, torch.device("cpu")) for _ in range(STEPS)]
    losses, row = [r["loss"] for r in rows], rows[-1]
    if optimizer == "offload":  # its FP32 masters (the model's bf16 params round them)
        state = opt.state_dict()["state"]
        params = [local_data(state[i]["master_param"]).clone() for i in range(len(state))]
        opt.close()
    else:
        params = [local_data(p).detach().clone() for p in model.parameters()]
    return {"losses": losses, "sums": sums_grads_unsharded(model), "params": params, "summed_by": row.get("grad_accumulation"),
            "reduces": sum(e.name.startswith("FSDP::post_backward_reduce") for e in prof.events())}  # fmt: skip


def once_and_every(rank: int, world: int, optimizer: str) -> None:
    once, every = train(rank, world, True, optimizer), train(rank, world, False, optimizer)
    assert once["sums"] and not every["sums"]
    if optimizer == "offload":  # each step's row says who summed the micro-batches
        assert once["summed_by"] == "fsdp2_unsharded" and every["summed_by"] == "host"
    assert once["reduces"] > 0 and every["reduces"] == MICRO * once["reduces"]  # a unit's reduce-scatter once a step
    assert once["losses"][0] == every["losses"][0]  # the same params, the same micro-batches
    # The same sums in another order (micro-batches, then ranks). Adam's first steps move a param by about
    # the lr whatever its grad's size, so where a grad is near zero a rounding can turn its step around:
    # FP32 grads (torch) part by a few ulps, and OffloadAdamW's bf16 ones, rounded once (the whole sum)
    # against once a micro-batch, part the masters by a small share of the lr, and a few elements by more.
    assert once["losses"] == pytest.approx(every["losses"], rel=1e-4)
    apart = torch.cat([(a - b).abs().flatten() for a, b in zip(once["params"], every["params"])])
    if optimizer == "torch":
        assert apart.max() < 1e-5, apart.max()
    else:  # (measured: median 4e-6, 0.3% above lr/10)
        assert apart.median() < LR / 100 and (apart > LR / 10).float().mean() < 0.01, (apart.median(), apart.max())


@pytest.mark.parametrize("optimizer", ["offload", "torch"])
def test_the_micro_batches_summed_unsharded_reduce_once_a_step_and_train_the_same(optimizer):
    run_ranks(2, once_and_every, optimizer)


def own_loop(rank: int, world: int) -> None:
    """A user's loop over FSDP2 units that reduce in float32, the sync off for all but the last micro-batch
    (as accelerate's accumulate() does): the optimizer takes the FP32 sum, once; left off through the last
    backward, the step refuses, naming the fix."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdp_offload.parallelize import shard_units
    from fsdp_offload.models import Transformer

    def build() -> tuple:
        torch.manual_seed(0)
        model = Transformer(ARGS)
        shard_units(model, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
        return model, OffloadAdamW(model.parameters(), lr=LR, model=model, offload=OffloadConfig(kernel="torch", subgroup_numel=4096))

    batches = TokenBatches(DataConfig(seq_len=16, micro_batch=2), vocab_size=ARGS.vocab_size, rank=rank, world_size=world)
    tokens = [next(batches) for _ in range(2)]
    loss_of = lambda model, t: torch.nn.functional.cross_entropy(model(t[:, :-1]).float().flatten(0, 1), t[:, 1:].flatten())  # noqa: E731
    model, opt = build()
    for i, t in enumerate(tokens):
        model.set_requires_gradient_sync(i == len(tokens) - 1)
        loss_of(model, t).backward()
    assert max(opt.grads.backwards) == 1  # one grad a param: FSDP2 summed the two backwards
    opt.step()
    opt.finish_update()
    opt.close()
    model, opt = build()
    model.set_requires_gradient_sync(False)
    loss_of(model, tokens[0]).backward()
    with pytest.raises(RuntimeError, match=r"left its grads unreduced: FSDP2 sums them in FP32.*set_requires_gradient_sync\(True\)"):
        opt.step()
    opt.close()


def test_a_users_loop_may_let_fsdp2_sum_in_fp32_with_the_sync_off():
    run_ranks(2, own_loop)


@pytest.fixture
def roomy_tiers(monkeypatch):
    monkeypatch.setattr(machine_module, "free_bytes", lambda path: 1 << 50)


def resolve(gpu_gib: float, micro_batches: int, **stated) -> tuple[tuple, str]:
    """How the 1.35B's `auto`s resolve on 4 ranks of `gpu_gib`, seq 2048, micro-batch 1, and why."""
    args = dataclasses.replace(MODEL_PRESETS["1b"], **{"activation_checkpointing": "auto", "reshard_after_forward": "auto",
                                                       "sum_grads_unsharded": "auto", **stated})  # fmt: skip
    cfg = OffloadConfig(tiers=["posix:/tmp"], host_budget_gb=64, micro_batches=micro_batches)
    machine = MachineConfig(gpu_gib=gpu_gib, host_gib=512, ranks_per_node=4)
    plan, chosen = plan_step_memory(args, lambda a: make_plan("1b", a, cfg, machine, 2048, 1, "cuda"), cfg.gpu_headroom_gb,
                                    micro_batches=micro_batches)  # fmt: skip
    assert plan.sum_grads_unsharded == chosen.sum_grads_unsharded
    return (chosen.activation_checkpointing, chosen.reshard_after_forward, chosen.sum_grads_unsharded), plan.step_memory_why


def test_the_sums_are_kept_where_the_gpu_holds_them_and_only_with_micro_batches_to_sum(roomy_tiers):
    # 4 ranks: about 9.6 GiB a rank keeping the activations and the gathered units; 13.6 with the unsharded
    # sums (4 bytes a param of the whole model and the FP32 reduce-scatter input of a unit, the optimizer's own
    # FP32 sums of its shard gone; 13.5 measured, `bench_scale_nvidia-h200-x4_20261128-031918.json`)
    kept, why = resolve(80, 8)
    assert kept == (False, False, True) and "the unsharded grad sums (about 13.58 GiB a rank" in why
    kept, why = resolve(16, 8)  # 12 GiB of room less the headroom
    assert kept == (False, False, False) and why.startswith("auto: keeping the activations, the gathered units and the "
                                                            "unsharded grad sums, a rank's step would take about 13.58 GiB")
    assert resolve(80, 1) == ((False, False, False), resolve(80, 1)[1])  # one micro-batch: nothing to sum
    assert "sum_grads_unsharded" not in resolve(80, 1, sum_grads_unsharded=False)[1]  # nor said
    kept, why = resolve(80, 8, sum_grads_unsharded=False)
    assert kept == (False, False, False) and why.startswith("set: model.sum_grads_unsharded=false; auto: ")


def test_the_optimizer_is_planned_for_one_grad_a_step_where_fsdp2_sums_them():
    cfg = OffloadConfig(micro_batches=8)
    assert optimizer_config(cfg, dataclasses.replace(ARGS, sum_grads_unsharded=True)).micro_batches == 1
    assert optimizer_config(cfg, ARGS) is cfg
    # plain FSDP2 holds the sums beside its state: 4 bytes a param of the whole model, and of a unit's reduce input
    summed = dataclasses.replace(MODEL_PRESETS["1b"], sum_grads_unsharded=True)
    model = build_meta(summed)
    largest_unit = max(sum(p.numel() for p in m.parameters()) for m in [model.tok_embeddings, *model.layers, model.output])
    assert fsdp_step_bytes(summed, 4, 2048, 1) - fsdp_step_bytes(MODEL_PRESETS["1b"], 4, 2048, 1) == 4 * (
        sum(p.numel() for p in model.parameters()) + largest_unit)


def build_meta(args: LlamaArgs) -> torch.nn.Module:
    from fsdp_offload.models import Transformer

    with torch.device("meta"):
        return Transformer(args)


def test_a_policy_that_reduces_in_low_precision_is_refused_by_name():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdp_offload.parallelize import shard_units

    model = build_meta(dataclasses.replace(ARGS, sum_grads_unsharded=True))
    with pytest.raises(ValueError, match=r"model.sum_grads_unsharded=true sums the grads in FP32.*reduces in torch.bfloat16"):
        shard_units(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16))


def test_the_plan_predicts_from_the_rate_learned_for_the_grads_its_kernel_takes(tmp_path, capsys, monkeypatch):
    """Where FSDP2 sums the micro-batches, the kernel takes one bf16 grad a step: the plan command predicts
    from the rate a run saved for bf16 grads, not for FP32 sums (their key differs: learned_rate.rate_key_for)."""
    from test_update_rate_learned import cfg_for, learn

    from fsdp_offload import update_costs as update_costs_module
    from fsdp_offload.learned_rate import rate_key_for
    from fsdp_offload.plan import main as plan_main
    from fsdp_offload.update_costs import UpdateCosts

    monkeypatch.setattr(update_costs_module, "time_update_costs", lambda *a, **kw: UpdateCosts())
    monkeypatch.setattr(machine_module, "node_update_rate", lambda *a: 123e6)  # a timed rate: 123 M params/s
    path, threads = str(tmp_path / "p.json"), torch.get_num_threads()
    cfg = cfg_for(path, numel=OffloadConfig().subgroup_numel)
    learn(path, 1e9, threads=threads, numel=cfg.subgroup_numel)  # a run with one grad a step (bf16)
    common = ["train.device=cpu", "offload=host", "machine.host_gib=64", "offload.kernel=torch", f"offload.bandwidth_profile={path}",
              f"train.cpu_threads={threads}", "train.micro_batches=8"]  # fmt: skip
    assert plan_main(common) == 0  # the sums resolve true on the host
    out = capsys.readouterr().out
    assert f"learned from an earlier run's steps on this host ({rate_key_for(cfg, 1, threads)}, saved " in out, out
    assert plan_main([*common, "model.sum_grads_unsharded=false"]) == 0  # the optimizer's FP32 sums: no run saved that
    out = capsys.readouterr().out
    assert "123 M params/s per rank" in out and rate_key_for(cfg, 1, threads) not in out.split("CPU update rate:")[1].split("\n")[0]


def test_the_recipes_refuse_the_optimizers_sums_placed_beside_fsdp2s_and_take_backward_overlap_with_them():
    from fsdp_offload.plan import compose_plan_config
    from fsdp_offload.recipe import read_config

    read = lambda *overrides: read_config(compose_plan_config(["train.micro_batches=4", *overrides])[0])  # noqa: E731
    for sums in ("auto", "true"):
        with pytest.raises(ValueError, match=rf"offload.grad_accumulation='gpu' places the optimizer's sums of the step's 4 "
                                             rf"micro-batches, and model.sum_grads_unsharded={sums} .*set model.sum_grads_unsharded=false"):
            read("offload.grad_accumulation=gpu", f"model.sum_grads_unsharded={sums}")
    assert read("offload.grad_accumulation=gpu", "model.sum_grads_unsharded=false")[3].config.micro_batches == 4
    # overlap=backward takes one grad a step: the sums stated give it that, `auto` may not
    backward = ("offload.overlap=backward", "offload.max_grad_norm=null")
    assert read(*backward, "model.sum_grads_unsharded=true")[3].config.micro_batches == 1
    for sums in ("auto", "false"):
        with pytest.raises(ValueError, match=r"offload.overlap='backward' .* set model.sum_grads_unsharded=true"):
            read(*backward, f"model.sum_grads_unsharded={sums}")


def test_the_sums_are_not_kept_where_their_bytes_would_push_state_off_the_gpu():
    """With `gpu_fraction=auto` the GPU's room goes to state too: the sums' 4 bytes a param must not take
    subgroups off it (helper-77's case: 4 of 4 on the GPU without the sums, 2 with them, and the reason
    said the state was placed as without them)."""
    args = dataclasses.replace(MODEL_PRESETS["1b"], activation_checkpointing="auto", reshard_after_forward="auto",
                               sum_grads_unsharded="auto")  # fmt: skip
    cfg = OffloadConfig(micro_batches=8, gpu_fraction="auto")

    def resolve_on(gpu_gib: float) -> tuple:
        machine = MachineConfig(gpu_gib=gpu_gib, host_gib=512, ranks_per_node=4)
        plan, chosen = plan_step_memory(args, lambda a: make_plan("1b", a, cfg, machine, 2048, 1, "cuda"), cfg.gpu_headroom_gb,
                                        micro_batches=8)  # fmt: skip
        return (chosen.activation_checkpointing, chosen.reshard_after_forward, chosen.sum_grads_unsharded), plan

    kept, plan = resolve_on(20)
    assert kept == (False, False, False) and [r.gpu_subgroups for r in plan.ranks] == [4] * 4
    assert ("keeping the activations, the gathered units and the unsharded grad sums, rank 0's subgroups on the GPU "
            "would go from 4 to 2") in plan.step_memory_why
    kept, plan = resolve_on(24)  # room for both
    assert kept == (False, False, True) and [r.gpu_subgroups for r in plan.ranks] == [4] * 4
