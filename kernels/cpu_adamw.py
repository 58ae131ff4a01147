"""Fused CPU AdamW: cpu_adamw.cpp, built on first use with torch.utils.cpp_extension.

One pass over a segment reads the bf16/fp16/fp32 grad and the FP32 param/exp_avg/exp_avg_sq and writes
the FP32 state and the low-precision params, with AVX-512 or AVX2 (picked at run time) over OpenMP
threads. Its results are bit-identical to `torch_adamw_step` on this torch build: the C++ repeats
torch's CPU arithmetic op for op, including torch's MKL sqrt (see the top of cpu_adamw.cpp). The build
is cached in torch's extensions directory ($TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sysconfig
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("cpu_adamw.cpp")
EXTENSION_NAME = "fsdp_offload_cpu_adamw"
ISAS = ("avx512", "avx2", "scalar")
# No -ffast-math, and no FMA contraction: the C++ writes each FMA that torch's kernels have, no other.
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]
GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES = (torch.bfloat16, torch.float16)

_extension: ModuleType | None = None
_build_error: str | None = None  # a failed build is not retried in this process


def missing_toolchain() -> str | None:
    """What the build lacks on this machine (compiler, ninja, Python headers), or None."""
    cxx = os.environ.get("CXX", "c++")
    compiler = shlex.split(cxx)[0] if cxx.strip() else ""
    if not compiler or shutil.which(compiler) is None:
        return f"no C++ compiler: CXX={cxx!r} is not on PATH (install g++ or set CXX)"
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "torch.utils.cpp_extension needs ninja to build it: pip install ninja"
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").exists():
        return f"no Python headers: {include}/Python.h is missing (install python3-dev)"
    return None


def _build() -> ModuleType:
    missing = missing_toolchain()
    if missing is not None:
        raise RuntimeError(missing)
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    try:
        return cpp_extension.load(
            name=EXTENSION_NAME,
            sources=[str(SOURCE)],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:
        raise RuntimeError(f"building {SOURCE} with {cxx} failed: {exc}") from exc


def load_extension() -> ModuleType:
    """The compiled module (built on first call); raises RuntimeError saying why it can't be built."""
    global _extension, _build_error
    if _extension is None:
        if _build_error is not None:
            raise RuntimeError(_build_error)
        try:
            _extension = _build()
        except Exception as exc:
            _build_error = str(exc)
            raise
    return _extension


class FusedCpuAdamW:
    """A kernel with the signature of `torch_adamw_step`, bound to one instruction set."""

    def __init__(self, extension: ModuleType, isa: str, mkl_sqrt: bool) -> None:
        self._extension = extension
        self.isa = isa
        # True: MKL's sqrt, as torch.sqrt, so bit-exact; False: hardware sqrt, correctly rounded.
        self.mkl_sqrt = mkl_sqrt

    def __repr__(self) -> str:
        return f"FusedCpuAdamW(isa={self.isa!r}, mkl_sqrt={self.mkl_sqrt})"

    def __call__(
        self,
        param: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        grad: torch.Tensor,
        param_out: torch.Tensor | None,
        *,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        step: int,
        grad_scale: float = 1.0,
    ) -> None:
        _check_args(param, exp_avg, exp_avg_sq, grad, param_out)
        # The same double arithmetic as torch_adamw_step; the C++ casts each result to float.
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        self._extension.adamw_step(
            param, exp_avg, exp_avg_sq, grad, param_out,
            float(grad_scale), 1 - lr * weight_decay, 1 - beta1, float(beta2), 1 - beta2,
            bias_correction2_sqrt, float(eps), -step_size, self.isa, self.mkl_sqrt,
        )  # fmt: skip


def load_fused_adamw(isa: str | None = None, mkl_sqrt: bool | None = None) -> FusedCpuAdamW:
    """Builds (once) and returns the fused kernel.

    `isa` defaults to the best this CPU has (avx512 > avx2 > scalar); `mkl_sqrt` defaults to True when
    torch has MKL (then results are bit-exact with the torch path). Raises RuntimeError saying why
    when the extension cannot be built or the asked-for ISA is missing.
    """
    extension = load_extension()
    isa = isa or extension.best_isa()
    if isa not in ISAS:
        raise ValueError(f"unknown ISA {isa!r}: choose one of {', '.join(ISAS)}")
    if not extension.isa_supported(isa):
        best = extension.best_isa()
        raise RuntimeError(f"this CPU lacks the {isa} instructions (the best it has: {best})")
    has_mkl = extension.has_mkl_sqrt()
    if mkl_sqrt and not has_mkl:
        raise RuntimeError("this torch build has no MKL (libtorch_cpu exports no vmsSqrt)")
    return FusedCpuAdamW(extension, isa, has_mkl if mkl_sqrt is None else mkl_sqrt)


def _check_args(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    param_out: torch.Tensor | None,
) -> None:
    n = param.numel()
    for name, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32 or not _is_flat_cpu(t):
            raise ValueError(
                f"{name} must be a 1-D contiguous FP32 CPU tensor, got {t.dtype} {tuple(t.shape)} "
                f"on {t.device} (contiguous={t.is_contiguous()})"
            )
        if t.numel() != n:
            raise ValueError(f"{name} has {t.numel()} elements, param has {n}")
    if grad.dtype not in GRAD_DTYPES or not _is_flat_cpu(grad):
        raise ValueError(
            f"grad must be a 1-D contiguous bf16/fp16/fp32 CPU tensor, got {grad.dtype} "
            f"{tuple(grad.shape)} on {grad.device} (contiguous={grad.is_contiguous()})"
        )
    if grad.numel() != n:
        raise ValueError(f"grad has {grad.numel()} elements, param has {n}")
    if param_out is None:
        return
    out = param_out
    if out.dtype not in OUT_DTYPES or not _is_flat_cpu(out):
        raise ValueError(
            f"param_out must be a 1-D contiguous bf16/fp16 CPU tensor, got {out.dtype} "
            f"{tuple(out.shape)} on {out.device} (contiguous={out.is_contiguous()})"
        )
    if param_out.numel() != n:
        raise ValueError(f"param_out has {param_out.numel()} elements, param has {n}")
    check_param_out_overlap(param_out, grad, (param, exp_avg, exp_avg_sq))


def check_param_out_overlap(
    param_out: torch.Tensor, grad: torch.Tensor, state: tuple[torch.Tensor, ...]
) -> None:
    """param_out may alias grad element for element; any other overlap would let one thread (or
    GPU block) overwrite grads or state that another has yet to read."""
    if _overlap(param_out, grad) and (
        param_out.data_ptr() != grad.data_ptr() or param_out.element_size() != grad.element_size()
    ):
        raise ValueError("param_out overlaps grad without aliasing it element for element")
    for name, t in zip(("param", "exp_avg", "exp_avg_sq"), state):
        if _overlap(param_out, t):
            raise ValueError(f"param_out overlaps {name}")


def _is_flat_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dim() == 1 and t.is_contiguous()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a_lo, b_lo = a.data_ptr(), b.data_ptr()
    return a_lo < b_lo + b.numel() * b.element_size() and b_lo < a_lo + a.numel() * a.element_size()
