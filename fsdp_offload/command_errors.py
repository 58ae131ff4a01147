"""A command line's overrides that Hydra cannot compose, answered in one line for both commands
(`fsdp-offload-train`/scripts/train.py and the planner): Hydra's own message, without its search path
and its "To append to your config use +key=value" advice (every option of a group is in its recipe, so
such a key is misspelt, and the recipe would refuse it appended), and the nearest key of its group."""

from __future__ import annotations

import difflib
import os
import re
import sys

from hydra.errors import HydraException
from omegaconf import OmegaConf

from .job_errors import wait_for_rank0_to_say_it


def refuse_bad_overrides(overrides: list[str]) -> None:
    """Composes the train recipe with the command line's `overrides` and, where that fails, says why
    once (rank 0 of a torchrun job; every rank composes the same line) and exits with 2, before Hydra
    answers with advice that does not work. A line with a Hydra flag (`--config-name`, `-m`, `--help`,
    ...) or a sweep (`hydra.mode`) is left to Hydra whole, as it changes what composes."""
    from hydra import compose, initialize_config_module

    if any(o.startswith(("-", "hydra.mode")) for o in overrides):
        return
    try:
        with initialize_config_module("fsdp_offload.recipes", version_base="1.3"):
            compose("train", overrides=overrides)
    except HydraException as exc:
        if os.environ.get("RANK", "0") == "0":
            machine = [o for o in overrides if o.lstrip("+~").startswith("machine.")]  # the plan command's options
            hint = (f"; {machine[0]}: machine.* options state the machine the plan command plans for; train.py trains on "
                    "this one (its host memory: train.host_memory_gb)") if machine else did_you_mean(exc, overrides)  # fmt: skip
            print(f"error: {hydra_error_line(exc)}{hint}", file=sys.stderr)
        else:
            wait_for_rank0_to_say_it()
        sys.exit(2)


def did_you_mean(exc: HydraException, overrides: list[str], extra_groups: dict[str, list[str]] | None = None) -> str:
    """'; did you mean offload.gpu_fraction?' for an override whose key the config lacks, where each
    misspelt part of it (group or key) is close to one the config has (the config composed from the
    other overrides, plus `extra_groups`: the planner's machine.* options), else ''."""
    missing = re.search(r"Could not override '([^']+)'", str(exc))
    if missing is None:
        return ""
    parts = missing.group(1).split(".")
    others = [o for o in overrides if not o.startswith("machine.") and o.lstrip("+~").partition("=")[0] != missing.group(1)]
    from hydra import compose, initialize_config_module

    try:
        with initialize_config_module("fsdp_offload.recipes", version_base="1.3"):
            composed = compose("train", overrides=others)
    except HydraException:  # another override is wrong too: no suggestion
        return ""
    # (as plain values, unresolved: a mandatory '???' option is a key like any other here)
    node = {**OmegaConf.to_container(composed, resolve=False), **{g: dict.fromkeys(keys) for g, keys in (extra_groups or {}).items()}}
    nearest = []
    for part in parts:
        keys = [str(k) for k in node.keys()] if hasattr(node, "keys") else []
        close = [part] if part in keys else difflib.get_close_matches(part, keys, n=1)
        if not close:
            return ""
        nearest.append(close[0])
        node = node[close[0]]
    return f"; did you mean {'.'.join(nearest)}?" if nearest != parts else ""


def hydra_error_line(exc: HydraException) -> str:
    """Hydra's message on one line: its config search path left out, the options it lists joined."""
    text = str(exc).split("Config search path:")[0].replace(":\n\t", ": ").replace("\n\t", ", ")
    # "To append to your config use +key=value": every option of a group is in its recipe, so the key is misspelt
    lines = [line.strip().rstrip(".") for line in text.splitlines() if line.strip() and not line.startswith("To append")]
    if exc.__cause__ is not None:
        lines.append(f"{str(exc.__cause__).splitlines()[0]}; the options of a group are the keys of its recipe "
                     "(fsdp_offload/recipes/<group>/)")  # fmt: skip
    return "; ".join(lines)
