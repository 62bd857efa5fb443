"""The W12 kernels' unrouted variants (``lab/w12/variants``): the knobs no measured table sets, each
against the variant it departs from (bitwise where the sums are the same), config checks, sm_90
compiles on the CPU, and the sweep's variant sets (``lab/w12/sweep.py``)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from lab.w12.variants import gemv, gemv_gluon, gemv_tma, mma, mma_stream, mma_tma, warpk  # noqa: E402
from specpilot.kernels.w12 import encode  # noqa: E402
from specpilot.kernels.w12.pack import KernelPack  # noqa: E402

from gluon_ptx import inflight_a_writes, main_loop_ptx, ptxas_report, sass  # noqa: E402
from test_w12_gemm import DEV, check_close, extreme_row, make_weight  # noqa: E402

needs_gluon = pytest.mark.skipif(mma.gluon is None, reason="Triton without Gluon")
needs_hopper_module = pytest.mark.skipif(not mma_tma.AVAILABLE, reason="Triton without Gluon's Hopper module")


def _gpu(fn):
    skip = pytest.mark.skipif(not torch.cuda.is_available() or mma.gluon is None, reason="needs CUDA and Gluon")
    return pytest.mark.gpu(skip(fn))


def _cuda_layer(n, k, seed):
    w = make_weight(n, k, seed=seed)
    t = encode(w)
    return w, t, KernelPack.from_w12(t, device="cuda")


# ---------------------------------------------------------------------------------------------
# the Triton streaming GEMV: fewer input rows per program (``rows``)
# ---------------------------------------------------------------------------------------------

def test_gemv_two_row_programs_match_fp32_reference():
    """5 rows in 2-row programs, the last one half empty; bitwise run to run."""
    w = make_weight(40, 384)
    kp = KernelPack.from_w12(encode(w), device=DEV)
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(5)).bfloat16().to(DEV)
    cfg = gemv.GemvConfig(32, 2, 3, rows=2)
    y = gemv.w12_gemv(x, kp, config=cfg, out_dtype=torch.float32)
    check_close(y.cpu(), x.cpu(), w)
    assert torch.equal(y.view(torch.int32), gemv.w12_gemv(x, kp, config=cfg, out_dtype=torch.float32).view(torch.int32))


# ---------------------------------------------------------------------------------------------
# the one-row Gluon GEMV: x converted to fp32 once (``xf32``), the plain decode
# ---------------------------------------------------------------------------------------------

def test_gluon_gemv_xf32_key_and_bytes():
    cfg = gemv_gluon.GluonGemvConfig(16, 4, 3, 1, True, xs=True)
    xf = gemv_gluon.GluonGemvConfig(16, 4, 3, 1, True, xs=True, xf32=True)
    assert xf.key().endswith("-xf") and xf.xs_bytes(272) == 3 * cfg.xs_bytes(272) == 3 * 72 * 4 * 128


@pytest.mark.parametrize("bad", [gemv_gluon.GluonGemvConfig(depth=2, unroll=True, xf32=True),
                                 gemv_gluon.GluonGemvConfig(xs=True, xf32=True)])
def test_gluon_gemv_bad_xf32_configs_are_rejected(bad):
    with pytest.raises(ValueError):
        gemv_gluon.check_config(bad)


@_gpu
@pytest.mark.parametrize("cfg", [gemv_gluon.GluonGemvConfig(16, 4, 2, 1, True), gemv_gluon.GluonGemvConfig(8, 4, 1, 3)])
@pytest.mark.parametrize("qpass", [False, True])
def test_gluon_gemv_prmt_decode_gives_the_plain_decodes_bits(cfg, qpass):
    """The prmt/lop3 decode and the plain one: bitwise the same outputs (escapes included)."""
    w = make_weight(384, 1088, seed=21)
    w[5, :200] = 0.0
    kp = KernelPack.from_w12(encode(w), device="cuda")
    x = torch.randn(1, 1088, generator=torch.Generator().manual_seed(2)).bfloat16().cuda()
    y = gemv_gluon.w12_gemv_gluon(x, kp, qpass=qpass, config=cfg, out_dtype=torch.float32)
    yp = gemv_gluon.w12_gemv_gluon(x, kp, qpass=qpass, config=replace(cfg, plain_decode=True), out_dtype=torch.float32)
    assert torch.equal(y.view(torch.int32), yp.view(torch.int32))


@_gpu
@pytest.mark.parametrize("cfg", [gemv_gluon.GluonGemvConfig(8, 4, 2, 1, True), gemv_gluon.GluonGemvConfig(16, 4, 4, 2, True)])
def test_gluon_gemv_xf32_gives_the_staged_bits(cfg):
    """x converted to fp32 once per program: the same products in the same order."""
    w = make_weight(200, 1088, seed=7)
    kp = KernelPack.from_w12(encode(w), device="cuda")
    x = extreme_row(1088, 3)
    for qpass in (False, True):
        y = gemv_gluon.w12_gemv_gluon(x, kp, qpass=qpass, config=replace(cfg, xs=True), out_dtype=torch.float32)
        y4 = gemv_gluon.w12_gemv_gluon(x, kp, qpass=qpass, config=replace(cfg, xs=True, xf32=True),
                                       out_dtype=torch.float32)
        assert torch.equal(y.view(torch.int32), y4.view(torch.int32))


# ---------------------------------------------------------------------------------------------
# warpk: 32-row programs, register caps, the tail epilogue
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [warpk.WarpKConfig(rows=8), warpk.WarpKConfig(maxnreg=300),
                                 warpk.WarpKConfig(split_k=2, tail_epilogue=True),
                                 warpk.WarpKConfig(epi_spread=True, tail_epilogue=True)])
def test_warpk_bad_configs_are_rejected(bad):
    with pytest.raises(ValueError):
        warpk.check_config(bad)


def test_warpk_keys():
    assert warpk.WarpKConfig(32, 8, 3, 2, 96).key() == "wk-r32-w8-d3-s2-r96"
    assert warpk.WarpKConfig(32, 4, 2, 1, x_late=True, tail_epilogue=True).key() == "wk-r32-w4-d2-s1-xl-te"


WARPK_CASES = [   # (rows, n, k, config): 32-row programs (two 16-row MMA slices per warp)
    (3, 136, 1024, warpk.WarpKConfig(32, 4, 4, 2)),
    (5, 100, 200, warpk.WarpKConfig(32, 2, 2, 1)),
    (16, 128, 256, warpk.WarpKConfig(32, 1, 3, 1)),
    (32, 200, 640, warpk.WarpKConfig(32, 4, 2, 2)),
    (20, 136, 640, warpk.WarpKConfig(32, 2, 2, 1, x_late=True)),
]


@_gpu
@pytest.mark.parametrize("m,n,k,cfg", WARPK_CASES)
def test_warpk_32_row_programs_match_fp32_reference(m, n, k, cfg):
    w, _, kp = _cuda_layer(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16().cuda()
    y = warpk.w12_warpk(x, kp, config=cfg, out_dtype=torch.float32)
    check_close(y.cpu(), x.cpu(), w)
    assert torch.equal(y.view(torch.int32), warpk.w12_warpk(x, kp, config=cfg, out_dtype=torch.float32).view(torch.int32))


@_gpu
@pytest.mark.parametrize("m,n,k,cfg,form", [
    (2, 256, 512, warpk.WarpKConfig(16, 4, 4, 1), "tail_epilogue"),
    (32, 256, 2048, warpk.WarpKConfig(16, 4, 2, 1, x_late=True, esc_ch=8), "tail_epilogue"),
    (24, 200, 640, warpk.WarpKConfig(32, 2, 3, 1, x_late=True, esc_ch=32), "tail_epilogue"),
    (24, 200, 640, warpk.WarpKConfig(32, 2, 3, 1, x_late=True, esc_ch=32), "epi_spread")])
def test_warpk_epilogue_forms_give_the_same_bits(m, n, k, cfg, form):
    """The epilogue's loads after the loop, or the escape chain spread over step 0 on 32-row
    programs: bitwise the plain order's output, run to run."""
    w, _, kp = _cuda_layer(n, k, seed=m + 40)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m + 1)) * 3).bfloat16().cuda()
    for qpass in (False, True):
        ref = warpk.w12_warpk(x, kp, qpass=qpass, config=cfg, out_dtype=torch.float32)
        for _ in range(3):
            y = warpk.w12_warpk(x, kp, qpass=qpass, config=replace(cfg, **{form: True}), out_dtype=torch.float32)
            assert torch.equal(y.view(torch.int32), ref.view(torch.int32))


# ---------------------------------------------------------------------------------------------
# the tensor-core kernel: x chunks, stream-K, the plain decode, register caps
# ---------------------------------------------------------------------------------------------

_MMA_SETUP = r"""
from lab.w12.variants import mma
k = mma._w12_mma_kernel
ptrs = {"x_ptr": "*bf16", "y_ptr": "*bf16", "rec_ptr": "*i32", "low_ptr": "*u8", "eptr_ptr": "*i32",
        "erow_ptr": "*i32", "ecol_ptr": "*i32", "edelta_ptr": "*fp32", "ws_ptr": "*fp32", "lock_ptr": "*i32"}
lv, ln, lx, mm, a, b, l3, xc, xs = mma.layouts(64, 32, 4)
wc, qc, wsl = mma.wsmem_layouts(4)
const = dict(BLOCK_N=64, BLOCK_M=32, USE_SPLIT=True, QPASS=False, ESC_CH=8, DEPTH=2, WSMEM=False, UNROLL=True, XC=4,
             PLAIN=False, L_VIEW=lv, L_NIB=ln, L_X=lx, MMA=mm, A_OP=a, B_OP=b, L_EP=l3, L_XC=xc, XS=xs, L_WC=wc,
             L_QC=qc, WSL=wsl)
div = list(ptrs) + ["K", "stride_xm", "stride_ym"]
warps = 4
"""


@needs_gluon
def test_x_chunks_take_one_barrier_per_chunk():
    """``x_chunk=4``: the loop body runs three chunks of four records (three x buffers) with one CTA
    barrier each (the indexed x ring takes two per record) and one pin per weight reload."""
    body = main_loop_ptx(_MMA_SETUP)
    assert body.count("bar.sync") == 3 and body.count("bar.warp.sync") == 12
    assert body.count("mma.sync.aligned.m16n8k16") == 12 * 16     # 4 k16 x 4 n8 per 16-row warp slice


def test_stream_k_schedule():
    schedule = mma_stream.schedule
    assert schedule(96, 64, 264) == (24, 256, 4)    # 6144 rows in 64-row blocks, K = 4096
    assert schedule(2, 3, 264) == (1, 6, 3)         # fewer pairs than programs: one each
    assert schedule(4, 1, 8) == (1, 4, 1)           # one record per block: no block is split
    per, progs, slots = schedule(7, 10, 5)
    assert progs * per >= 70 and (progs - 1) * per < 70 and slots == 2


@pytest.mark.parametrize("cfg", [mma.MmaConfig(64, 1, 4, 2, False, True, x_chunk=3),     # not 2, 4 or 8
                                 mma.MmaConfig(64, 1, 4, 2, x_chunk=2),                  # chunks need unroll
                                 mma.MmaConfig(64, 1, 4, 2, stream=2),                   # stream-K needs wsmem
                                 mma.MmaConfig(64, 1, 4, 2, True, stream=2, early_epilogue=True),  # rings only
                                 mma.MmaConfig(64, 1, 4, 2, maxnreg=300)])
def test_mma_bad_variant_configs_are_rejected(cfg):
    kp = KernelPack.from_w12(encode(make_weight(16, 64)), device="cpu")
    with pytest.raises((ValueError, RuntimeError)):
        mma.w12_mma(torch.zeros(8, 64, dtype=torch.bfloat16), kp, config=cfg)


MMA_CASES = [
    # x in chunks of 2-8 records, one barrier per chunk (partial chunks, an uneven split; at most
    # 320 k per program: longer fp32 tensor-core sums exceed the 2e-6 tolerance, ring or not)
    (32, 384, 1024, mma.MmaConfig(64, 4, 4, 2, False, True, x_chunk=2)),
    (17, 200, 320, mma.MmaConfig(64, 2, 4, 3, False, True, x_chunk=4)),
    (8, 136, 4160, mma.MmaConfig(128, 13, 8, 2, False, True, x_chunk=8)),
    (100, 136, 192, mma.MmaConfig(64, 1, 4, 2, False, True, x_chunk=2)),
    # stream-K: blocks split across programs, whole blocks, an odd pair count, two row blocks
    (32, 384, 1024, mma.MmaConfig(64, 1, 4, 2, True, stream=1)),
    (8, 200, 320, mma.MmaConfig(64, 1, 4, 3, True, stream=2)),
    (17, 136, 4160, mma.MmaConfig(128, 1, 8, 2, True, stream=1)),
    (100, 256, 512, mma.MmaConfig(64, 1, 4, 4, True, stream=4)),
]


@_gpu
@pytest.mark.parametrize("m,n,k,cfg", MMA_CASES)
def test_mma_variants_match_fp32_reference_and_are_deterministic(m, n, k, cfg):
    w, _, kp = _cuda_layer(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16().cuda()
    y = mma.w12_mma(x, kp, config=cfg, out_dtype=torch.float32)
    check_close(y.cpu(), x.cpu(), w)
    assert torch.equal(y.view(torch.int32), mma.w12_mma(x, kp, config=cfg, out_dtype=torch.float32).view(torch.int32))


@_gpu
@pytest.mark.parametrize("cfg", [mma.MmaConfig(64, 2, 4, 2, False, True), mma.MmaConfig(64, 1, 4, 3, False, True)])
@pytest.mark.parametrize("x_chunk", [2, 4])
def test_x_chunks_give_the_unchunked_bits(cfg, x_chunk):
    """The same MMAs in the same order: bitwise the unchunked ring's outputs, Q pass too."""
    _, _, kp = _cuda_layer(256, 1216, seed=5)
    x = torch.randn(32, 1216, generator=torch.Generator().manual_seed(3)).bfloat16().cuda()
    for qpass in (False, True):
        ref = mma.w12_mma(x, kp, qpass=qpass, config=cfg, out_dtype=torch.float32)
        y = mma.w12_mma(x, kp, qpass=qpass, config=replace(cfg, x_chunk=x_chunk), out_dtype=torch.float32)
        assert torch.equal(y.view(torch.int32), ref.view(torch.int32))


@_gpu
@pytest.mark.parametrize("cfg", [mma.MmaConfig(64, 3, 4, 2, True), mma.MmaConfig(128, 2, 4, 2, False, True)])
@pytest.mark.parametrize("qpass", [False, True])
def test_mma_fast_decode_gives_the_plain_decodes_bits(cfg, qpass):
    """The prmt/lop3 decode and the plain one in the tensor-core kernel: the same bits."""
    _, _, kp = _cuda_layer(256, 1088, seed=23)
    x = torch.randn(24, 1088, generator=torch.Generator().manual_seed(4)).bfloat16().cuda()
    y = mma.w12_mma(x, kp, qpass=qpass, config=cfg, out_dtype=torch.float32)
    yp = mma.w12_mma(x, kp, qpass=qpass, config=replace(cfg, plain_decode=True), out_dtype=torch.float32)
    assert torch.equal(y.view(torch.int32), yp.view(torch.int32))


# ---------------------------------------------------------------------------------------------
# the TMA rings: the decoded record through shared memory (``a_smem``), stream-K K groups
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [mma.MmaConfig(64, 1, 4, 3, tma=2, a_smem=True),
                                 mma.MmaConfig(64, 1, 4, 8, tma=3, kgroups=4, stream=2),
                                 mma.MmaConfig(64, 1, 4, 8, tma=3, kgroups=2, stream=1),
                                 mma.MmaConfig(64, 1, 4, 6, tma=3, kgroups=4, stream=1),
                                 mma.MmaConfig(64, 1, 4, 3, tma=3, a_smem=True, kgroups=2)])
def test_bad_tma_variant_configs_are_refused(bad):
    with pytest.raises(ValueError):
        mma_tma.check(bad)


_TMA_SETUP = r"""
from lab.w12.variants import mma_tma
k = mma_tma._w12_mma_tma_kernel
BN, BM = 64, 32
wl, xl = mma_tma.smem_layouts()
ptrs = {"x_ptr": "*bf16", "y_ptr": "*bf16", "low_ptr": "*u8", "eptr_ptr": "*i32", "erow_ptr": "*i32",
        "ecol_ptr": "*i32", "edelta_ptr": "*fp32", "ws_ptr": "*fp32", "lock_ptr": "*i32",
        "v_desc": f"tensordesc<i32[{BN}, 16],{wl!r}>", "q_desc": f"tensordesc<i32[{BN}, 8],{wl!r}>",
        "x_desc": f"tensordesc<bf16[{BM}, 64],{xl!r}>"}
const = dict(BLOCK_N=BN, BLOCK_M=BM, USE_SPLIT=True, QPASS=False, ESC_CH=8, STAGES=12, PLAIN=False, REGS=104,
             WG=True, KGROUPS=4, STREAM=True)
div = [p for p in ptrs if p.endswith("_ptr")] + ["K", "stride_xm", "stride_ym"]
warps = 4
opts = {"maxnreg": mma_tma.launch_regs(16, 104, 4, 24)}
"""


@needs_hopper_module
def test_stream_k_groups_compile_without_serialized_wgmma():
    """``tma=3, kgroups=4, stream=1`` for sm_90: four groups' record loops inside the block loop,
    the copy warp's three TMA copies, no spills, no serialization warning, and no write into an
    in-flight ``wgmma``'s A registers."""
    rep = ptxas_report(_TMA_SETUP)
    assert rep["rc"] == 0 and "0 bytes spill stores" in rep["log"], rep["log"]
    assert "serialized" not in rep["log"], rep["log"]
    assert rep["ptx"].count("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16") == 32
    assert ".reqntid 640" in rep["ptx"]
    assert inflight_a_writes(sass(_TMA_SETUP)) == []


WG_CASES = [
    # the decoded record through shared memory, the wgmma left in flight
    (17, 200, 320, mma.MmaConfig(64, 3, 4, 4, tma=3, a_smem=True)),
    (32, 384, 1024, mma.MmaConfig(128, 4, 8, 6, tma=3, a_smem=True)),
    (8, 256, 4160, mma.MmaConfig(64, 13, 4, 3, tma=3, a_smem=True)),
    # the four groups on a stream-K run (one program per SM): one pair per program (three groups
    # without a record), eight pairs and three programs per block, runs across block ends
    (32, 384, 1024, mma.MmaConfig(64, 1, 4, 12, tma=3, kgroups=4, stream=1)),
    (32, 4096, 1024, mma.MmaConfig(64, 1, 4, 8, tma=3, kgroups=4, stream=1)),
    (8, 9000, 128, mma.MmaConfig(64, 1, 4, 8, tma=3, kgroups=4, stream=1)),
]


@_gpu
@needs_hopper_module
@pytest.mark.parametrize("m,n,k,cfg", WG_CASES)
def test_wgmma_variants_match_reference_and_are_deterministic(m, n, k, cfg):
    """``tma=3``: the fp32 reference (the sums inside a ``wgmma`` are the hardware's, so the bits
    may differ from the ``mma.sync`` ring's: compared within tolerance), bitwise run to run, and the
    Q pass within tolerance of the ring's Q pass."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma needs sm_90")
    w, _, kp = _cuda_layer(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16().cuda()
    y = mma.w12_mma(x, kp, config=cfg, out_dtype=torch.float32)
    if k <= 1024:
        check_close(y.cpu(), x.cpu(), w)
    assert torch.equal(y.view(torch.int32), mma.w12_mma(x, kp, config=cfg, out_dtype=torch.float32).view(torch.int32))
    ring = replace(cfg, tma=0, wsmem=True, depth=2, num_warps=cfg.block_n // 16)
    for qpass in (False, True):
        ref = mma.w12_mma(x, kp, qpass=qpass, config=ring, out_dtype=torch.float32)
        got = mma.w12_mma(x, kp, qpass=qpass, config=cfg, out_dtype=torch.float32)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# the sweep's variant sets
# ---------------------------------------------------------------------------------------------

def test_sweep_variants_are_valid_configs():
    """``lab/w12/sweep.py --variants`` sets (tma, tma-pair, tma-wgmma, tma-kgroups, tma-kstream, tma-narrow,
    chunk-wide, xf32; tma, split, regs and spread in gemv-gluon mode; spread and tail in warpk mode) offer only
    configs the kernels accept."""
    path = Path(__file__).resolve().parents[1] / "w12" / "sweep.py"
    spec = importlib.util.spec_from_file_location("w12_sweep", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    gg = gemv_gluon
    for variants in ("tma", "tma-pair", "tma-wgmma", "tma-kgroups", "tma-kstream", "tma-narrow"):
        cfgs = bench.mma_configs(32, 64, 6144, 132, variants=variants)
        assert len(cfgs) > 4 and all(c.tma for c in cfgs[1:])
        for c in cfgs[1:]:
            mma_tma.check(c)
    assert bench.select_shapes(None) == bench.SHAPES and len(bench.SHAPES) == 7
    assert bench.select_shapes("llama8b.up,llama8b.o") == [("llama8b.up", 4096, 14336), ("llama8b.o", 4096, 4096)]
    for kt in (64, 224):   # chunk-wide: x copied once per K range of at most 16 records (one or two chunks)
        cw = bench.mma_configs(32, kt, 6144, 132, variants="chunk-wide")[1:]
        assert len(cw) == 24 and {c.block_n for c in cw} == {64, 128}
        assert all(c.unroll and c.x_chunk in (4, 8) and -(-kt // c.split_k) <= 16 for c in cw)
    xf = bench.gluon_gemv_configs(1, 64, 6144, 132, variants="xf32")
    assert any(c.xf32 for c in xf) and any(not c.xf32 for c in xf[1:])
    for c in xf:
        gg.check_config(c)
    tm = bench.gluon_gemv_configs(1, 272, 5120, 132, variants="tma")   # 17408 -> 5120: the shared-memory cap
    assert all(c.tma for c in tm[1:]) and {c.tma_box for c in tm} == {64, 256} and any(c.tma_epi_warp for c in tm)
    for c in tm[1:]:
        gg.check_config(c)
        assert gemv_tma.smem_bytes(272, c.rows, c.warps, c.depth, c.tma_rps) <= gemv_tma.SMEM_LIMIT
    for m in (8, 32):
        wk = bench.warpk_configs(m, 64, 6144, 132, variants="spread")
        assert sum(c.epi_spread for c in wk) >= 4
        for c in wk:
            warpk.check_config(c)
    tl = bench.warpk_configs(32, 64, 6144, 132, variants="tail")
    assert sum(c.tail_epilogue for c in tl) == 10 and {c.rows for c in tl} == {16, 32}
    for c in tl:
        warpk.check_config(c)
    for n in (6144, 4096):   # split: from committed choices with the escape chain spread (unsplit only)
        sl = bench.gluon_gemv_configs(1, 64, n, 132, variants="split")
        assert {c.split_k for c in sl} >= {1, 2, 8}
        for c in sl:
            gg.check_config(c)
    rg = bench.gluon_gemv_configs(1, 64, 4096, 132, variants="regs")   # 4096 -> 4096
    assert {c.maxnreg for c in rg} >= {64, 72, 80, 88, 96, None} and {c.split_k for c in rg} == {1, 2, 3}
    for c in rg:
        gg.check_config(c)
    sp = bench.gluon_gemv_configs(1, 64, 6144, 132, variants="spread")
    assert sum(c.epi_spread for c in sp) == sum(c.late_epilogue for c in sp) >= 6   # each late config, spread
    for c in sp:
        gg.check_config(c)
