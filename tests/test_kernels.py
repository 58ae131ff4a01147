"""AdamW kernels against the pure-torch path (kernels/torch_adamw.py).

What is asserted:
- fused CPU kernel, every ISA this CPU has, default sqrt: bit-exact (params, both moments, param_out),
  for bf16/fp16/fp32 grads, odd sizes, weight decay on and off, grad_scale != 1, both branches of
  torch's lerp formula, several steps, param_out aliasing grad.
- fused CPU kernel with the hardware sqrt (what it uses where torch has no MKL, while torch's sqrt here
  is MKL's and 1 ulp off in about 1 element in 150): moments bit-exact; params within
  2 * steps * ulp(max(|p|, lr)) of the torch path (measured: at most 16 after 10 steps with lr = 0.1,
  at most 5 with lr <= 1e-3).
- Triton kernel (CUDA only): moments bit-exact with the torch path; params and param_out bit-exact
  with the fused CPU kernel with the hardware sqrt, hence within the bound above.
- a failed build falls back to the torch kernel under "auto", says so once, and "fused" raises why.
"""

from __future__ import annotations

import logging

import pytest
import torch

from fsdp_offload import kernels
from fsdp_offload.kernels import cpu_adamw, get_adamw_kernel, torch_adamw_step

SIZES = (1, 7, 1_000_003)
GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (weight_decay, grad_scale, beta1, param_out): beta1 = 0.3 takes the lerp's |w| >= 0.5 branch
CONFIGS = (
    (0.0, 1.0, 0.9, "alias"),
    (0.1, 0.37, 0.9, "separate"),
    (0.1, 1 / 1024, 0.3, "alias"),
    (0.01, 3.0, 0.9, "none"),
)
STEPS_PER_CONFIG = 2
HYPER = dict(lr=1e-3, beta2=0.999, eps=1e-8)


@pytest.fixture(scope="module")
def extension():
    missing = cpu_adamw.missing_toolchain()
    if missing is not None:
        pytest.skip(f"fused CPU AdamW cannot be built here: {missing}")
    return cpu_adamw.load_extension()  # a build failure with a toolchain present is a test failure


def _state(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)]


def _grad(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(n, generator=gen) * 1e-2).to(dtype)


def _out_dtype(grad_dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if grad_dtype == torch.float32 else grad_dtype


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    diff = int((_bits(got) != _bits(want)).sum())
    assert diff == 0, f"{what}: {diff} of {want.numel()} elements differ"


def _ulps_of_scale(got: torch.Tensor, want: torch.Tensor, floor: float) -> float:
    """max |got - want| in units of ulp(max(|want|, floor)): a param near 0 moves by updates of size
    ~lr, so that is the scale its rounding differences live at."""
    scale = torch.clamp(want.double().abs(), min=floor)
    ulp = torch.exp2(torch.floor(torch.log2(scale)) - 23)
    return float(((got.double() - want.double()).abs() / ulp).max())


def _run_pair(kernel, n: int, grad_dtype: torch.dtype, seed: int):
    """Runs the torch path and `kernel` side by side; yields both states after every step."""
    ref, got = _state(n, seed), _state(n, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    step = 0
    for weight_decay, grad_scale, beta1, out_mode in CONFIGS:
        for _ in range(STEPS_PER_CONFIG):
            step += 1
            grad = _grad(n, grad_dtype, gen)
            kw = dict(HYPER, beta1=beta1, weight_decay=weight_decay, step=step, grad_scale=grad_scale)
            got_grad = grad.clone()  # its own: with out_mode "alias" the kernel writes the new params over it
            ref_out = torch.empty(n, dtype=_out_dtype(grad_dtype))
            torch_adamw_step(*ref, grad, ref_out, **kw)
            if out_mode == "alias" and grad_dtype != torch.float32:
                got_out = got_grad
            elif out_mode == "none":
                got_out, ref_out = None, None
            else:
                got_out = torch.empty(n, dtype=_out_dtype(grad_dtype))
            kernel(*got, got_grad, got_out, **kw)
            yield step, ref, got, ref_out, got_out


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("isa", cpu_adamw.ISAS)
def test_fused_bit_exact(extension, isa: str, grad_dtype: torch.dtype, n: int) -> None:
    if not extension.isa_supported(isa):
        pytest.skip(f"this CPU has no {isa}")
    kernel = cpu_adamw.load_fused_adamw(isa)
    for step, ref, got, ref_out, got_out in _run_pair(kernel, n, grad_dtype, seed=n):
        for name, r, g in zip(("param", "exp_avg", "exp_avg_sq"), ref, got):
            _assert_same_bits(g, r, f"{name} at step {step}")
        if ref_out is not None:
            _assert_same_bits(got_out, ref_out, f"param_out at step {step}")


@pytest.mark.parametrize("lr", [1e-3, 0.1])
def test_fused_hardware_sqrt_ulp_bound(extension, lr: float) -> None:
    """Moments bit-exact; params within 2 * steps * ulp(max(|p|, lr)) (see module docstring)."""
    if not extension.has_mkl_sqrt():
        pytest.skip("torch has no MKL here: the hardware sqrt is the default, tested bit-exact above")
    kernel = cpu_adamw.load_fused_adamw(mkl_sqrt=False)
    hyper = dict(HYPER, lr=lr)
    ref, got = _state(1_000_003, 0), _state(1_000_003, 0)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 11):
        grad = _grad(ref[0].numel(), torch.bfloat16, gen)
        kw = dict(hyper, beta1=0.9, weight_decay=0.1, step=step)
        torch_adamw_step(*ref, grad, None, **kw)
        kernel(*got, grad, None, **kw)
        _assert_same_bits(got[1], ref[1], f"exp_avg at step {step}")
        _assert_same_bits(got[2], ref[2], f"exp_avg_sq at step {step}")
        worst = _ulps_of_scale(got[0], ref[0], lr)
        assert worst <= 2 * step, f"param {worst} ulps off at step {step} (bound {2 * step})"


def test_fused_rejects_bad_arguments(extension) -> None:
    kernel = cpu_adamw.load_fused_adamw()
    n = 64
    p, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    g = torch.zeros(n, dtype=torch.bfloat16)
    kw = dict(HYPER, beta1=0.9, weight_decay=0.0, step=1)
    with pytest.raises(ValueError, match="exp_avg must be"):
        kernel(p, m.double(), v, g, None, **kw)
    with pytest.raises(ValueError, match="exp_avg_sq has 32 elements"):
        kernel(p, m, v[:32], g, None, **kw)
    with pytest.raises(ValueError, match="grad must be"):
        kernel(p, m, v, torch.zeros(2 * n, dtype=torch.bfloat16)[::2], None, **kw)
    with pytest.raises(ValueError, match="param_out must be"):
        kernel(p, m, v, g, torch.zeros(n), **kw)
    g32 = torch.zeros(n)
    with pytest.raises(ValueError, match="without aliasing"):
        kernel(p, m, v, g32, g32.view(torch.bfloat16)[:n], **kw)
    with pytest.raises(ValueError, match="overlaps param"):
        kernel(p, m, v, g, p.view(torch.bfloat16)[:n], **kw)


def test_auto_picks_fused_when_it_builds(extension) -> None:
    name, kernel = get_adamw_kernel("auto")
    assert name == "fused" and isinstance(kernel, cpu_adamw.FusedCpuAdamW)


def test_fallback_when_build_fails(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/bogus-c++")
    monkeypatch.setattr(cpu_adamw, "_extension", None)
    monkeypatch.setattr(cpu_adamw, "_build_error", None)
    monkeypatch.setattr(kernels, "_fallback_reported", False)
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        for _ in range(3):
            assert get_adamw_kernel("auto") == ("torch", torch_adamw_step)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "bogus-c++" in warnings[0].getMessage()
    with pytest.raises(RuntimeError, match="not available: no C\\+\\+ compiler.*bogus-c\\+\\+"):
        get_adamw_kernel("fused")


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _triton_available(), reason="needs CUDA and triton")
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_triton_matches(extension, grad_dtype: torch.dtype, n: int) -> None:
    from fsdp_offload.kernels.triton_adamw import triton_adamw_step

    hw_sqrt = cpu_adamw.load_fused_adamw(mkl_sqrt=False)
    ref, cpu = _state(n, n), _state(n, n)
    gpu = [t.cuda() for t in _state(n, n)]
    gen = torch.Generator().manual_seed(n + 1)
    step = 0
    for weight_decay, grad_scale, beta1, out_mode in CONFIGS:
        for _ in range(STEPS_PER_CONFIG):
            step += 1
            grad = _grad(n, grad_dtype, gen)
            kw = dict(HYPER, beta1=beta1, weight_decay=weight_decay, step=step, grad_scale=grad_scale)
            out_dtype = _out_dtype(grad_dtype)
            gpu_grad = grad.cuda()
            cpu_out = torch.empty(n, dtype=out_dtype)
            hw_sqrt(*cpu, grad, cpu_out, **kw)
            torch_adamw_step(*ref, grad, None, **kw)
            alias = out_mode == "alias" and grad_dtype != torch.float32
            gpu_out = gpu_grad if alias else torch.empty(n, dtype=out_dtype, device="cuda")
            triton_adamw_step(*gpu, gpu_grad, gpu_out, **kw)
            got = [t.cpu() for t in gpu]
            _assert_same_bits(got[1], ref[1], f"exp_avg at step {step}")
            _assert_same_bits(got[2], ref[2], f"exp_avg_sq at step {step}")
            _assert_same_bits(got[0], cpu[0], f"param vs fused CPU (hardware sqrt) at step {step}")
            _assert_same_bits(gpu_out.cpu(), cpu_out, f"param_out at step {step}")
            assert _ulps_of_scale(got[0], ref[0], HYPER["lr"]) <= 2 * step
