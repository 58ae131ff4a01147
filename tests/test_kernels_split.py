"""Split masters (kernels/split_masters.py): the torch reference, and the fused CPU kernel's split step
(`FusedCpuAdamW.step_split`) against it.

What is asserted:
- split_masters then join_masters gives every master back bit for bit (a NaN as NaN), and exp_avg_sq
  itself; the bf16 params split_masters returns are the masters rounded to nearest even.
- torch_adamw_step_split on split state steps as torch_adamw_step on the FP32 state: joined masters,
  moments and param_out bit for bit, over several steps.
- the fused split step, for every ISA this CPU has (the others skip, saying what it lacks; test_kernels.py
  checks the detection against /proc/cpuinfo), gives the bits of the reference: torch_adamw_step_split
  with MKL's sqrt (the default where torch has MKL); with the hardware sqrt, the same split around the
  fused scalar path's step (which torch's own step matches only within ulps: see test_kernels.py). low,
  exp_avg, exp_avg_sq (sign bits included) and param_out bit for bit, except where the joined master is
  NaN: there both are NaN (a NaN's bits are not kept: torch writes a bf16 NaN as 0xffff, the kernel as
  0x7fc0), with the moments' magnitudes still bit for bit. For bf16/fp16/fp32 grads, param_out aliasing
  grad and not, sizes that are no multiple of 16 nor of the kernel's 2048-element blocks, weight decay on
  and off, both branches of torch's lerp, several steps in a row (the lowp of a step is the param_out of
  the last), with ties (low half 0x8000), +-0, +-inf, the largest finites (which round to inf),
  denormals and NaNs planted in the masters at a block's start and end and in the scalar tail.
- the argument checks (check_split_args, and the C++ op's own): one bad argument a case, named.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_offload.kernels import cpu_adamw, torch_adamw_step
from fsdp_offload.kernels.contract import AdamWHyper, check_split_args
from fsdp_offload.kernels.split_masters import join_masters, split_masters, torch_adamw_step_split
from test_kernels import _fused, extension  # noqa: F401 (the fixture, shared with the whole kernel's tests)

GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SIZES = (7, 3 * 2048 + 37, 100_003)  # none a multiple of 16; the largest spans several chunks of blocks
# Master bits planted: ties (low half 0x8000) below an even and an odd high half, of both signs, and beside
# them; +-0; +-inf; the largest finites and a tie below inf (round up to inf); denormals, ties among them
# and the largest (rounds up to the smallest normal); NaNs (quiet, negative, signalling, payloads); and
# huge ties that a step of lr 1e-3 without weight decay leaves as they are.
SPECIAL_BITS = (
    0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x3F807FFF, 0x3F808001, 0xBF817FFF,
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000,
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7E8000, 0xFF7F8000,
    0x00000001, 0x80000001, 0x00008000, 0x00018000, 0x8000FFFF, 0x007FFFFF, 0x807FFFFF, 0x007F8000,
    0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFF812345,
    0x70008000, 0xF0018000, 0x70017FFF,
)  # fmt: skip
# (lr, weight_decay, grad_scale, beta1, param_out aliases grad): the first step, of lr 0, takes every
# master (ties included) through the join and the split unchanged; beta1 = 0.3 takes the lerp's
# |w| >= 0.5 branch.
STEPS = (
    (0.0, 0.0, 1.0, 0.9, True),
    (1e-3, 0.0, 1.0, 0.9, False),
    (1e-3, 0.1, 0.37, 0.9, True),
    (1e-2, 0.1, 1 / 1024, 0.3, False),
    (1e-3, 0.0, 3.0, 0.9, True),
)
HYPER = dict(beta2=0.999, eps=1e-8)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _masters(n: int, seed: int) -> torch.Tensor:
    """Random FP32 masters of mixed magnitudes, SPECIAL_BITS planted at the start, across the first
    block boundary and at the end."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-20, 20, (n,), generator=gen).float())
    special = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in SPECIAL_BITS], dtype=torch.int32)
    for at in (0, 2048 - len(special) // 2, n - len(special)):
        if at >= 0 and at + len(special) <= n:
            master.view(torch.int32)[at : at + len(special)] = special
    if n < len(special):
        master.view(torch.int32)[:] = special[:n]
    return master


def _split_state(n: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """([low, exp_avg, exp_avg_sq], lowp, FP32 master) of the masters above, with random moments."""
    gen = torch.Generator().manual_seed(seed + 1)
    master = _masters(n, seed)
    exp_avg, exp_avg_sq = torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-6
    low = torch.empty(n, dtype=torch.int16)
    lowp = split_masters(master, low, exp_avg_sq)
    return [low, exp_avg, exp_avg_sq], lowp, master


def _joined(state: list[torch.Tensor], lowp: torch.Tensor) -> torch.Tensor:
    """The masters of split state, leaving the state as it is."""
    master = torch.empty(lowp.numel())
    join_masters(state[0], lowp, state[2].clone(), master)
    return master


def _assert_bits(got: torch.Tensor, want: torch.Tensor, what: str, where: torch.Tensor | None = None) -> None:
    diff = _bits(got) != _bits(want)
    if where is not None:
        diff &= where
    first = diff.nonzero()[:5].flatten().tolist()
    assert not diff.any(), f"{what}: {int(diff.sum())} of {want.numel()} elements differ, first at {first}"


def _assert_same_split_state(step, ref, got, ref_lowp, got_lowp) -> None:
    """Bit for bit but where the joined master is NaN; there NaN on both, and the moments' magnitudes."""
    ref_master, got_master = _joined(ref, ref_lowp), _joined(got, got_lowp)
    nan = ref_master.isnan()
    assert torch.equal(got_master.isnan(), nan), f"NaN masters differ at step {step}"
    ok = ~nan
    _assert_bits(got_master, ref_master, f"master at step {step}", ok)
    _assert_bits(got[0], ref[0], f"low at step {step}", ok)
    _assert_bits(got[1], ref[1], f"exp_avg at step {step}")
    _assert_bits(got[2], ref[2], f"exp_avg_sq at step {step}", ok)
    _assert_bits(got[2].abs(), ref[2].abs(), f"|exp_avg_sq| at step {step}")
    _assert_bits(got_lowp, ref_lowp, f"param_out at step {step}", ok)


def _run_split_pair(kernel, reference, n: int, grad_dtype: torch.dtype, seed: int):
    """Steps split state with `reference` and with `kernel` (both of torch_adamw_step_split's signature)
    side by side, each taking its own param_out of the last step as lowp; yields both after every step."""
    ref, ref_lowp, _ = _split_state(n, seed)
    got, got_lowp = [t.clone() for t in ref], ref_lowp.clone()
    gen = torch.Generator().manual_seed(seed + 2)
    for step, (lr, weight_decay, grad_scale, beta1, alias) in enumerate(STEPS, 1):
        grad = (torch.randn(n, generator=gen) * 1e-2).to(grad_dtype)
        hyper = AdamWHyper(lr=lr, beta1=beta1, weight_decay=weight_decay, step=step, grad_scale=grad_scale, **HYPER)
        ref_out = torch.empty(n, dtype=torch.bfloat16)
        reference(*ref, grad, ref_lowp, ref_out, hyper)
        got_grad = grad.clone()  # its own: aliased, the kernel writes the new params over it
        if alias and grad_dtype != torch.float32:
            got_out = got_grad.view(torch.bfloat16)
        else:
            got_out = torch.empty(n, dtype=torch.bfloat16)
        kernel(*got, got_grad, got_lowp, got_out, hyper)
        ref_lowp, got_lowp = ref_out, got_out
        yield step, ref, got, ref_lowp, got_lowp


def _split_around(step_fn):
    """torch_adamw_step_split with `step_fn` (torch_adamw_step's signature) for the step."""

    def step_split(low, exp_avg, exp_avg_sq, grad, lowp, param_out, hyper) -> None:
        master = torch.empty(low.numel())
        join_masters(low, lowp, exp_avg_sq, master)
        step_fn(master, exp_avg, exp_avg_sq, grad, param_out, hyper)
        split_masters(master, low, exp_avg_sq)

    return step_split


# ---- the reference ----


@pytest.mark.parametrize("n", (1, 7, len(SPECIAL_BITS), 3 * 2048 + 37))
def test_split_then_join_gives_the_masters_back(n: int) -> None:
    master = _masters(n, seed=n)
    exp_avg_sq = torch.rand(n) * 1e-6
    v = exp_avg_sq.clone()
    low = torch.empty(n, dtype=torch.int16)
    lowp = split_masters(master, low, v)
    _assert_bits(lowp, master.to(torch.bfloat16), "lowp")
    assert (v < 0).any() or n < 8, "no master rounded up: the rounded-up bits are untested"
    joined = torch.empty(n)
    join_masters(low, lowp, v, joined)
    nan = master.isnan()
    assert torch.equal(joined.isnan(), nan)
    _assert_bits(joined, master, "joined masters", ~nan)
    _assert_bits(v, exp_avg_sq, "exp_avg_sq after the join")


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_reference_steps_as_the_fp32_path(grad_dtype: torch.dtype) -> None:
    n = 3 * 2048 + 37
    split, lowp, master = _split_state(n, seed=3)
    fp32 = [master.clone(), split[1].clone(), split[2].abs()]  # the FP32 state (sign bits cleared)
    gen = torch.Generator().manual_seed(4)
    for step, (lr, weight_decay, grad_scale, beta1, _) in enumerate(STEPS, 1):
        grad = (torch.randn(n, generator=gen) * 1e-2).to(grad_dtype)
        hyper = AdamWHyper(lr=lr, beta1=beta1, weight_decay=weight_decay, step=step, grad_scale=grad_scale, **HYPER)
        fp32_out, split_out = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
        torch_adamw_step(*fp32, grad, fp32_out, hyper)
        torch_adamw_step_split(*split, grad, lowp, split_out, hyper)
        lowp = split_out
        joined = _joined(split, lowp)
        nan = fp32[0].isnan()
        assert torch.equal(joined.isnan(), nan), f"NaN masters differ at step {step}"
        _assert_bits(joined, fp32[0], f"master at step {step}", ~nan)
        _assert_bits(split[1], fp32[1], f"exp_avg at step {step}")
        _assert_bits(split[2].abs(), fp32[2], f"exp_avg_sq at step {step}")
        _assert_bits(split_out, fp32_out, f"param_out at step {step}")


# ---- the fused split step ----


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("isa", cpu_adamw.ISAS)
def test_fused_split_bit_exact(extension, isa: str, grad_dtype: torch.dtype, n: int) -> None:
    """The default sqrt (MKL's where torch has it, as torch.sqrt's) against torch_adamw_step_split."""
    kernel = _fused(extension, isa)
    for pair in _run_split_pair(kernel.step_split, torch_adamw_step_split, n, grad_dtype, seed=n):
        _assert_same_split_state(*pair)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("isa", cpu_adamw.ISAS)
def test_fused_split_hardware_sqrt_bit_exact(extension, isa: str, grad_dtype: torch.dtype, n: int) -> None:
    """With the hardware sqrt: the bits of the split reference around the fused scalar path's step."""
    kernel = _fused(extension, isa, mkl_sqrt=False)
    reference = _split_around(cpu_adamw.load_fused_adamw("scalar", mkl_sqrt=False))
    for pair in _run_split_pair(kernel.step_split, reference, n, grad_dtype, seed=n):
        _assert_same_split_state(*pair)


@pytest.mark.parametrize("isa", cpu_adamw.ISAS)
def test_a_param_written_behind_the_optimizer_is_its_master(extension, isa: str) -> None:
    """Params that the masters do not round to (written since the split): the reference and the fused
    step take the param's value as the master, bit for bit, so an lr of 0 leaves each master the param."""
    kernel, n = _fused(extension, isa), 3 * 2048 + 37
    state, lowp, _ = _split_state(n, seed=9)
    written = lowp.clone()
    written[::3] = torch.randn(len(written[::3])).bfloat16()  # a third written; some may still match
    written[1::3] = 0.0
    ref, got = [t.clone() for t in state], [t.clone() for t in state]
    hyper = AdamWHyper(lr=0.0, beta1=0.9, weight_decay=0.0, step=1, **HYPER)
    grad = torch.randn(n).bfloat16()
    ref_out, got_out = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    torch_adamw_step_split(*ref, grad, written, ref_out, hyper)
    kernel.step_split(*got, grad, written, got_out, hyper)
    _assert_same_split_state(1, ref, got, ref_out, got_out)
    masters = _joined(ref, ref_out)
    finite = written.float().isfinite()
    assert masters[finite].isfinite().all()  # a written 0 less a rounding bit is no NaN
    assert torch.equal(ref_out.float()[finite], written.float()[finite])  # lr 0: each master rounds to what was written (-0 to +0)


def test_fused_split_of_nothing(extension) -> None:
    empty = [torch.empty(0, dtype=torch.int16), torch.empty(0), torch.empty(0)]
    bf16 = torch.empty(0, dtype=torch.bfloat16)
    cpu_adamw.load_fused_adamw().step_split(*empty, bf16, bf16.clone(), bf16.clone(), AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, 1))


# ---- the argument checks ----


def _good_args(n: int = 64) -> dict:
    return dict(low=torch.zeros(n, dtype=torch.int16), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n),
                grad=torch.zeros(n, dtype=torch.bfloat16), lowp=torch.zeros(n, dtype=torch.bfloat16),
                param_out=torch.zeros(n, dtype=torch.bfloat16))  # fmt: skip


def _fp32_grad_under_param_out(a: dict) -> dict:
    grad = torch.zeros(64)
    return dict(a, grad=grad, param_out=grad.view(torch.bfloat16)[:64])


# (what is bad, the change, the message): one bad argument a case
BAD = [
    ("low dtype", lambda a: dict(a, low=a["low"].int()), "low must be a 1-D contiguous int16 tensor"),
    ("low strided", lambda a: dict(a, low=torch.zeros(128, dtype=torch.int16)[::2]), "low must be"),
    ("exp_avg dtype", lambda a: dict(a, exp_avg=a["exp_avg"].double()), "exp_avg must be a 1-D contiguous float32"),
    ("exp_avg device", lambda a: dict(a, exp_avg=torch.zeros(64, device="meta")), "exp_avg must be .* on low's cpu device"),
    ("exp_avg_sq length", lambda a: dict(a, exp_avg_sq=a["exp_avg_sq"][:32]), "exp_avg_sq has 32 elements, low has 64"),
    ("grad dtype", lambda a: dict(a, grad=a["grad"].double()), "grad must be a 1-D contiguous bfloat16/float16/float32"),
    ("grad 2-D", lambda a: dict(a, grad=a["grad"].view(8, 8)), "grad must be"),
    ("lowp dtype", lambda a: dict(a, lowp=a["lowp"].half()), "lowp must be a 1-D contiguous bfloat16"),
    ("lowp length", lambda a: dict(a, lowp=a["lowp"][:63]), "lowp has 63 elements, low has 64"),
    ("lowp not a tensor", lambda a: dict(a, lowp=None), "lowp must be a tensor"),
    ("param_out missing", lambda a: dict(a, param_out=None), "param_out is required"),
    ("param_out dtype", lambda a: dict(a, param_out=a["param_out"].half()), "param_out must be a 1-D contiguous bfloat16"),
    ("param_out over an fp32 grad", _fp32_grad_under_param_out, "param_out overlaps grad without aliasing"),
    ("param_out on lowp", lambda a: dict(a, param_out=a["lowp"]), "param_out overlaps lowp"),
    ("param_out on low", lambda a: dict(a, param_out=a["low"].view(torch.bfloat16)), "param_out overlaps low"),
    ("param_out in exp_avg_sq", lambda a: dict(a, param_out=a["exp_avg_sq"].view(torch.bfloat16)[32:96]), "overlaps exp_avg_sq"),
    ("lowp on exp_avg", lambda a: dict(a, lowp=a["exp_avg"].view(torch.bfloat16)[:64]), "lowp overlaps exp_avg"),
    ("lowp on low", lambda a: dict(a, lowp=a["low"].view(torch.bfloat16)), "lowp overlaps low"),
]  # fmt: skip


@pytest.mark.parametrize("change, message", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_check_split_args_names_the_bad_argument(change, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_split_args(**change(_good_args()), device_type="cpu")


def test_good_arguments_pass_and_param_out_may_alias_grad() -> None:
    check_split_args(**_good_args(), device_type="cpu")
    a = _good_args()
    check_split_args(**dict(a, param_out=a["grad"]), device_type="cpu")
    fp16 = torch.zeros(64, dtype=torch.float16)
    check_split_args(**dict(a, grad=fp16, param_out=fp16.view(torch.bfloat16)), device_type="cpu")
    with pytest.raises(ValueError, match="low must be .* on low's cuda device"):
        check_split_args(**a, device_type="cuda")


def test_fused_split_refuses_bad_arguments(extension) -> None:
    kernel = cpu_adamw.load_fused_adamw()
    hyper = AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
    for _, change, message in BAD:
        a = change(_good_args())
        with pytest.raises(ValueError, match=message):
            kernel.step_split(a["low"], a["exp_avg"], a["exp_avg_sq"], a["grad"], a["lowp"], a["param_out"], hyper)
    # the op's own checks, for callers that skip the Python ones
    scalars = (1.0, 1.0, 0.1, 0.999, 1e-3, 1.0, 1e-8, -1e-3, kernel.isa, kernel.mkl_sqrt)
    for name, change in (("low", lambda a: dict(a, low=a["low"].int())), ("lowp", lambda a: dict(a, lowp=a["lowp"].half())),
                         ("param_out", lambda a: dict(a, param_out=a["param_out"][:32])),
                         ("grad", lambda a: dict(a, grad=a["grad"].double()))):  # fmt: skip
        a = change(_good_args())
        with pytest.raises(RuntimeError, match=f"{name} must be a contiguous"):
            extension.adamw_step_split(a["low"], a["exp_avg"], a["exp_avg_sq"], a["grad"], a["lowp"], a["param_out"], *scalars)
