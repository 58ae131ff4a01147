"""Fused CPU AdamW: cpu_adamw.cpp (the arithmetic) and cpu_adamw_ops.cpp (threads, argument checks,
bindings), built together on first use with torch.utils.cpp_extension.

One pass over a segment reads the bf16/fp16/fp32 grad and the FP32 param/exp_avg/exp_avg_sq and writes
the FP32 state and the low-precision params, with AVX-512, AVX2 or plain scalar code over OpenMP
threads. Its results are bit-identical to `torch_adamw_step` on this torch build: the C++ repeats
torch's CPU arithmetic op for op, including torch's MKL sqrt (see the top of cpu_adamw.cpp). All three
instruction sets give the same bits. `step_split` is the same step on split masters
(kernels/split_masters.py), bit-identical to `torch_adamw_step_split`. The build is cached in torch's
extensions directory ($TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions); an edit to any of
SOURCES rebuilds it at the next load (see `build_flags`).

The instruction set is the best this CPU has unless one is asked for: `load_fused_adamw(isa="avx2")`,
or for the default of a whole process (a benchmark, a training run), $FSDP_OFFLOAD_CPU_ISA=avx2. Either
refuses, with ValueError, an ISA the CPU lacks.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shlex
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch

from .contract import AdamWHyper, check_adamw_args, check_split_args

log = logging.getLogger(__name__)
Tensor = torch.Tensor

# Every file the build reads: cpp_extension compiles each and links them into one module.
SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_adamw.cpp", "cpu_adamw_ops.cpp"))
EXTENSION_NAME = "fsdp_offload_cpu_adamw"
ISAS = ("avx512", "avx2", "scalar")  # best first
# What each ISA needs of the CPU (what cpu_adamw.cpp's isa_supported checks).
ISA_FEATURES = {"avx512": ("avx512f", "avx512bw"), "avx2": ("avx2", "fma", "f16c"), "scalar": ()}
ISA_ENV = "FSDP_OFFLOAD_CPU_ISA"  # the default ISA of load_fused_adamw, read on each call
# No -ffast-math, and no FMA contraction: the C++ writes each FMA that torch's kernels have, no other.
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]
SOURCES_DIGEST_MACRO = "FSDP_OFFLOAD_CPU_ADAMW_SOURCES"

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


def build_directory() -> str:
    """Where the kernel is built: under torch's extensions root ($TORCH_EXTENSIONS_DIR), one dir per
    Python environment and torch version, so switching virtual environments does not rebuild it."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    env = hashlib.sha1(f"{sys.prefix}|{sys.version}|{torch.__version__}".encode()).hexdigest()[:10]
    path = os.path.join(root, f"{EXTENSION_NAME}-{env}")
    os.makedirs(path, exist_ok=True)
    return path


BUILD_LOCK_WAIT_S = 900.0  # a build takes about 30 s; one that holds the lock this long is stuck
QUIET_WAIT_S = 5.0  # another rank loading the built kernel holds the lock well under this


@contextlib.contextmanager
def build_lock(build_dir: str, wait_s: float = BUILD_LOCK_WAIT_S) -> Iterator[None]:
    """Holds the kernel's build dir for this process while torch checks or builds the kernel there.

    torch's own lock there is a plain file (`lock`, its FileBaton) that a process killed while holding
    it leaves behind, and every later load then waits for it forever, saying nothing. An flock dies
    with its holder: every load of ours takes it first, so a `lock` file found while holding it was left
    by a dead process and is removed. A live holder is waited for at most `wait_s`, said once if it
    holds the lock longer than a load of a built kernel takes (the ranks of a node all load it at once)."""
    path = os.path.join(build_dir, "build.flock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        began = time.monotonic()
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - began
                if waited > wait_s:
                    raise RuntimeError(f"another process has held {path} for over {wait_s:.0f} s while building the "
                                       "kernel: end it, or set $TORCH_EXTENSIONS_DIR to another dir") from None  # fmt: skip
                if not said and waited > QUIET_WAIT_S:
                    log.warning("waiting for another process building the fused CPU AdamW kernel (%s)", path)
                    said = True
                time.sleep(0.1)
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            log.warning("removing %s, left by a process killed while building the kernel", stale)
            os.remove(stale)
        yield
    finally:
        os.close(fd)  # releases the flock


def build_flags() -> list[str]:
    """CFLAGS and a digest of SOURCES' contents (a macro that nothing reads), so that an edit to any source
    rebuilds the kernel at the next load, whatever the files' times. torch's JIT build rebuilds on its
    own when, in one process, the contents of `sources` change, and in a new process when ninja finds a
    source newer than its object (or a header newer, from the compiler's dependency files); a source
    that comes with an older time (a wheel installed over an older build, a copy that keeps times) would
    be missed. With the digest in the flags, ninja sees a new command line and rebuilds."""
    digest = hashlib.sha1()
    for source in SOURCES:
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return [*CFLAGS, f"-D{SOURCES_DIGEST_MACRO}={digest.hexdigest()[:16]}"]


def _build() -> ModuleType:
    missing = missing_toolchain()
    if missing is not None:
        raise RuntimeError(missing)
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    build_dir = build_directory()
    fresh = not list(Path(build_dir).glob(f"{EXTENSION_NAME}*.so"))
    if fresh:  # said once: the first use on a machine compiles for tens of seconds
        log.warning("building the fused CPU AdamW kernel with %s into %s (first use on this machine, about 30 s; "
                    "$TORCH_EXTENSIONS_DIR moves it, offload.kernel=torch skips it)", cxx, build_dir)  # fmt: skip
    start = time.perf_counter()
    try:
        with build_lock(build_dir):
            module = cpp_extension.load(
                name=EXTENSION_NAME,
                sources=[str(source) for source in SOURCES],
                extra_cflags=build_flags(),
                extra_ldflags=["-fopenmp"],
                build_directory=build_dir,
                verbose=False,
            )
    except Exception as exc:
        names = " and ".join(str(source) for source in SOURCES)
        raise RuntimeError(f"building {names} with {cxx} failed: {exc}") from exc
    if fresh:
        log.warning("built the fused CPU AdamW kernel in %.0f s", time.perf_counter() - start)
    return module


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


def _scalars(hyper: AdamWHyper) -> tuple[float, ...]:
    """The kernel's scalars, from the same double arithmetic as torch_adamw_step (the C++ casts each to
    float): grad_scale, decay, lerp weight, beta2, 1 - beta2, sqrt(bias correction 2), eps, -step_size."""
    step_size, bias_correction2_sqrt = hyper.scalars()
    return (
        float(hyper.grad_scale), 1 - hyper.lr * hyper.weight_decay, 1 - hyper.beta1, float(hyper.beta2), 1 - hyper.beta2,
        bias_correction2_sqrt, float(hyper.eps), -step_size,
    )  # fmt: skip


class FusedCpuAdamW:
    """A kernel with the signature of `torch_adamw_step`, bound to one instruction set; `step_split` is
    `torch_adamw_step_split`'s."""

    def __init__(self, extension: ModuleType, isa: str, mkl_sqrt: bool) -> None:
        self._extension = extension
        self.isa = isa
        # True: MKL's sqrt, as torch.sqrt, so bit-exact; False: hardware sqrt, correctly rounded.
        self.mkl_sqrt = mkl_sqrt

    def __repr__(self) -> str:
        return f"FusedCpuAdamW(isa={self.isa!r}, mkl_sqrt={self.mkl_sqrt})"

    def __call__(self, param: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, grad: Tensor, param_out: Tensor | None, hyper: AdamWHyper) -> None:
        check_adamw_args(param, exp_avg, exp_avg_sq, grad, param_out, "cpu")
        self._extension.adamw_step(param, exp_avg, exp_avg_sq, grad, param_out, *_scalars(hyper), self.isa, self.mkl_sqrt)

    def step_split(self, low: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, grad: Tensor, lowp: Tensor, param_out: Tensor, hyper: AdamWHyper) -> None:
        """`torch_adamw_step_split` (kernels/split_masters.py), bit for bit: the masters joined from `low`
        (int16, rewritten), the model's bf16 params `lowp` (read only) and `exp_avg_sq`'s sign bits, a block
        at a time in cache, stepped, the new bf16 params written to `param_out` (which may alias `grad`
        element for element, not `lowp`), and split again. A NaN master may differ from the reference's in
        its bits (param_out's NaN is 0x7fc0 here, torch's conversion writes 0xffff), never in being NaN."""
        check_split_args(low, exp_avg, exp_avg_sq, grad, lowp, param_out, "cpu")
        self._extension.adamw_step_split(low, exp_avg, exp_avg_sq, grad, lowp, param_out, *_scalars(hyper), self.isa, self.mkl_sqrt)


def supported_isas() -> tuple[str, ...]:
    """The ISAs this CPU can run, best first (builds the extension once)."""
    extension = load_extension()
    return tuple(isa for isa in ISAS if extension.isa_supported(isa))


def load_fused_adamw(isa: str | None = None, mkl_sqrt: bool | None = None) -> FusedCpuAdamW:
    """Builds (once) and returns the fused kernel.

    `isa` (avx512 | avx2 | scalar) defaults to $FSDP_OFFLOAD_CPU_ISA, else to the best this CPU has;
    one the CPU lacks raises ValueError. `mkl_sqrt` defaults to True when torch has MKL (then results
    are bit-exact with the torch path). Raises RuntimeError saying why when the extension cannot be
    built, or when MKL's sqrt is asked for and torch has none.
    """
    extension = load_extension()
    source = "isa"
    if isa is None and os.environ.get(ISA_ENV):
        isa, source = os.environ[ISA_ENV], f"${ISA_ENV}"
    if isa is None:
        isa = extension.best_isa()
    if isa not in ISAS:
        raise ValueError(f"{source}={isa!r} is no ISA of the fused CPU AdamW: choose {', '.join(ISAS)}")
    if not extension.isa_supported(isa):
        raise ValueError(
            f"{source}={isa!r}: this CPU lacks the {isa} instructions (needs {' '.join(ISA_FEATURES[isa])}); "
            f"it has {', '.join(supported_isas())}: pick one of those, or leave it unset for the best"
        )
    has_mkl = extension.has_mkl_sqrt()
    if mkl_sqrt and not has_mkl:
        raise RuntimeError("this torch build has no MKL (libtorch_cpu exports no vmsSqrt)")
    return FusedCpuAdamW(extension, isa, has_mkl if mkl_sqrt is None else mkl_sqrt)
