"""Weights loaded into the model after OffloadAdamW is built become its FP32 masters, as torch AdamW's
params take them (torchtitan's order: optimizers built, then the model's checkpoint loaded).

On 2 gloo ranks: a model loaded after the optimizer is built (a full state dict through torch's
`set_model_state_dict`, and a sharded one through `model.load_state_dict`) trains bit for bit as the
same model loaded before it was built, and the masters hold the loaded FP32 values exactly (the model
itself keeps bf16); a bf16 checkpoint gives them its values upcast. A partial load (strict=False)
changes only the params it names; assign=True, which would swap the params the optimizer holds, is
refused by name. torchtitan's load (`dcp.load` into the model's bf16 tensors, then
`set_model_state_dict`) gives the masters the bf16 values; a rollback to a bf16 snapshot rolls the
masters back; a load after an eval forward (FSDP2's root left unsharded) and one through a parent
module are seen; one `dcp.load` of the model's and the optimizer's Statefuls restores the masters; a
value torch refuses is not taken. (The
model's own bf16 state dict loaded after the optimizer's, as torch's `set_state_dict` does on resume,
keeps the masters: test_hf_llama.py's resume.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from test_fsdp import LR, SG, WD, batch, build_model, loss_of
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import distribute_tensor

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.optimizer_state import OffloadOptimizerState, StreamingLoadPlanner, StreamingSavePlanner

FULL = StateDictOptions(full_state_dict=True)


def pretrained(rank: int) -> dict[str, torch.Tensor]:
    """Whole FP32 weights other than the model's own init, the same on every rank."""
    return {k: v.float() * 1.5 + 0.01 for k, v in get_model_state_dict(build_model(rank), options=FULL).items()}


def optimizer(model: torch.nn.Module) -> OffloadAdamW:
    return OffloadAdamW(model.parameters(), lr=LR, weight_decay=WD, model=model, offload=OffloadConfig(subgroup_numel=SG, kernel="torch"))


def train(model: torch.nn.Module, opt: OffloadAdamW, rank: int) -> tuple[list[float], list[torch.Tensor]]:
    losses = []
    for step in range(3):
        opt.zero_grad()
        loss = loss_of(model, batch(rank, step))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [opt.state[p]["master_param"].to_local().clone() for p in model.parameters()]


def masters(opt: OffloadAdamW, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: opt.state[p]["master_param"].to_local().clone() for n, p in model.named_parameters()}


def loads_after_build(rank: int, world: int) -> None:
    weights = pretrained(rank)
    loaded_first = build_model(rank)
    set_model_state_dict(loaded_first, weights, options=FULL)
    sharded = {k: v.detach().clone() for k, v in loaded_first.state_dict().items()}  # FP32 DTensors, this rank's shards
    want = train(loaded_first, optimizer(loaded_first), rank)

    for load in ("set_model_state_dict, full", "load_state_dict, sharded"):
        model = build_model(rank)
        opt = optimizer(model)
        if load.startswith("set_model_state_dict"):
            set_model_state_dict(model, weights, options=FULL)
        else:
            model.load_state_dict(sharded)
        for name, master in masters(opt, model).items():
            assert torch.equal(master, sharded[name].to_local()), f"{load}: {name}'s master is not the loaded FP32 value"
        assert next(model.parameters()).dtype == torch.bfloat16  # the model keeps its low precision
        got = train(model, opt, rank)
        assert got[0] == want[0], f"{load}: losses {got[0]} against {want[0]} with the model loaded before the optimizer"
        assert all(torch.equal(a, b) for a, b in zip(got[1], want[1])), f"{load}: masters differ after training"
        opt.close()

    model = build_model(rank)  # a bf16 checkpoint (a Hugging Face one, say): the masters take its values upcast
    opt = optimizer(model)
    set_model_state_dict(model, {k: v.to(torch.bfloat16) for k, v in weights.items()}, options=FULL)
    for name, master in masters(opt, model).items():
        assert torch.equal(master, sharded[name].to_local().to(torch.bfloat16).float()), f"bf16 load: {name}"
    opt.close()

    model = build_model(rank)
    opt = optimizer(model)
    before = masters(opt, model)
    name = "layers.0.attention.wq.weight"
    assert name in before
    model.load_state_dict({name: sharded[name]}, strict=False)
    after = masters(opt, model)
    assert torch.equal(after[name], sharded[name].to_local())
    assert all(torch.equal(after[n], before[n]) for n in before if n != name), "a partial load changed other masters"
    with pytest.raises(RuntimeError, match=r"assign=True\) would replace the params OffloadAdamW holds"):
        model.load_state_dict(sharded, assign=True)
    with torch.no_grad():  # a write around load_state_dict, then the documented remedy: the model's values become the masters
        for p in model.parameters():
            p.to_local().mul_(2)
    model.load_state_dict(model.state_dict())
    for name, p in model.named_parameters():
        assert torch.equal(masters(opt, model)[name], p.to_local().float()), f"remedy: {name}"
    opt.close()


def test_weights_loaded_after_the_optimizer_is_built_become_its_masters():
    run_ranks(2, loads_after_build)


class ModelState:
    """The model as a DCP Stateful, as torchtitan's ModelWrapper is."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state, options=StateDictOptions(strict=False))


def loads_of_every_kind(rank: int, world: int, tmp: str) -> None:
    weights = pretrained(rank)
    src = build_model(rank)
    set_model_state_dict(src, weights, options=FULL)
    want = {n: p.to_local().clone() for n, p in src.named_parameters()}  # this rank's FP32 shards
    dcp.save(get_model_state_dict(src), checkpoint_id=f"{tmp}/ckpt")

    # torchtitan: dcp.load into the model's own (bf16) tensors, then set_model_state_dict(strict=False)
    model = build_model(rank)
    opt = optimizer(model)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=f"{tmp}/ckpt")
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))
    for name, master in masters(opt, model).items():
        assert torch.equal(master, want[name].to(torch.bfloat16).float()), f"torchtitan's load: {name}"
    opt.close()

    # a rollback to a bf16 snapshot after steps at a small lr (most bf16 values unchanged, masters drifted)
    model = build_model(rank)
    opt = OffloadAdamW(model.parameters(), lr=1e-5, model=model, offload=OffloadConfig(subgroup_numel=SG, kernel="torch"))
    snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
    train(model, opt, rank)
    model.load_state_dict(snapshot)
    for name, master in masters(opt, model).items():
        assert torch.equal(master, snapshot[name].to_local().float()), f"rollback: {name}'s master not rolled back"
    opt.close()

    # after a forward without backward (an eval), which leaves FSDP2's root unit unsharded
    model = build_model(rank)
    opt = optimizer(model)
    with torch.no_grad():
        loss_of(model, batch(rank, 0))
    model.load_state_dict(src.state_dict())
    for name, master in masters(opt, model).items():
        assert torch.equal(master, want[name]), f"load after an eval forward: {name}"
    # one dcp.load of the model's and the optimizer's Statefuls (torchtitan's), the model's first
    train(model, opt, rank)
    trained = masters(opt, model)
    dcp.save({"model": ModelState(model), "optim": OffloadOptimizerState(opt)}, checkpoint_id=f"{tmp}/both",
             planner=StreamingSavePlanner())  # fmt: skip
    opt.close()
    model = build_model(rank)
    opt = optimizer(model)
    dcp.load({"model": ModelState(model), "optim": OffloadOptimizerState(opt)}, checkpoint_id=f"{tmp}/both",
             planner=StreamingLoadPlanner())  # fmt: skip
    assert all(torch.equal(m, trained[n]) for n, m in masters(opt, model).items()), "one dcp.load of both"
    opt.close()

    # through a parent module (the optimizer is built on the FSDP2 root it holds)
    model = build_model(rank)
    opt = optimizer(model)
    parent = torch.nn.ModuleDict({"net": model})
    parent.load_state_dict({f"net.{k}": v for k, v in src.state_dict().items()})
    for name, master in masters(opt, model).items():
        assert torch.equal(master, want[name]), f"load through a parent: {name}"

    # a value torch refuses (one row short) leaves the master as torch leaves the param
    name = "layers.0.attention.wq.weight"
    p = model.get_parameter(name)
    short = distribute_tensor(torch.ones(p.shape[0] - 1, p.shape[1]), p.device_mesh, p.placements)
    with pytest.raises(RuntimeError, match="size mismatch"):
        model.load_state_dict({name: short}, strict=False)
    assert torch.equal(masters(opt, model)[name], want[name])
    opt.close()


def test_torchtitans_load_a_rollback_a_parent_and_a_refused_value(tmp_path):
    run_ranks(2, loads_of_every_kind, str(tmp_path))
