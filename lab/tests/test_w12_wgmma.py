"""The Hopper ``wgmma`` W12 GEMM (``lab/w12/variants/wgmma.py``): the x load layout on CPU, an sm_90
compile that shows the asynchronous MMA with the decoded weights as register A operand (no
``mma.sync``, no shared loads, one CTA barrier per record, no ptxas serialization), and the kernel
against the fp32 reference on a Hopper GPU."""

from __future__ import annotations

import os
import re

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from lab.w12.variants import mma, wgmma  # noqa: E402
from specpilot.kernels.w12 import encode  # noqa: E402
from specpilot.kernels.w12.pack import KernelPack  # noqa: E402
from specpilot.kernels.w12.naive import w12_linear_ref  # noqa: E402

from gluon_ptx import inflight_a_writes, ptxas_report, sass  # noqa: E402
from test_w12_gemm import check_close, make_weight  # noqa: E402
from test_w12_mma import _span  # noqa: E402

needs_wgmma = pytest.mark.skipif(not wgmma.AVAILABLE, reason="Triton without Gluon's Hopper module")
hopper = pytest.mark.skipif(not torch.cuda.is_available() or not wgmma.AVAILABLE
                            or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU")


@pytest.mark.parametrize("bm,warps", [(8, 4), (16, 4), (32, 4), (64, 4), (8, 8), (32, 8), (64, 8)])
def test_x_load_layout_covers_the_tile_with_physical_k_runs(bm, warps):
    reg, lane, warp = wgmma.x_phys_bases(bm, warps)
    nonzero = [v for v in reg + lane + warp if any(v)]
    pts = _span(nonzero, [bm, 64])
    assert len(pts) == bm * 64 == 2 ** len(nonzero)            # every x element once (some warps may repeat)
    assert reg[:2] == [[0, 1], [0, 2]]                          # 4 consecutive k: one 8-byte load
    # the stage's MMA k order is the permutation the decode uses
    perm = [mma.mma_k_to_physical(k) for k in range(64)]
    for kl in range(64):
        j, s, t, c = kl >> 4, (kl >> 3) & 1, (kl >> 1) & 3, kl & 1
        assert perm[kl] == 16 * t + 4 * j + 2 * s + c


_SETUP = r"""
from lab.w12.variants import wgmma
k = wgmma._w12_wgmma_kernel
ptrs = {"x_ptr": "*bf16", "y_ptr": "*bf16", "rec_ptr": "*i32", "low_ptr": "*u8", "eptr_ptr": "*i32",
        "erow_ptr": "*i32", "ecol_ptr": "*i32", "edelta_ptr": "*fp32", "ws_ptr": "*fp32", "lock_ptr": "*i32"}
lv, ln, acc, a, l3, lxp, xsl = wgmma.layouts(64, 32, 4)
const = dict(BLOCK_N=64, BLOCK_M=32, USE_SPLIT=True, QPASS=False, ESC_CH=64, DEPTH=2, UNROLL=True,
             L_VIEW=lv, L_NIB=ln, ACC=acc, A_OP=a, L_EP=l3, L_XP=lxp, XSL=xsl)
div = list(ptrs) + ["K", "stride_xm", "stride_ym"]
warps = 4
"""


@needs_wgmma
def test_compiles_to_wgmma_with_register_a_and_one_barrier_per_record():
    """Register-A ``wgmma`` (no B-fragment loads, no ``mma.sync``), one barrier per record, each
    ``wgmma`` retired before the next record: in the SASS no instruction writes the A registers of
    one still in flight (with ``wait(1)`` ptxas reused them for the next record's loads)."""
    rep = ptxas_report(_SETUP)
    assert rep["rc"] == 0, rep["log"]
    assert "C7513" not in rep["log"] and "serialized" not in rep["log"]   # the MMAs stay asynchronous
    assert "0 bytes spill stores" in rep["log"]
    blocks = re.split(r"^(?=\$L__BB\d+_\d+:)", rep["ptx"], flags=re.M)
    loop = next(b for b in blocks if "wgmma.mma_async" in b and "Loop Header" in b.splitlines()[0])
    recs = 3                                                     # the loop body holds three records
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n32k16\.f32\.bf16\.bf16 \{[^}]*\}, \{([^}]*)\}", loop)
    assert len(mmas) == 4 * recs and all(len(a.split(",")) == 4 for a in mmas)   # A: 4 registers, not smem
    assert loop.count("mma.sync") == 0 and loop.count("ld.shared") == 0
    assert loop.count("bar.sync") == recs and loop.count("wgmma.wait_group.sync.aligned 0") == recs
    assert inflight_a_writes(sass(_SETUP)) == []


def test_config_checks_and_default():
    for bad in (wgmma.WgmmaConfig(128, 1, 4), wgmma.WgmmaConfig(64, 1, 4, 4), wgmma.WgmmaConfig(64, 0),
                wgmma.WgmmaConfig(64, 1, 4, 3, True)):
        with pytest.raises(ValueError):
            wgmma.check_config(bad)
    cfg = wgmma.default_config(32, 4096, 4096)
    wgmma.check_config(cfg)
    assert 1 <= cfg.split_k <= 64
    kp = KernelPack.from_w12(encode(make_weight(16, 64)), device="cpu")
    assert not wgmma.supported(torch.zeros(8, 64, dtype=torch.bfloat16), kp)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

def _cuda_layer(n, k, seed):
    w = make_weight(n, k, seed=seed)
    t = encode(w)
    return w, t, KernelPack.from_w12(t, device="cuda")


W = wgmma.WgmmaConfig
CASES = [  # (rows, N, K, config)
    (2, 40, 200, W(64, 1)),                # a partial tile, a partial record
    (8, 256, 512, W(128, 2, 8)),
    (17, 200, 320, W(64, 3, 4, 3)),        # uneven split
    (32, 384, 1024, W(128, 4, 8)),
    (64, 128, 256, W(64, 1, 4, 1)),
    (100, 136, 192, W(64, 2)),             # two row blocks, the last one partial
    (8, 256, 448, W(64, 1, 4, 2, True)),   # unrolled: 7 records, two steps past the range
    (32, 384, 1024, W(128, 3, 8, 2, True)),
    (64, 200, 640, W(64, 2, 4, 2, True)),
]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("m,n,k,cfg", CASES)
def test_w12_wgmma_matches_fp32_reference_and_is_deterministic(m, n, k, cfg):
    w, _, kp = _cuda_layer(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16().cuda()
    y = wgmma.w12_wgmma(x, kp, config=cfg, out_dtype=torch.float32)
    check_close(y.cpu(), x.cpu(), w)
    y2 = wgmma.w12_wgmma(x, kp, config=cfg, out_dtype=torch.float32)
    assert torch.equal(y.view(torch.int32), y2.view(torch.int32))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("cfg", [None, W(64, 2, 4, 2, True)])
def test_w12_wgmma_qpass_and_default_config(cfg):
    _, t, kp = _cuda_layer(256, 640, seed=5)
    x = torch.randn(24, 640).bfloat16().cuda()
    yq = wgmma.w12_wgmma(x, kp, qpass=True, config=cfg, out_dtype=torch.float32).cpu()
    rq = w12_linear_ref(x.cpu().float(), t, qpass=True)
    fin = torch.isfinite(rq)
    assert float(((yq - rq).abs()[fin] / (rq.abs()[fin] + 1e-2)).max()) < 1e-4
    yb = wgmma.w12_wgmma(x, kp)
    assert yb.dtype == torch.bfloat16 and yb.shape == (24, 256)


@pytest.mark.gpu
@hopper
def test_w12_wgmma_strided_rows():
    w, _, kp = _cuda_layer(128, 256, seed=11)
    big = torch.randn(12, 264).bfloat16().cuda()
    y = wgmma.w12_wgmma(big[:, :256], kp, out_dtype=torch.float32)
    check_close(y.cpu(), big[:, :256].cpu(), w)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("kernel", ["mma", "wgmma"])
def test_escape_heavy_rows_span_several_epilogue_chunks(kernel):
    """More escapes in a block than one epilogue pass takes, rows whose escapes cross a pass
    boundary, and an escape-free block: exact corrections in both tensor-core kernels."""
    w = make_weight(192, 640, seed=3)
    w[0, :100] = 0.0
    w[1, 10:90] = 1e-30
    w[2, ::7] = 1e3
    w[128:192] = (torch.randn(64, 640) * 0.02).bfloat16()   # (escapes only if randn gives them)
    kp = KernelPack.from_w12(encode(w), device="cuda")
    for m in (3, 32, 64):
        x = torch.randn(m, 640, generator=torch.Generator().manual_seed(m)).bfloat16().cuda()
        run = mma.w12_mma if kernel == "mma" else wgmma.w12_wgmma
        for split in (1, 3):
            cfg = mma.MmaConfig(64, split) if kernel == "mma" else wgmma.WgmmaConfig(64, split)
            check_close(run(x, kp, config=cfg, out_dtype=torch.float32).cpu(), x.cpu(), w)
