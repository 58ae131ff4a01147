"""checkpoint.* options, checked once when the config is read."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import is_whole, path_option


@dataclass
class CheckpointConfig:
    dir: str | None = None  # None: no checkpoints
    every: int = 0  # save every this many steps (0: only at the end)
    # "auto": the latest checkpoint in `dir` if there is one, else a fresh start (said in one line);
    # "required": the latest, refusing to start without one; "never": a fresh start; or the path of
    # one checkpoint (a step_* dir). true/false mean auto/never.
    resume: str | bool = "auto"
    keep: int = 2  # checkpoints kept; older ones are deleted
    io_threads: int = 2  # writers of optimizer subgroups per rank: each holds one subgroup in host memory at a time

    def __post_init__(self) -> None:
        if isinstance(self.resume, bool):
            self.resume = "auto" if self.resume else "never"
        self.resume = path_option(self.resume, "checkpoint.resume", what="auto, required, never or the path of a step_* dir")
        self.dir = path_option(self.dir, "checkpoint.dir", null="no checkpoints", what="a directory path")
        for name in ("every", "keep", "io_threads"):
            if not is_whole(getattr(self, name)):
                raise ValueError(f"checkpoint.{name}={getattr(self, name)!r} must be a whole number")
        if self.every < 0:
            raise ValueError(f"checkpoint.every={self.every} must be >= 0 (0: a checkpoint at the end only)")
        if self.every and not self.dir:
            raise ValueError(f"checkpoint.every={self.every} saves into checkpoint.dir, which is not set: give checkpoint.dir")
        if self.io_threads < 1:
            raise ValueError(f"checkpoint.io_threads={self.io_threads}: at least 1 writer is needed")
        if self.keep < 1:
            raise ValueError(
                f"checkpoint.keep={self.keep}: at least the checkpoint just written must be kept; give checkpoint.keep=1 "
                "or more, or checkpoint.dir=null for no checkpoints"
            )
