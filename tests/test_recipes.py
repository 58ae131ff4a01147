"""Every recipe composes into the dataclasses the training script builds, and model presets agree."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from fsdp_offload import OffloadConfig
from fsdp_offload.config import register_recipe_resolvers
from fsdp_offload.data import DataConfig
from fsdp_offload.models import MODEL_PRESETS, LlamaArgs

RECIPES = Path(__file__).resolve().parents[1] / "fsdp_offload" / "recipes"
register_recipe_resolvers()


def names(group: str) -> list[str]:
    return sorted(p.stem for p in (RECIPES / group).glob("*.yaml"))


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


@pytest.mark.parametrize("model", names("model"))
def test_model_recipes_match_presets(model):
    cfg = composed(f"model={model}")
    args = LlamaArgs(**OmegaConf.to_container(cfg.model))
    preset = dataclasses.replace(MODEL_PRESETS[model], activation_checkpointing=args.activation_checkpointing,
                                 reshard_after_forward=args.reshard_after_forward, sum_grads_unsharded=args.sum_grads_unsharded)
    assert args == preset


@pytest.mark.parametrize("offload", names("offload"))
def test_offload_recipes_build(offload):
    raw = OmegaConf.to_container(composed(f"offload={offload}").offload, resolve=True)
    assert raw.pop("optimizer") in ("offload", "torch")
    OffloadConfig(**raw)


@pytest.mark.parametrize("experiment", names("experiment"))
def test_experiments_compose(experiment):
    cfg = composed(f"+experiment={experiment}")
    raw = OmegaConf.to_container(cfg.offload, resolve=True)
    raw.pop("optimizer")
    OffloadConfig(**raw)
    LlamaArgs(**OmegaConf.to_container(cfg.model))
    DataConfig(**OmegaConf.to_container(cfg.data))


def test_base_offload_recipe_is_the_dataclass_defaults():
    base = OmegaConf.to_container(OmegaConf.load(RECIPES / "offload" / "base.yaml"))
    assert base.pop("optimizer") == "offload"
    assert base == dataclasses.asdict(OffloadConfig()), "fsdp_offload/recipes/offload/base.yaml drifted from OffloadConfig"


@pytest.mark.bad_input
@pytest.mark.parametrize("offload", [n for n in names("offload") if n != "base"])
def test_every_option_is_settable_without_a_plus_and_typos_are_refused(offload):
    cfg = composed(f"offload={offload}", "offload.gpu_headroom_gb=2.5", "offload.calibration_gb=0.5")
    assert cfg.offload.gpu_headroom_gb == 2.5 and cfg.offload.calibration_gb == 0.5
    with pytest.raises(Exception, match="tierz"):
        composed(f"offload={offload}", "offload.tierz=1")


@pytest.mark.bad_input
def test_an_appended_key_that_nothing_reads_is_refused_naming_the_close_section():
    """Hydra answers `modle=1b` with "To append to your config use +modle=1b"; done, the key would be
    ignored and the run would train the default model."""
    from fsdp_offload.recipe import read_config

    with pytest.raises(ValueError, match=r"^modle: not an option of the recipes, and nothing would read it; did you mean model\?"):
        read_config(composed("+modle=1b"))
    with pytest.raises(ValueError, match="the sections are model, offload, data, train, checkpoint"):
        read_config(composed("+zzz=1"))
    read_config(composed("+experiment=baseline"))  # an experiment merges into the sections: no key of its own


@pytest.mark.parametrize(
    "overrides, overlap",
    [
        ([], "next_forward"),  # the recipe clips
        (["offload.max_grad_norm=null"], "backward"),
        (["offload.max_grad_norm=null", "train.micro_batches=2"], "next_forward"),
        (["offload.max_grad_norm=null", "offload.overlap=none"], "none"),
    ],
)
def test_train_recipe_starts_the_update_in_backward_where_the_step_allows_it(overrides, overlap):
    from fsdp_offload.recipe import read_config

    recipe = read_config(composed(*overrides))[3]
    assert recipe.config.resolved_overlap() == overlap


def test_tiny_disk_says_what_it_builds():
    from fsdp_offload.machine import MachineConfig
    from fsdp_offload.node_plan import make_plan
    from fsdp_offload.recipe import read_config
    from fsdp_offload.step_memory import plan_step_memory

    cached, total = map(int, re.search(r"caches (\d+) of its (\d+)", (RECIPES / "offload" / "tiny_disk.yaml").read_text()).groups())
    _, args, data, recipe, _ = read_config(composed("train.device=cpu"))
    planned = lambda a: make_plan("tiny", a, recipe.config, MachineConfig(host_gib=64), data.seq_len, data.micro_batch, "cpu")  # noqa: E731
    rank = plan_step_memory(args, planned, recipe.config.gpu_headroom_gb)[0].ranks[0]  # as train.py plans it
    assert (rank.cache_slots, rank.subgroups) == (cached, total)
