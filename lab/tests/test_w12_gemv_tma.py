"""The one-row W12 GEMV fed by a TMA ring (``lab/w12/variants/gemv_tma.py``): config checks, an sm_90
compile on the CPU that checks the consumer and copy loops, and on a GPU the kernel against the
register-ring GEMV's bits (partial tiles, odd K, escapes, +-0 and extreme x, Q pass), run to run
and with many programs per SM."""

from __future__ import annotations

import os
import re

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from specpilot.kernels.w12 import encode  # noqa: E402
from lab.w12.variants import gemv_gluon as gg  # noqa: E402
from lab.w12.variants import gemv_tma  # noqa: E402
from specpilot.kernels.w12.pack import KernelPack  # noqa: E402

from gluon_ptx import ptxas_report  # noqa: E402
from test_w12_gemm import check_close, extreme_row, make_weight  # noqa: E402

C = gg.GluonGemvConfig


def _gpu(fn):
    skip = pytest.mark.skipif(not torch.cuda.is_available() or not gemv_tma.AVAILABLE,
                              reason="needs CUDA and Gluon's Hopper module")
    return pytest.mark.gpu(skip(fn))


@pytest.mark.parametrize("bad", [C(16, 4, 1, tma=True), C(16, 4, 17, tma=True), C(16, 4, 4, tma=True, tma_rps=3),
                                 C(16, 4, 4, 2, tma=True), C(16, 4, 4, unroll=True, tma=True),
                                 C(16, 4, 4, xs=True, tma=True), C(16, 2, 4, tma=True),
                                 C(16, 4, 4, tma=True, tma_box=128), C(16, 4, 4, tma_epi_warp=True)])
def test_bad_tma_configs_are_refused(bad):
    with pytest.raises(ValueError):
        gg.check_config(bad)


def test_key_and_shared_memory_budget():
    cfg = C(16, 4, 6, tma=True, tma_rps=2)
    gg.check_config(cfg)
    assert cfg.key().endswith("-tma2") and C(16, 4, 6).key() != cfg.key()
    assert C(16, 4, 6, tma=True, tma_box=64).key().endswith("-tma1-b64")
    assert gemv_tma.box_words(256) == (64, 64) and gemv_tma.box_words(64) == (16, 8)
    # 4096 -> 28672: 6 stages of 2 x 4 records of 16 rows (96 B each), x for 64 records, barriers
    assert gemv_tma.stage_bytes(16, 4, 2) == 12288 and gemv_tma.xs_groups(64, 4, 2) == 16
    assert gemv_tma.smem_bytes(64, 16, 4, 6, 2) == 6 * 12288 + 16 * 4 * 128 + 96
    assert gemv_tma.xs_groups(272, 4, 4) % 8 == 0 and gemv_tma.xs_groups(272, 4, 4) * 4 >= 272


_SETUP = r"""
from lab.w12.variants import gemv_tma, gemv_gluon
k = gemv_tma._w12_gemv_tma_kernel
lay = gemv_tma._box_layout()
lv, lq, lx, le = gemv_gluon.layouts(16, 4)
ptrs = {"x_ptr": "*bf16", "x32_ptr": "*i32", "y_ptr": "*bf16", "low_ptr": "*u8", "eptr_ptr": "*i32",
        "erow_ptr": "*i32", "ecol_ptr": "*i32", "edelta_ptr": "*fp32",
        "v_desc": f"tensordesc<i32[8, 4, 64],{lay!r}>", "q_desc": f"tensordesc<i32[8, 2, 64],{lay!r}>"}
const = dict(ROWS=16, WARPS=4, RPS=2, STAGES=6, QPASS=False, PLAIN=False, ESC_CH=8, XS_IT=16, XS_CH=8,
             L_V=lv, L_Q=lq, L_X=lx, L_E=le, EPI_WARP=EW, L_E1=gemv_gluon.layouts(16, 1)[3])
div = [p for p in ptrs if p.endswith("_ptr")]
warps = 4
opts = {"maxnreg": gemv_tma.launch_regs(4, 88, EW)}
"""


@pytest.mark.skipif(not gemv_tma.AVAILABLE, reason="Triton without Gluon's Hopper module")
@pytest.mark.parametrize("epi_warp", [False, True])
def test_consumer_reads_shared_memory_and_the_copy_warp_issues_two_boxes(epi_warp):
    """Compiled for sm_90: the consumer loop per stage is one mbarrier wait, shared loads only (no
    global load), the fence and the partition's barrier before its one arrival, and 64 FMAs (two
    records of 16 rows x 64 k over 128 threads, 4 per lane and record pair of words); the copy loop
    issues two TMA boxes per stage; no mbarrier is initialized that the flags leave unused; nothing
    spills, the epilogue's loader warp included (its warpgroup at 48 registers)."""
    rep = ptxas_report(f"EW = {epi_warp}\n" + _SETUP)
    assert rep["rc"] == 0 and "0 bytes spill stores" in rep["log"], rep["log"]
    # the ring's 2 x 6 mbarriers, and the loader's only with the loader: an unused one was placed by
    # the allocator inside the staged x, which cp.async then overwrote (wrong sums on the H200)
    assert rep["ptx"].count("mbarrier.init") == 12 + epi_warp
    blocks = re.split(r"^(?=\$L__BB\d+_\d+:)", rep["ptx"], flags=re.M)
    consumer = [b for b in blocks if len(re.findall(r"fma\.rn\.f32", b)) == 64 and "mbarrier.try_wait" in b]
    assert len(consumer) == 1
    if epi_warp:
        assert "setmaxnreg.inc.sync.aligned.u32 \t48" in rep["ptx"]
    b = consumer[0]
    assert b.count("mbarrier.try_wait") == 1 and b.count("mbarrier.arrive") == 1
    assert "ld.global" not in b and b.count("ld.shared") >= 8
    assert len(re.findall(r"fma\.rn\.f32", b)) == 64
    # the stage is released once, after every consumer warp's reads: fence, the partition's barrier
    # (Gluon's, before a multi-warp partition's arrival), then the arrival
    bar = re.search(r"\b(bar|barrier)\.sync", b)
    assert bar and b.index("fence.proxy.async") < bar.start() < b.index("mbarrier.arrive"), b
    producer = [b for b in blocks if "cp.async.bulk.tensor" in b]
    assert len(producer) == 1 and producer[0].count("cp.async.bulk.tensor.3d") == 2


CASES = [  # (N, K, register-ring config: rows, warps) x TMA (stages, records per warp and stage, box row bytes)
    (40, 200, C(8, 4, 1), 2, 1, 256),      # a partial tile and a partial record, past-range steps
    (40, 200, C(8, 4, 1), 2, 1, 64),
    (128, 64, C(16, 4, 1), 3, 2, 256),     # fewer records than one stage
    (200, 1088, C(16, 4, 1), 4, 4, 64),    # 17 records
    (384, 4160, C(32, 4, 1), 6, 1, 256),   # 65 records, rows of three tiles
    (256, 2048, C(16, 8, 1), 3, 2, 256),
    (136, 4160, C(8, 4, 1), 16, 1, 256),   # a ring deeper than the range
    (136, 4160, C(16, 4, 1), 16, 1, 64),
]


@_gpu
@pytest.mark.parametrize("n,k,cfg,stages,rps,box", CASES)
@pytest.mark.parametrize("qpass", [False, True])
def test_tma_gives_the_register_rings_bits(n, k, cfg, stages, rps, box, qpass):
    """Bitwise the register-ring GEMV's output (same rows and warps: same order), run to run, and
    within the fp32 bound of the exact product (escapes, +-0, subnormal and large x)."""
    from dataclasses import replace

    w = make_weight(n, k, seed=n * 5 + k)
    t = encode(w)
    assert t.num_escapes > 0
    kp = KernelPack.from_w12(t, device="cuda")
    x = extreme_row(k, k + 3)
    tc = replace(cfg, depth=stages, tma=True, tma_rps=rps, tma_box=box)
    y = gg.w12_gemv_gluon(x, kp, qpass=qpass, config=tc, out_dtype=torch.float32)
    ref = gg.w12_gemv_gluon(x, kp, qpass=qpass, config=cfg, out_dtype=torch.float32)
    assert torch.equal(y.view(torch.int32), ref.view(torch.int32))
    y2 = gg.w12_gemv_gluon(x, kp, qpass=qpass, config=tc, out_dtype=torch.float32)
    assert torch.equal(y.view(torch.int32), y2.view(torch.int32))
    if not qpass:
        check_close(y.cpu(), x.cpu(), w)


@_gpu
def test_ring_is_stable_with_many_programs_per_sm():
    """4096 -> 6144 at 8 rows (768 programs, several per SM, the ring full most of the time) and 16
    rows, both box forms: 20 runs of each give the same bits as the register ring (a missing fence,
    or shared memory written over a live mbarrier, shows up here as drift)."""
    w = make_weight(6144, 4096, seed=9)
    kp = KernelPack.from_w12(encode(w), device="cuda")
    x = torch.randn(1, 4096, generator=torch.Generator().manual_seed(1)).bfloat16().cuda()
    ref = gg.w12_gemv_gluon(x, kp, config=C(8, 4, 1), out_dtype=torch.float32)
    ref16 = gg.w12_gemv_gluon(x, kp, config=C(16, 4, 1), out_dtype=torch.float32)
    for rows, box, want in ((8, 256, ref), (8, 64, ref), (16, 256, ref16), (16, 64, ref16)):
        for _ in range(20):
            y = gg.w12_gemv_gluon(x, kp, config=C(rows, 4, 4, tma=True, tma_box=box), out_dtype=torch.float32)
            assert torch.equal(y.view(torch.int32), want.view(torch.int32))


@_gpu
@pytest.mark.parametrize("n,k,cfg", [(40, 200, C(8, 4, 3, tma=True, tma_box=64, tma_epi_warp=True)),
                                     (384, 4160, C(16, 4, 4, tma=True, tma_rps=2, tma_epi_warp=True))])
@pytest.mark.parametrize("qpass", [False, True])
def test_epilogue_loader_warp_gives_the_same_bits(n, k, cfg, qpass):
    """The epilogue's operands from the loader warp: bitwise the register ring's output, with more
    escapes in a block than one chunk (row 0 has 32), run to run."""
    from dataclasses import replace

    w = make_weight(n, k, seed=n + 11 * k)
    kp = KernelPack.from_w12(encode(w), device="cuda")
    x = (torch.randn(1, k, generator=torch.Generator().manual_seed(5)) * 3).bfloat16().cuda()
    ref = gg.w12_gemv_gluon(x, kp, qpass=qpass, config=C(cfg.rows, cfg.warps, 1), out_dtype=torch.float32)
    for c in (cfg, replace(cfg, tma_epi_warp=False)):
        for _ in range(3):
            y = gg.w12_gemv_gluon(x, kp, qpass=qpass, config=c, out_dtype=torch.float32)
            assert torch.equal(y.view(torch.int32), ref.view(torch.int32))
