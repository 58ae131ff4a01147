"""Reference models trained with the offloading optimizer."""

from fsdp_offload.models.llama import MODEL_PRESETS, LlamaArgs, Transformer, compile_blocks, num_params, preset_name

__all__ = ["MODEL_PRESETS", "LlamaArgs", "Transformer", "compile_blocks", "num_params", "preset_name"]
