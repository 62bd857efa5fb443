"""The one-row Gluon W12 GEMV (``kernels/w12/gemv_gluon.py``): an sm_90 compile on the CPU that
checks the loads and the absence of shared memory in the main loop, config checks, and the kernel
against the reference on a GPU (partial tiles, odd K, escapes, split-K, Q pass, routing)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from specpilot.kernels.w12 import encode  # noqa: E402
from specpilot.kernels.w12 import gemv_gluon as gg  # noqa: E402
from specpilot.kernels.w12.pack import KernelPack  # noqa: E402
from specpilot.kernels.w12.naive import w12_linear_ref  # noqa: E402

from gluon_ptx import loop_ptx, main_loop_ptx, ptxas_report  # noqa: E402
from test_w12_gemm import check_close, extreme_row, make_weight  # noqa: E402

needs_gluon = pytest.mark.skipif(gg.gluon is None, reason="Triton without Gluon")


def _gpu(fn):
    skip = pytest.mark.skipif(not torch.cuda.is_available() or gg.gluon is None, reason="needs CUDA and Gluon")
    return pytest.mark.gpu(skip(fn))


_SETUP = r"""
from specpilot.kernels.w12 import gemv_gluon as G
k = G._w12_gemv_gl_kernel
ptrs = {"x_ptr": "*bf16", "x32_ptr": "*i32", "y_ptr": "*bf16", "rec_ptr": "*i32", "low_ptr": "*u8",
        "eptr_ptr": "*i32", "erow_ptr": "*i32", "ecol_ptr": "*i32", "edelta_ptr": "*fp32", "ws_ptr": "*fp32",
        "lock_ptr": "*i32"}
lv, lq, lx, l3 = G.layouts(16, 8)
const = dict(ROWS=16, WARPS=8, DEPTH=3, UNROLL=UNROLL, USE_SPLIT=True, QPASS=False, ESC_CH=8, L_V=lv, L_Q=lq, L_X=lx, L_E=l3)
div = list(ptrs) + ["KH", "stride_ym"]
warps = 8
"""


@needs_gluon
@pytest.mark.parametrize("unroll", [False, True])
def test_compiles_for_sm90_streaming_without_shared_memory(unroll):
    """The main loop loads each warp's next record with 16-byte view and x loads and 8-byte nibble
    loads (2 rows per lane at 16 rows x 8 warps), touches no shared memory and has no barrier: the
    warps only meet at the end. The x and nibble conversions are asserted trivial at compile time.
    Unrolled (depth 3), one loop body holds three records, each reloaded in place."""
    import re

    body = main_loop_ptx(f"UNROLL = {unroll}\n" + _SETUP)
    per = 3 if unroll else 1
    stats = {"shared": body.count(".shared"), "bar": body.count("bar.sync"),
             "v4": len(re.findall(r"ld\.global[^;]*\.v4", body)), "v2": len(re.findall(r"ld\.global[^;]*\.v2", body)),
             "fma": len(re.findall(r"fma\.rn\.f32", body)), "prmt": body.count("prmt.b32")}
    assert stats["shared"] == 0 and stats["bar"] == 0
    assert stats["v4"] == 4 * per    # 2 rows of views + 2 x 16 bytes of x per lane
    assert stats["v2"] == 2 * per    # 2 rows of nibbles
    assert stats["fma"] == 32 * per  # 2 rows x 16 weights
    assert stats["prmt"] >= 16 * per  # the decode's byte permutes: 2 per view word


@needs_gluon
@pytest.mark.parametrize("depth,maxnreg", [(4, 96)])   # (3, None) too: 95 registers (CI time: one compile)
def test_staged_x_keeps_records_in_flight_within_96_registers(depth, maxnreg):
    """``xs`` at 16 rows x 4 warps, unrolled: x comes from shared memory (two 16-byte reads per
    record), only the weights from global memory, no CTA barrier in the loop, and one
    ``bar.warp.sync`` pin per reload (what keeps ptxas from sinking the reloads to the loop's end).
    With Triton 3.6 (the GPU machine's; registers depend on the toolchain, 3.9 takes 126 at depth
    3), depth 4 with ``maxnreg=96`` and the late epilogue fits in 96 registers without spills
    (depth 3 without a cap: 95)."""
    import re

    setup = _SETUP.replace("G.layouts(16, 8)", "G.layouts(16, 4)").replace("WARPS=8, DEPTH=3", f"WARPS=4, DEPTH={depth}")
    late = depth == 4     # and the escape loads after the first records' (late_epilogue)
    setup = setup.replace("USE_SPLIT=True", f"USE_SPLIT=False, XS=True, XS_IT=24, EPI_LATE={late}")
    setup = setup.replace("warps = 8", "warps = 4")
    r = ptxas_report("UNROLL = True\n" + setup + (f"opts = {{'maxnreg': {maxnreg}}}\n" if maxnreg else ""))
    body = loop_ptx(r["ptx"])
    assert body.count("bar.sync") == 0 and body.count("bar.warp.sync") == depth
    assert len(re.findall(r"ld\.shared[^;]*\.v4", body)) == 2 * depth       # x: 8 words per lane
    assert len(re.findall(r"ld\.global[^;]*\.v4", body)) == 2 * depth       # views of 2 rows per lane
    assert len(re.findall(r"ld\.global[^;]*\.v2", body)) == 2 * depth       # nibbles
    assert len(re.findall(r"fma\.rn\.f32", body)) == 32 * depth
    if late:   # PTX order (the pin keeps it in SASS): record views (16-byte loads) before the row scales (bytes)
        ptx = r["ptx"]
        scales = min(i for i in (ptx.find("ld.global.b8"), ptx.find("ld.global.u8")) if i >= 0)
        assert 0 <= ptx.find("ld.global.v4") < scales
    regs = int(re.search(r"Used (\d+) registers", r["log"]).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r["log"]).groups()
    if triton.__version__.startswith("3.6."):
        assert regs <= 96 and spills == ("0", "0"), r["log"]


@needs_gluon
def test_spread_epilogue_waits_on_no_chain_before_the_first_fma():
    """``epi_spread`` (16 rows x 4 warps, four staged sets, cap 96): compiled for sm_90, the first
    FMA comes before the escape entries' loads and x at the escape columns (16-bit loads; the staged
    x comes by cp.async), the products x[col] * delta are taken after the main loop, and nothing
    spills (Triton 3.6: the sets and the chain's three per-lane values fit in 96 registers)."""
    import re

    setup = _SETUP.replace("G.layouts(16, 8)", "G.layouts(16, 4)").replace("WARPS=8, DEPTH=3", "WARPS=4, DEPTH=4")
    setup = setup.replace("USE_SPLIT=True", "USE_SPLIT=False, XS=True, XS_IT=24, EPI_SPREAD=True")
    setup = setup.replace("warps = 8", "warps = 4")
    r = ptxas_report("UNROLL = True\n" + setup + "opts = {'maxnreg': 96}\n")
    ptx = r["ptx"]
    first_fma = ptx.find("fma.rn.f32")
    x_at_cols = min(i for i in (ptx.find("ld.global.b16"), ptx.find("ld.global.u16")) if i >= 0)
    assert 0 <= first_fma < x_at_cols
    loop = loop_ptx(ptx)
    assert "ld.global.b16" not in loop and "mul.f32" not in loop and len(re.findall(r"fma\.rn\.f32", loop)) == 128
    assert ptx.find(loop) + len(loop) < ptx.find("mul.f32")      # x[col] * delta after the main loop
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r["log"]).groups()
    if triton.__version__.startswith("3.6."):
        assert spills == ("0", "0"), r["log"]


def test_staged_x_groups_cover_the_unrolled_steps():
    cfg = gg.GluonGemvConfig(16, 4, 3, 1, True, xs=True)
    assert cfg.xs_groups(272) == 72                 # 68 groups of 4 records -> multiple of lcm(8, 3)
    assert gg.GluonGemvConfig(16, 8, 4, 2, True, xs=True).xs_groups(224) == 16
    assert gg.GluonGemvConfig(16, 4, 1, 1, xs=True).xs_groups(1) == 8
    assert cfg.key() == "gl-r16-w4-d3-s1-u-xs" and gg.GluonGemvConfig(xs=True, maxnreg=96).key().endswith("-xs-r96")


@pytest.mark.parametrize("bad", [gg.GluonGemvConfig(rows=24), gg.GluonGemvConfig(warps=3),
                                 gg.GluonGemvConfig(depth=5), gg.GluonGemvConfig(split_k=0),
                                 gg.GluonGemvConfig(depth=1, unroll=True), gg.GluonGemvConfig(maxnreg=300),
                                 gg.GluonGemvConfig(16, 4, 4, 1, True, xs=True, late_epilogue=True, epi_spread=True),
                                 gg.GluonGemvConfig(16, 4, 4, 2, True, xs=True, epi_spread=True),
                                 gg.GluonGemvConfig(16, 4, 4, 1, False, xs=True, epi_spread=True)])
def test_bad_configs_are_rejected(bad):
    with pytest.raises(ValueError):
        gg.check_config(bad)


def test_default_config_and_support():
    cfg = gg.default_config(4096, 4096)
    assert cfg.rows in (8, 16, 32) and cfg.split_k >= 1
    assert gg.default_config(28672, 4096).split_k == 1          # enough row blocks: no split-K
    wide = gg.default_config(8192, 200000)                      # untuned: staged x, split until it fits
    assert wide.xs and wide.xs_groups(3125) * wide.warps * 128 <= gg.XS_MAX_BYTES
    kp = KernelPack.from_w12(encode(make_weight(16, 64)), device="cpu")
    assert not gg.supported(torch.zeros(1, 64, dtype=torch.bfloat16), kp)      # CPU: the other kernels
    with pytest.raises((ValueError, RuntimeError)):
        gg.w12_gemv_gluon(torch.zeros(2, 64, dtype=torch.bfloat16), kp)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

CASES = [  # (N, K, config)
    (40, 200, gg.GluonGemvConfig(8, 4, 2, 1)),        # a partial tile and a partial record
    (256, 512, gg.GluonGemvConfig(16, 8, 3, 1)),
    (200, 320, gg.GluonGemvConfig(32, 4, 4, 3)),      # uneven split, the last row block partial
    (384, 1024, gg.GluonGemvConfig(16, 16, 2, 2)),
    (136, 4160, gg.GluonGemvConfig(8, 8, 1, 5)),
    (128, 64, gg.GluonGemvConfig(16, 8, 3, 1)),       # fewer records than warps
    (200, 1088, gg.GluonGemvConfig(16, 4, 3, 1, True)),  # unrolled: 17 records, steps past the range
    (384, 1024, gg.GluonGemvConfig(32, 8, 2, 2, True)),
]


@_gpu
@pytest.mark.parametrize("n,k,cfg", CASES)
def test_gemv_gluon_matches_fp32_reference_and_is_deterministic(n, k, cfg):
    w = make_weight(n, k, seed=n + k)
    t = encode(w)
    kp = KernelPack.from_w12(t, device="cuda")
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).bfloat16().cuda()
    y = gg.w12_gemv_gluon(x, kp, config=cfg, out_dtype=torch.float32)
    check_close(y.cpu(), x.cpu(), w)
    y2 = gg.w12_gemv_gluon(x, kp, config=cfg, out_dtype=torch.float32)
    assert torch.equal(y.view(torch.int32), y2.view(torch.int32))
    yq = gg.w12_gemv_gluon(x, kp, qpass=True, config=cfg, out_dtype=torch.float32).cpu()
    rq = w12_linear_ref(x.cpu().float(), t, qpass=True)
    fin = torch.isfinite(rq)
    assert float(((yq - rq).abs()[fin] / (rq.abs()[fin] + 1e-2)).max()) < 1e-4


@_gpu
def test_w12_linear_routes_one_row_to_gluon_gemv():
    from specpilot.kernels.w12.routing import w12_linear

    w = make_weight(256, 512, seed=3)
    kp = KernelPack.from_w12(encode(w), device="cuda")
    x = torch.randn(1, 512).bfloat16().cuda()
    assert torch.equal(w12_linear(x, kp).view(torch.int16), gg.w12_gemv_gluon(x, kp).view(torch.int16))


XS_CASES = [  # (N, K, config without xs): every staged-x path against the same config unstaged
    (40, 200, gg.GluonGemvConfig(8, 4, 2, 1, True)),     # KH = 100: partial cp.async masks
    (128, 64, gg.GluonGemvConfig(16, 8, 3, 1, True)),    # fewer records than warps
    (200, 1088, gg.GluonGemvConfig(16, 4, 3, 1, True)),  # 17 records, steps past the range
    (256, 2048, gg.GluonGemvConfig(16, 4, 4, 1, True, maxnreg=96)),
    (384, 1024, gg.GluonGemvConfig(16, 4, 4, 2, True)),  # split-K
    (136, 4160, gg.GluonGemvConfig(8, 8, 3, 5, True)),
    (200, 320, gg.GluonGemvConfig(32, 4, 2, 3)),         # rolled ring
]


@_gpu
@pytest.mark.parametrize("n,k,cfg", XS_CASES)
@pytest.mark.parametrize("qpass", [False, True])
def test_staged_x_gives_the_unstaged_bits(n, k, cfg, qpass):
    """x staged in shared memory, clamped records and pinned reloads: bitwise the outputs of the
    same config without them (escapes, +-0, subnormal and large x included), run to run, and with
    the epilogue's loads moved after the first records'."""
    from dataclasses import replace

    w = make_weight(n, k, seed=n * 7 + k)
    t = encode(w)
    assert t.num_escapes > 0
    kp = KernelPack.from_w12(t, device="cuda")
    x = extreme_row(k, k + 1)
    y = gg.w12_gemv_gluon(x, kp, qpass=qpass, config=replace(cfg, xs=True), out_dtype=torch.float32)
    ref = gg.w12_gemv_gluon(x, kp, qpass=qpass, config=cfg, out_dtype=torch.float32)
    assert torch.equal(y.view(torch.int32), ref.view(torch.int32))
    y2 = gg.w12_gemv_gluon(x, kp, qpass=qpass, config=replace(cfg, xs=True), out_dtype=torch.float32)
    assert torch.equal(y.view(torch.int32), y2.view(torch.int32))
    late = replace(cfg, xs=True, late_epilogue=not cfg.late_epilogue)    # only the order of the loads
    y3 = gg.w12_gemv_gluon(x, kp, qpass=qpass, config=late, out_dtype=torch.float32)
    assert torch.equal(y.view(torch.int32), y3.view(torch.int32))
    if not qpass:
        check_close(y.cpu(), x.cpu(), w)


SPREAD_CASES = [  # (N, K, staged config with late_epilogue): the spread chain against it
    (40, 200, gg.GluonGemvConfig(8, 4, 4, 1, True, xs=True, late_epilogue=True)),     # 4 records: step 0 only
    (128, 64, gg.GluonGemvConfig(16, 4, 2, 1, True, xs=True, late_epilogue=True)),    # 1 record
    (384, 4160, gg.GluonGemvConfig(16, 4, 4, 1, True, xs=True, maxnreg=96, late_epilogue=True)),
    (256, 2048, gg.GluonGemvConfig(8, 8, 3, 1, True, xs=True, late_epilogue=True)),
]


@_gpu
@pytest.mark.parametrize("n,k,cfg", SPREAD_CASES)
@pytest.mark.parametrize("qpass", [False, True])
def test_spread_epilogue_gives_the_same_bits(n, k, cfg, qpass):
    """The escape chain spread over step 0 (``epi_spread``): bitwise the late epilogue's output, with
    more escapes in a block than one chunk (row 0 has 32), +-0 and large x, run to run."""
    from dataclasses import replace

    w = make_weight(n, k, seed=3 * n + k)
    kp = KernelPack.from_w12(encode(w), device="cuda")
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k + 7)) * 4
    x[0, ::5] = -0.0
    x[0, 2::9] = 3e4
    x = x.bfloat16().cuda()
    ref = gg.w12_gemv_gluon(x, kp, qpass=qpass, config=cfg, out_dtype=torch.float32)
    sp = replace(cfg, late_epilogue=False, epi_spread=True)
    for _ in range(3):
        y = gg.w12_gemv_gluon(x, kp, qpass=qpass, config=sp, out_dtype=torch.float32)
        assert torch.equal(y.view(torch.int32), ref.view(torch.int32))
    if not qpass:
        check_close(y.cpu(), x.cpu(), w)
