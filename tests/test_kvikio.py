"""KvikioTier: a clear error where KvikIO cannot run; on a GPU machine, PosixTier's contract.

The tier needs the CUDA driver even for host buffers, so every I/O test here skips off-GPU.
"""

from __future__ import annotations

import errno
import os
import sys
import types

import pytest
import torch

from fsdp_offload import OffloadConfig
from fsdp_offload.cache import aligned_host_buffer, host_buffer, unpin
from fsdp_offload.storage import CorruptSubgroupError, TierError, Transfer, make_tier
from fsdp_offload.storage import kvikio as kvikio_tier

from test_optimizer import SG, assert_same_as_reference, budget_for, run_pair, step_lr

pytestmark = pytest.mark.gpu  # keeps the GPU visible to what it starts (conftest.py)
gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="KvikIO needs the CUDA driver (libcuda.so.1) and a GPU, even for host buffers"
)

CHUNK = 64 << 10  # task_mb below: small so that each subgroup is several chunks
SLOTS = [3 * CHUNK + 4096, CHUNK, 5 * CHUNK]  # the first ends in a short chunk


def spec(path) -> str:
    return f"kvikio:{path}?threads=3&task_mb={CHUNK / 2**20}"


def test_bad_options_fail_before_kvikio_is_needed(tmp_path):
    with pytest.raises(ValueError, match="unknown option.*'request_mb'"):
        make_tier(f"kvikio:{tmp_path}?request_mb=8")
    with pytest.raises(ValueError, match="threads must be >= 1"):
        make_tier(f"kvikio:{tmp_path}?threads=0")
    with pytest.raises(ValueError, match="multiple of 4096"):
        make_tier(f"kvikio:{tmp_path}?task_mb=0.001")


def test_no_cuda_driver_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(kvikio_tier, "_cuda_driver_error", lambda: "libcuda.so.1: cannot open shared object file")
    with pytest.raises(TierError, match=rf"kvikio:{tmp_path}: KvikIO cannot do I/O, not even host I/O .*libcuda\.so\.1"):
        make_tier(f"kvikio:{tmp_path}")


def test_no_kvikio_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(kvikio_tier, "_cuda_driver_error", lambda: None)
    monkeypatch.setitem(sys.modules, "kvikio", None)  # makes `import kvikio` fail as if not installed
    with pytest.raises(TierError, match=rf"kvikio:{tmp_path}: the kvikio tier needs KvikIO: pip install fsdp-offload\[gds\]"):
        make_tier(f"kvikio:{tmp_path}")


def test_this_machine_gives_the_clear_error(tmp_path):
    try:
        import kvikio  # noqa: F401

        has_kvikio = True
    except ImportError:
        has_kvikio = False
    if has_kvikio and torch.cuda.is_available():
        pytest.skip("KvikIO and CUDA are both here: the tier builds")
    with pytest.raises(TierError, match=r"libcuda\.so\.1|pip install fsdp-offload\[gds\]"):
        make_tier(f"kvikio:{tmp_path}")


@pytest.fixture
def tier(tmp_path):
    pytest.importorskip("kvikio")
    t = make_tier(spec(tmp_path))
    t.attach("rank0-test", SLOTS)
    yield t
    t.close()


def buffer(memory: str, nbytes: int) -> torch.Tensor:
    """A uint8 buffer of `nbytes` in pageable host, pinned host or CUDA memory."""
    if memory == "cuda":
        return torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return host_buffer(nbytes, pin=True) if memory == "pinned" else aligned_host_buffer(nbytes)


def release(buf: torch.Tensor, memory: str) -> None:
    if memory == "pinned":
        unpin(buf)


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@gpu
@pytest.mark.parametrize("src", ["pageable", "pinned", "cuda"])
@pytest.mark.parametrize("dst", ["pageable", "pinned", "cuda"])
def test_round_trip(tier, src, dst):
    assert isinstance(tier.gds, bool) and tier.mode in ("gds", "compat")
    written = [random_bytes(n, seed=k) for k, n in enumerate(SLOTS)]
    srcs = [buffer(src, n) for n in SLOTS]
    for s, w in zip(srcs, written):
        s.copy_(w)
    # Float32 views too: the tier takes any contiguous dtype, as the optimizer's slots are.
    futs = [tier.write(k, s.view(torch.float32) if k == 1 else s) for k, s in enumerate(srcs)]
    for k, f in enumerate(futs):
        t = f.result()
        assert isinstance(t, Transfer) and (t.tier, t.kind, t.key, t.nbytes) == (tier.spec, "write", k, SLOTS[k])
    dsts = [buffer(dst, n) for n in SLOTS]
    futs = [tier.read(k, d) for k, d in enumerate(dsts)]
    for k, (f, d) in enumerate(zip(futs, dsts)):
        assert f.result().kind == "read"
        assert torch.equal(d.cpu(), written[k]), f"subgroup {k} differs after {src} -> {dst}"
    assert os.stat(tier.path).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(tier.path)).st_mode & 0o777 == 0o700
    for b, memory in [(b, src) for b in srcs] + [(b, dst) for b in dsts]:
        release(b, memory)


@gpu
def test_close_removes_the_file(tmp_path):
    pytest.importorskip("kvikio")
    t = make_tier(spec(tmp_path))
    t.attach("rank0-close", SLOTS)
    path = t.path
    assert os.path.exists(path)
    t.close()
    assert not os.path.exists(path)


@gpu
@pytest.mark.parametrize("memory", ["pinned", "cuda"])
@pytest.mark.parametrize("damage", ["truncate", "corrupt"])
def test_damaged_file_is_reported_with_its_path(tier, memory, damage):
    bufs = [buffer(memory, n) for n in SLOTS]
    for k, b in enumerate(bufs):
        b.copy_(random_bytes(SLOTS[k], seed=k))
        tier.write(k, b).result()
    with open(tier.path, "r+b") as f:
        if damage == "truncate":
            f.truncate(SLOTS[0] + SLOTS[1] + CHUNK + 100)  # subgroup 2 loses its last chunks
        else:
            f.seek(SLOTS[0] + SLOTS[1] + 2 * CHUNK + 1000)  # inside subgroup 2's third chunk
            f.write(b"\xff" * 64)
    wanted = "is truncated" if damage == "truncate" else "is corrupted: checksum mismatch"
    with pytest.raises(CorruptSubgroupError, match=rf"{tier.path}: subgroup 2 {wanted}"):
        tier.read(2, bufs[2]).result()
    tier.read(0, bufs[0]).result()  # the undamaged subgroups still read back
    assert torch.equal(bufs[0].cpu(), random_bytes(SLOTS[0], seed=0))
    for b in bufs:
        release(b, memory)


@gpu
@pytest.mark.parametrize("where", ["all_on_disk", "mixed"])
def test_optimizer_bit_exact_with_posix(tmp_path, where):
    pytest.importorskip("kvikio")
    (tmp_path / "posix").mkdir()
    (tmp_path / "kvikio").mkdir()
    prefetch, slots = {"all_on_disk": (1, 2), "mixed": (2, 6)}[where]

    def config(tier_spec: str) -> OffloadConfig:
        return OffloadConfig(kernel="torch", tiers=[tier_spec], subgroup_numel=SG, prefetch=prefetch, host_budget_gb=budget_for(slots))

    posix_opt, *_ = run_pair(config(f"posix:{tmp_path / 'posix'}"), scheduler=step_lr)
    cfg = config(spec(tmp_path / "kvikio"))
    opt, ref_opt, mine, ref = run_pair(cfg, scheduler=step_lr)
    assert opt.last_metrics.bytes_read[cfg.tiers[0]] > 0  # state really went through KvikIO
    assert_same_as_reference(opt, ref_opt, mine, ref)
    for a, b in zip(opt.state_dict()["state"].values(), posix_opt.state_dict()["state"].values()):
        for name in ("master_param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a[name], b[name]), f"{name} differs between the kvikio and posix tiers"
    opt.close()
    posix_opt.close()


class FakeCuFile:
    """kvikio.CuFile over plain POSIX I/O, whose pwrite fails as KvikIO's does (a RuntimeError, no errno)
    while `failing` is set: the KvikIO tier's error handling, tested without a GPU."""

    failing = False

    def __init__(self, path: str, mode: str) -> None:
        self._fd = os.open(path, os.O_RDWR)

    def fileno(self) -> int:
        return self._fd

    def pwrite(self, buf, size: int, offset: int, task_size: int):
        if FakeCuFile.failing:
            raise RuntimeError("POSIX error at pwrite: Input/output error")
        n = os.pwrite(self._fd, memoryview(buf)[:size], offset)
        return types.SimpleNamespace(get=lambda: n)

    def pread(self, buf, size: int, offset: int, task_size: int):
        n = os.preadv(self._fd, [memoryview(buf)[:size]], offset)
        return types.SimpleNamespace(get=lambda: n)

    def close(self) -> None:
        os.close(self._fd)


@pytest.fixture
def fake_kvikio(monkeypatch):
    """KvikIO in compat mode, faked (FakeCuFile), so that a kvikio: tier builds on a CPU machine."""
    defaults = types.SimpleNamespace(set=lambda settings: None, is_compat_mode_preferred=lambda: True)
    module = types.SimpleNamespace(CuFile=FakeCuFile, defaults=defaults, cufile_driver=types.SimpleNamespace())
    monkeypatch.setattr(kvikio_tier, "_cuda_driver_error", lambda: None)
    monkeypatch.setitem(sys.modules, "kvikio", module)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)
    monkeypatch.setitem(sys.modules, "kvikio.cufile_driver", module.cufile_driver)
    monkeypatch.setattr(FakeCuFile, "failing", False)
    return FakeCuFile


def test_a_failed_write_is_an_oserror_with_its_errno_and_path(tmp_path, fake_kvikio):
    """The pipeline fails over to another tier on an OSError only: a KvikIO tier's I/O errors must be
    OSErrors, as a POSIX tier's are, keeping the errno (EIO where KvikIO gave none) and the file."""
    tier = make_tier(spec(tmp_path))
    tier.attach("rank0-test", SLOTS)
    try:
        buf = aligned_host_buffer(SLOTS[1]).fill_(3)
        fake_kvikio.failing = True
        with pytest.raises(OSError, match=r"writing subgroup 1 \(.* at offset .*\) failed: POSIX error") as caught:
            tier.write(1, buf).result()
        assert caught.value.errno == errno.EIO and caught.value.filename == tier.path
        assert not isinstance(caught.value, TierError)
        fake_kvikio.failing = False
        tier.write(1, buf).result()  # the tier works again: nothing was lost
        out = aligned_host_buffer(SLOTS[1])
        tier.read(1, out).result()
        assert torch.equal(out, buf)
    finally:
        tier.close()


def test_a_kvikio_tier_that_fails_writes_is_dropped_for_the_other(tmp_path, fake_kvikio):
    (tmp_path / "posix").mkdir()
    (tmp_path / "kvikio").mkdir()
    cfg = OffloadConfig(kernel="torch", tiers=[spec(tmp_path / "kvikio"), f"posix:{tmp_path / 'posix'}"], subgroup_numel=SG,
                        host_budget_gb=budget_for(3), placement="fixed")  # fmt: skip
    fake_kvikio.failing = True  # every write to the KvikIO tier fails from the start
    opt, ref_opt, mine, ref = run_pair(cfg, scheduler=step_lr)
    assert_same_as_reference(opt, ref_opt, mine, ref)
    assert opt.store.pipeline.failed_tiers == {0}
    opt.close()
