"""The few-row W12 kernel on tensor cores with K split across warps (``kernels/w12/warpk.py``):
layouts on CPU, an sm_90 compile that checks the main loop (MMAs, no shared memory, no barrier),
config checks, and the kernel against the fp32 reference on a GPU."""

from __future__ import annotations

import os
import re

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from specpilot.kernels.w12 import encode  # noqa: E402
from specpilot.kernels import tuning  # noqa: E402
from specpilot.kernels.w12 import mma, routing, warpk  # noqa: E402
from specpilot.kernels.w12.gluon_common import mma_block_m  # noqa: E402
from specpilot.kernels.w12.pack import KernelPack  # noqa: E402
from specpilot.kernels.w12.naive import w12_linear_ref  # noqa: E402

from gluon_ptx import ptxas_report, loop_ptx  # noqa: E402
from test_w12_gemm import check_close, make_weight  # noqa: E402
from test_w12_mma import _span  # noqa: E402

needs_gluon = pytest.mark.skipif(warpk.gluon is None, reason="Triton without Gluon")


def _gpu(fn):
    skip = pytest.mark.skipif(not torch.cuda.is_available() or warpk.gluon is None, reason="needs CUDA and Gluon")
    return pytest.mark.gpu(skip(fn))


@pytest.mark.parametrize("rows,bm,w", [(16, 8, 4), (32, 16, 8), (16, 16, 2)])
def test_layouts_cover_each_warps_tile_once(rows, bm, w):
    """Every (warp, row, word) of the view, nibble and x tiles is held by exactly one lane register;
    the x tile of each warp is its own (the warp is the batch dimension, not a row split)."""
    b = warpk.layout_bases(rows, bm, w)
    for name, shape in (("view", [w, rows, 16]), ("nib", [w, rows, 8]), ("x", [w, bm, 64])):
        reg, lane, warp, s = b[name]
        assert s == shape
        pts = _span(reg + lane + warp, shape)
        assert len(pts) == shape[0] * shape[1] * shape[2] == 2 ** len(reg + lane + warp)
    assert all(v[0] > 0 and v[1] == v[2] == 0 for v in b["x"][2])


_SETUP = r"""
from specpilot.kernels.w12 import warpk as G
k = G._w12_warpk_kernel
ptrs = {"x_ptr": "*bf16", "y_ptr": "*bf16", "rec_ptr": "*i32", "low_ptr": "*u8", "eptr_ptr": "*i32",
        "erow_ptr": "*i32", "ecol_ptr": "*i32", "edelta_ptr": "*fp32", "ws_ptr": "*fp32", "lock_ptr": "*i32"}
lv, lq, lx, mma, a_op, b_op, lep = G.layouts(16, 8, 4)
const = dict(ROWS=16, BLOCK_M=8, WARPS=4, DEPTH=2, USE_SPLIT=True, QPASS=False, ESC_CH=32,
             L_V=lv, L_Q=lq, L_X=lx, MMA=mma, A_OP=a_op, B_OP=b_op, L_EP=lep)
div = list(ptrs) + ["K", "stride_xm", "stride_ym"]
warps = 4
"""


@needs_gluon
def test_compiles_for_sm90_with_mmas_and_no_barrier_in_the_loop():
    """16 rows x 4 warps, two register sets: per set and lane two 16-byte view loads and two 8-byte
    nibble loads (rows g and g + 8), two 16-byte x loads and 4 ``mma.sync`` (the operand conversions are asserted
    trivial at compile time); no shared memory and no CTA barrier in the loop, one pin per reload;
    no spills (Triton 3.6: 73 registers; about 3.4 SASS instructions per weight against the FMA
    GEMV's 6.2)."""
    r = ptxas_report(_SETUP)
    body = next(loop_ptx(r["ptx"], h) for h in ("Loop Header", "%.lr.ph") if "mma.sync" in loop_ptx(r["ptx"], h))
    assert body.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 8
    assert len(re.findall(r"ld\.global[^;]*\.v4", body)) == 2 * 4
    assert len(re.findall(r"ld\.global[^;]*\.v2", body)) == 2 * 2
    assert ".shared" not in body and body.count("bar.sync") == 0 and body.count("bar.warp.sync") == 2
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r["log"]).groups()
    assert spills == ("0", "0"), r["log"]


@needs_gluon
def test_spread_epilogue_waits_on_no_chain_before_the_first_mma():
    """``epi_spread`` (16 rows x 4 warps, 8 x rows, four sets): compiled for sm_90, the first MMA
    comes before the loads of x at the escape columns (16-bit loads), the products x[col] * delta
    are taken after the main loop, and nothing spills (Triton 3.6: 128 registers, as without it)."""
    setup = _SETUP.replace("DEPTH=2", "DEPTH=4").replace("USE_SPLIT=True", "USE_SPLIT=False, EPI_SPREAD=True")
    r = ptxas_report(setup)
    ptx = r["ptx"]
    loop = next(loop_ptx(ptx, h) for h in ("Loop Header", "%.lr.ph") if "mma.sync" in loop_ptx(ptx, h))
    assert 0 <= ptx.find("mma.sync") < ptx.find("ld.global.b16") < ptx.find(loop)
    assert "ld.global.b16" not in loop and "mul.f32" not in loop
    assert ptx.find(loop) + len(loop) < ptx.find("mul.f32")
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r["log"]).groups()
    assert spills == ("0", "0"), r["log"]


@pytest.mark.parametrize("bad", [warpk.WarpKConfig(warps=3), warpk.WarpKConfig(depth=1),
                                 warpk.WarpKConfig(depth=5), warpk.WarpKConfig(split_k=0),
                                 warpk.WarpKConfig(esc_ch=12), warpk.WarpKConfig(split_k=2, epi_spread=True)])
def test_bad_configs_are_rejected(bad):
    with pytest.raises(ValueError):
        warpk.check_config(bad)


def _preferred(m: int, n: int, k: int) -> bool:
    """Whether the routing table sends ``m`` rows of the ``n x k`` layer here when the kernel runs."""
    rules = tuning.table("w12", "sm90")["route"]
    return routing.pick(rules, m, n, lambda kern: kern == "warpk",
                        lambda kern: routing.tuned_config(kern, m, n, k)) == "warpk"


def test_default_config_routing_support_and_key():
    cfg = warpk.default_config(1, 4096, 4096)
    assert warpk.ROWS == 16 and cfg.split_k >= 1 and cfg.key().startswith("wk-r16-w4-d4-s")
    assert warpk.default_config(5, 6144, 4096) == warpk.tuned_config(8, 6144, 4096) is not None  # 2-8 rows: one entry
    entries = [e for e in tuning.table("w12", "sm90")["entries"] if e["kernel"] == "warpk"]
    assert all(warpk.check_config(warpk.WarpKConfig(**e["config"])) is None for e in entries)
    assert warpk.default_config(8, 1024, 4096).split_k == 4 and not _preferred(16, 1024, 4096)
    assert {tuple(e["rows"]) for e in entries} <= {(1, 1), (2, 8), (9, 16), (17, 32)}
    # 2-8 rows always; 1 and 9-32 rows only on measured layers
    assert _preferred(2, 1000, 3000) and _preferred(8, 6144, 4096)
    assert _preferred(1, 4096, 14336) and not _preferred(1, 4096, 4096)
    assert _preferred(12, 6144, 4096) and not _preferred(12, 28672, 4096)
    assert _preferred(24, 6144, 4096) and warpk.default_config(24, 6144, 4096).x_late
    assert warpk.default_config(24, 1000, 3000).x_late and warpk.default_config(12, 1000, 3000).depth == 2
    assert warpk.default_config(24, 1000, 3000).esc_ch == 32 and warpk.default_config(12, 1000, 3000).esc_ch == 0
    assert not _preferred(24, 4096, 4096) and not _preferred(1, 1000, 3000)
    assert warpk.WarpKConfig(4, 2, 1, x_late=True).key() == "wk-r16-w4-d2-s1-xl"
    assert warpk.WarpKConfig(4, 2, 1, x_late=True, esc_ch=16).key() == "wk-r16-w4-d2-s1-xl-e16"
    assert warpk.WarpKConfig(4, 2, 1, epi_spread=True).key() == "wk-r16-w4-d2-s1-es"
    kp = KernelPack.from_w12(encode(make_weight(16, 64)), device="cpu")
    assert not warpk.supported(torch.zeros(1, 64, dtype=torch.bfloat16), kp)    # CPU: the other kernels


def _cuda_layer(n, k, seed):
    w = make_weight(n, k, seed=seed)
    t = encode(w)
    return w, t, KernelPack.from_w12(t, device="cuda")


CASES = [   # (rows, n, k, config): 1-32 rows, partial row tiles, odd record counts, split-K, K not /64
    (1, 256, 512, warpk.WarpKConfig(4, 2, 1)),
    (1, 200, 320, warpk.WarpKConfig(4, 3, 1)),
    (8, 384, 640, warpk.WarpKConfig(8, 2, 2)),
    (12, 256, 1088, warpk.WarpKConfig(4, 2, 4)),
    (24, 256, 512, warpk.WarpKConfig(4, 2, 1)),
    # x loaded right before each record's MMAs
    (1, 200, 320, warpk.WarpKConfig(4, 3, 1, x_late=True)),
    (32, 256, 1088, warpk.WarpKConfig(4, 4, 3, x_late=True)),
    # 8 escapes per epilogue pass: rows with more escapes take several passes, after the loop
    (32, 256, 2048, warpk.WarpKConfig(4, 2, 1, x_late=True, esc_ch=8)),
    (4, 128, 1088, warpk.WarpKConfig(4, 4, 2, esc_ch=8)),
]


@_gpu
@pytest.mark.parametrize("m,n,k,cfg", CASES)
def test_matches_fp32_reference_and_is_deterministic(m, n, k, cfg):
    w, _, kp = _cuda_layer(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16().cuda()
    y = warpk.w12_warpk(x, kp, config=cfg, out_dtype=torch.float32)
    check_close(y.cpu(), x.cpu(), w)
    y2 = warpk.w12_warpk(x, kp, config=cfg, out_dtype=torch.float32)
    assert torch.equal(y.view(torch.int32), y2.view(torch.int32))


@_gpu
def test_long_k_is_deterministic_and_close():
    """4096 -> 14336-like lengths: bitwise the same run to run, and within bf16 rounding of fp32."""
    w, _, kp = _cuda_layer(256, 14336, seed=3)
    x = torch.randn(4, 14336, generator=torch.Generator().manual_seed(2)).bfloat16().cuda()
    ys = [warpk.w12_warpk(x, kp, config=warpk.WarpKConfig(4, 4, 2), out_dtype=torch.float32) for _ in range(3)]
    assert all(torch.equal(ys[0].view(torch.int32), y.view(torch.int32)) for y in ys)
    ref = x.float().cpu() @ w.float().T
    fin = torch.isfinite(ref)
    assert float(((ys[0].cpu() - ref).abs()[fin] / (x.float().abs().cpu() @ w.float().abs().T)[fin]).max()) < 1e-4


@_gpu
@pytest.mark.parametrize("m", [1, 7])
def test_qpass_and_default_config(m):
    _, t, kp = _cuda_layer(256, 640, seed=5)
    x = torch.randn(m, 640).bfloat16().cuda()
    yq = warpk.w12_warpk(x, kp, qpass=True, out_dtype=torch.float32).cpu()
    rq = w12_linear_ref(x.cpu().float(), t, qpass=True)
    fin = torch.isfinite(rq)
    assert float(((yq - rq).abs()[fin] / (rq.abs()[fin] + 1e-2)).max()) < 1e-4
    yb = warpk.w12_warpk(x, kp)
    assert yb.dtype == torch.bfloat16 and yb.shape == (m, 256)


@_gpu
def test_rejects_more_than_32_rows():
    _, _, kp = _cuda_layer(128, 128, seed=1)
    with pytest.raises(ValueError, match="1-32"):
        warpk.w12_warpk(torch.zeros(33, 128, dtype=torch.bfloat16, device="cuda"), kp)


@_gpu
@pytest.mark.parametrize("m", [4, 12])
def test_w12_linear_routes_few_rows_here(m):
    from specpilot.kernels.w12.routing import w12_linear

    w, _, kp = _cuda_layer(256, 4096, seed=9)       # 12 rows: not a table layer, so the mma kernel
    x = torch.randn(m, 4096).bfloat16().cuda()
    y = w12_linear(x, kp)
    want = warpk.w12_warpk(x, kp) if m <= 8 else mma.w12_mma(x, kp)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))


@_gpu
def test_strided_rows():
    """x rows 264 elements apart: the launcher realigns them (as the other tensor-core kernels)."""
    w, _, kp = _cuda_layer(128, 256, seed=11)
    x = torch.randn(6, 264).bfloat16().cuda()[:, :256]
    check_close(warpk.w12_warpk(x, kp, out_dtype=torch.float32).cpu(), x.cpu(), w)
    assert mma_block_m(6) == 8


SPREAD_CASES = [   # (rows, n, k, config without epi_spread)
    (2, 256, 512, warpk.WarpKConfig(4, 4, 1)),
    (8, 136, 1088, warpk.WarpKConfig(4, 4, 1)),            # partial row tile, 17 records
    (16, 128, 64, warpk.WarpKConfig(4, 2, 1)),             # one record: step 0 only
    (1, 256, 2048, warpk.WarpKConfig(8, 2, 1)),
    (32, 256, 2048, warpk.WarpKConfig(4, 2, 1, x_late=True, esc_ch=8)),   # several escape passes
]


@_gpu
@pytest.mark.parametrize("m,n,k,cfg", SPREAD_CASES)
@pytest.mark.parametrize("qpass", [False, True])
def test_spread_epilogue_gives_the_same_bits(m, n, k, cfg, qpass):
    """The escape chain spread over step 0: bitwise the plain order's output (row 0 has 32 escapes:
    more than one chunk), run to run."""
    from dataclasses import replace

    w, _, kp = _cuda_layer(n, k, seed=m + 40)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m + 1)) * 3).bfloat16().cuda()
    ref = warpk.w12_warpk(x, kp, qpass=qpass, config=cfg, out_dtype=torch.float32)
    for _ in range(3):
        y = warpk.w12_warpk(x, kp, qpass=qpass, config=replace(cfg, epi_spread=True), out_dtype=torch.float32)
        assert torch.equal(y.view(torch.int32), ref.view(torch.int32))
    if not qpass:
        check_close(y.cpu(), x.cpu(), w)
