"""The W12 tensor-core kernels under programmatic dependent launch (PDL): placed while the kernel
before them drains, they read what the previous kernel may write (x, the escapes' x, the split-K
workspace and counters, the output) only after ``griddepcontrol.wait``; the warp-K kernel loads
its first records (constant) before it.

On the CPU, compiled for sm_90: which arguments the warp-K kernel's global accesses before the wait
derive their addresses from (the ``mma`` kernels' wait comes first: their own test files). On the
GPU: x written by a kernel that lets its dependents launch as it starts and writes x some hundred
microseconds later; each kernel's product equals its product of x written beforehand, and a
control kernel that reads x before its wait sees the old x (so the window is real)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from specpilot.kernels.w12 import mma, mma_tma, warpk  # noqa: E402

from gluon_ptx import global_accesses  # noqa: E402
import test_w12_mma  # noqa: E402
import test_w12_warpk  # noqa: E402

from test_w12_mma import _gpu_gluon, needs_gluon  # noqa: E402


@needs_gluon
@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("depth", [2, 4])
def test_warpk_reads_only_records_before_the_wait(depth, late):
    """The warp-K kernel: its register sets' first records before the wait, x after (loaded with
    the records, or late before each record's MMAs), no early trigger of the dependents."""
    accesses, waits, triggers = global_accesses(test_w12_warpk._SETUP.replace("DEPTH=2", f"DEPTH={depth}").replace(
        "L_EP=lep)", f"L_EP=lep, X_LATE={late}, PDL=True)"))
    assert len(waits) == 1 and not triggers
    before = [names for off, _, names in accesses if off < waits[0]]
    assert before and all(names == {"rec_ptr"} for names in before)
    assert any("x_ptr" in names for off, _, names in accesses if off > waits[0])


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

if torch.cuda.is_available():
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _late_copy(src_ptr, dst_ptr, n, SPIN: tl.constexpr, BLOCK: tl.constexpr):
        """``dst = src`` after ``SPIN`` dependent multiply-adds (some hundred microseconds), its
        dependents let launch at once."""
        gdc_launch_dependents()
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        v = tl.load(src_ptr + offs, mask=ok)
        t = tl.zeros([BLOCK], tl.float32) + v.to(tl.float32) * 0.0
        for _ in range(SPIN):
            t = t * 0.5 + 1.0
        tl.store(dst_ptr + offs, tl.where(t > 0.0, v, -v), mask=ok)   # (t is 2.0: v as it is)

    @triton.jit
    def _early_read(src_ptr, tmp_ptr, dst_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """The control: reads and stores before its wait (what the W12 kernels must not do with x)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(tmp_ptr + offs, tl.load(src_ptr + offs, mask=ok), mask=ok)
        if PDL:
            gdc_wait()
        tl.store(dst_ptr + offs, tl.load(tmp_ptr + offs, mask=ok), mask=ok)


def _after_late_write(x: torch.Tensor, product):
    """``product(x2)`` where ``x2`` (zero until then) is written with ``x`` by a kernel that lets
    the product's kernel launch at its start and writes some hundred microseconds later."""
    x2 = torch.zeros_like(x)
    n = x.numel()
    _late_copy[(triton.cdiv(n, 1024),)](x, x2, n, SPIN=200_000, BLOCK=1024)
    return product(x2)


@_gpu_gluon
def test_the_control_reads_the_old_x():
    """The harness opens the window: a PDL kernel reading before its wait gets the zeros."""
    x = torch.randn(8, 1024, device="cuda").bfloat16()
    tmp, out = torch.empty_like(x), torch.empty_like(x)
    _early_read[(8,)](x, tmp, out, x.numel(), BLOCK=1024, PDL=True, launch_pdl=True)   # compiled beforehand
    torch.cuda.synchronize()
    _after_late_write(x, lambda x2: _early_read[(8,)](x2, tmp, out, x.numel(), BLOCK=1024, PDL=True,
                                                      launch_pdl=True))
    torch.cuda.synchronize()
    assert bool((out == 0).all())


CONFIGS = [   # (rows, launcher, config): every W12 tensor-core kernel form the table routes
    (8, "warpk", warpk.WarpKConfig(4, 4, 2, False, 0, False)),
    (16, "warpk", warpk.WarpKConfig(8, 2, 1, False, 0, True)),
    (32, "warpk", warpk.WarpKConfig(4, 2, 1, True, 32, True)),
    (16, "mma", mma.MmaConfig(64, 4, 4, 2, False, True)),
    (32, "mma", mma.MmaConfig(64, 2, 4, 3)),
    (32, "mma", mma.MmaConfig(64, 4, 4, 3, True)),
    (8, "mma", mma.MmaConfig(64, 2, 4, 4, tma=1)),
    (16, "mma", mma.MmaConfig(64, 2, 4, 4, tma=2)),
    (32, "mma", mma.MmaConfig(64, 2, 4, 4, tma=3)),
    (64, "mma", mma.MmaConfig(64, 1, 4, 6, tma=3, kgroups=2)),
]


@_gpu_gluon
@pytest.mark.parametrize("rows,kernel,cfg", CONFIGS)
@pytest.mark.parametrize("qpass", [False, True])
def test_each_kernel_reads_x_only_after_the_wait(rows, kernel, cfg, qpass):
    if cfg.__class__ is mma.MmaConfig and cfg.tma and not mma_tma.supported("cuda"):
        pytest.skip("TMA needs sm_90")
    if cfg.__class__ is mma.MmaConfig and cfg.tma == mma_tma.WGMMA and not mma_tma.wgmma_supported("cuda"):
        pytest.skip("wgmma needs sm_90")
    _, _, kp = test_w12_mma._cuda_layer(384, 2048, seed=rows)
    x = torch.randn(rows, 2048, generator=torch.Generator().manual_seed(rows)).bfloat16().cuda()

    def product(xx):
        if kernel == "warpk":
            return warpk.w12_warpk(xx, kp, qpass=qpass, config=cfg, out_dtype=torch.float32)
        return mma.w12_mma(xx, kp, qpass=qpass, config=cfg, out_dtype=torch.float32)

    want = product(x)   # (also compiles the kernel: the late write must not finish during a compile)
    for _ in range(3):
        got = _after_late_write(x, product)
        torch.cuda.synchronize()
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
