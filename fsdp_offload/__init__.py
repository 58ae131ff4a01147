"""fsdp-offload: an FSDP2 plugin with an out-of-core, multi-path CPU AdamW."""

from .config import OffloadConfig
from .optimizer import OffloadAdamW

__all__ = ["OffloadAdamW", "OffloadConfig"]
