"""Reference models trained with the offloading optimizer."""

from fsdp_offload.models.llama import LlamaArgs, Transformer, compile_blocks, num_params
from fsdp_offload.models.presets import MODEL_PRESETS, preset_name

__all__ = ["MODEL_PRESETS", "LlamaArgs", "Transformer", "compile_blocks", "num_params", "preset_name"]
