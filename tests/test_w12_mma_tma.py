"""The TMA/mbarrier variant of the W12 tensor-core kernel (``kernels/w12/mma_tma.py``): config
checks and launch arithmetic on CPU, an sm_90 compile that shows no CTA barrier in the consumer
loop, and on a GPU the fp32 reference and the bits of the ``wsmem`` ring."""

from __future__ import annotations

import os
import re
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from specpilot.kernels import tuning  # noqa: E402
from specpilot.kernels.w12 import mma, mma_tma  # noqa: E402

from gluon_ptx import inflight_a_writes, ptxas_report, sass, waits_before_any_global_access  # noqa: E402
from test_w12_gemm import check_close  # noqa: E402
from test_w12_mma import _cuda_layer, _gpu_gluon  # noqa: E402


@pytest.mark.parametrize("bad", [mma.MmaConfig(64, 1, 4, 1, tma=1), mma.MmaConfig(64, 1, 4, 13, tma=1),
                                 mma.MmaConfig(256, 1, 4, 3, tma=1), mma.MmaConfig(48, 1, 4, 3, tma=1),
                                 mma.MmaConfig(64, 1, 4, 3, tma=4), mma.MmaConfig(128, 1, 4, 3, tma=2),
                                 mma.MmaConfig(128, 1, 4, 3, tma=3), mma.MmaConfig(64, 1, 4, 3, False, True, tma=3),
                                 mma.MmaConfig(64, 1, 4, 3, False, True, tma=1),
                                 mma.MmaConfig(64, 1, 4, 3, tma=2, kgroups=2), mma.MmaConfig(64, 1, 4, 3, tma=3, kgroups=3),
                                 mma.MmaConfig(64, 1, 4, 8, tma=1, kgroups=4),
                                 mma.MmaConfig(64, 1, 4, 3, tma=3, kgroups=4),
                                 mma.MmaConfig(64, 1, 4, 10, tma=3, kgroups=4), mma.MmaConfig(64, 1, 4, 3, tma=3, kgroups=2),
                                 mma.MmaConfig(128, 1, 8, 3, tma=3, kgroups=2)])
def test_bad_tma_configs_are_refused(bad):
    with pytest.raises(ValueError):
        mma_tma.check(bad)


def test_four_k_groups_refuse_64_x_rows():
    mma_tma.check_rows(mma.MmaConfig(64, 1, 4, 8, tma=3, kgroups=4), 32)
    mma_tma.check_rows(mma.MmaConfig(64, 1, 4, 8, tma=3, kgroups=2), 64)
    with pytest.raises(ValueError, match="at most 32 x rows"):
        mma_tma.check_rows(mma.MmaConfig(64, 1, 4, 8, tma=3, kgroups=4), 64)


def test_launch_registers_cover_the_consumers_and_the_copy_warps():
    for slices in (2, 4, 8):
        for regs in (72, 104, 168):
            for copiers, cregs in ((4, 48), (4, 24)):
                r = mma_tma.launch_regs(slices, regs, copiers, cregs)
                need = regs * slices + cregs * copiers
                assert r % 8 == 0 and r * (slices + copiers) >= need and (r - 8) * (slices + copiers) < need
    assert mma_tma.launch_regs(4, 104, 4, 24) == 64     # a group of 4 at 104: four programs per SM


_SETUP = r"""
from specpilot.kernels.w12 import mma_tma
k = mma_tma._w12_mma_tma_kernel
BN, BM = 64, 32
wl, xl = mma_tma.smem_layouts()
ptrs = {"x_ptr": "*bf16", "y_ptr": "*bf16", "low_ptr": "*u8", "eptr_ptr": "*i32", "erow_ptr": "*i32",
        "ecol_ptr": "*i32", "edelta_ptr": "*fp32", "ws_ptr": "*fp32", "lock_ptr": "*i32",
        "v_desc": f"tensordesc<i32[{BN}, 16],{wl!r}>", "q_desc": f"tensordesc<i32[{BN}, 8],{wl!r}>",
        "x_desc": f"tensordesc<bf16[{BM}, 64],{xl!r}>"}
const = dict(BLOCK_N=BN, BLOCK_M=BM, USE_SPLIT=True, QPASS=False, ESC_CH=8, STAGES=4, REGS=128)
div = [p for p in ptrs if p.endswith("_ptr")] + ["K", "stride_xm", "stride_ym"]
warps = 4
opts = {"maxnreg": mma_tma.launch_regs(4, 128)}
"""


@pytest.mark.skipif(not mma_tma.AVAILABLE, reason="Triton without Gluon's Hopper module")
@pytest.mark.parametrize("extra", ["", ", WG=True, KGROUPS=2"])
def test_under_pdl_the_kernel_waits_before_it_reads(extra):
    """``PDL=True`` (the launch under programmatic dependent launch): the wait for the previous
    kernel precedes every global access of every partition; dependents are not triggered early."""
    setup = _SETUP.replace("REGS=128)", f"REGS=104{extra}, PDL=True)").replace(
        "launch_regs(4, 128)", "launch_regs(8, 104, 4, 24)" if extra else "launch_regs(4, 104)")
    assert waits_before_any_global_access(setup)


@pytest.mark.skipif(not mma_tma.AVAILABLE, reason="Triton without Gluon's Hopper module")
def test_consumer_loop_has_no_cta_barrier():
    """Compiled for sm_90 (no GPU needed): each consumer warp's loop per record is one mbarrier wait,
    one arrival, the fragment loads and 16 MMAs (16 rows x 64 k x 32 x rows), with no CTA barrier;
    the copy warps issue the three TMA copies; ptxas spills nothing."""
    rep = ptxas_report(_SETUP)
    assert rep["rc"] == 0 and "0 bytes spill stores" in rep["log"], rep["log"]
    blocks = re.split(r"^(?=\$L__BB\d+_\d+:)", rep["ptx"], flags=re.M)
    consumer = [b for b in blocks if "mma.sync.aligned.m16n8k16" in b and "mbarrier.try_wait" in b]
    assert len(consumer) == 4                         # one loop per consumer warp
    for b in consumer:
        assert b.count("mma.sync.aligned.m16n8k16") == 16
        assert b.count("mbarrier.try_wait") == 1 and b.count("mbarrier.arrive") == 1
        assert "bar.sync" not in b and "barrier.sync" not in b
        # the warp's shared reads are fenced against the TMA copy that refills the stage (without
        # it the copy overwrites stages still being read: lab/w12/tma_race.py on the H200)
        assert b.index("fence.proxy.async") < b.index("mbarrier.arrive")
    producer = [b for b in blocks if "cp.async.bulk.tensor" in b]
    assert len(producer) == 1 and producer[0].count("cp.async.bulk.tensor") == 3


@pytest.mark.skipif(not mma_tma.AVAILABLE, reason="Triton without Gluon's Hopper module")
def test_wgmma_group_compiles_to_wgmma_retired_before_its_registers_are_reused():
    """``tma=3``, compiled for sm_90: per record the group waits once, fences its reads, arrives once
    and issues four ``wgmma`` (64 rows x 32 x rows x 16 k each) from the register A operand; no
    ``mma.sync``, no spills, no serialization warning; and in the SASS no instruction writes the A
    registers of a ``wgmma`` still in flight (ptxas does not protect them: with ``wait(1)`` the next
    record's loads landed there and results depended on timing)."""
    setup = _SETUP.replace("REGS=128)", "REGS=104, WG=True)").replace(
        "launch_regs(4, 128)", "launch_regs(4, 104, 4, 24)")
    rep = ptxas_report(setup)
    assert rep["rc"] == 0 and "0 bytes spill stores" in rep["log"], rep["log"]
    assert "serialized" not in rep["log"], rep["log"]
    assert "mma.sync" not in rep["ptx"]
    blocks = re.split(r"^(?=\$L__BB\d+_\d+:)", rep["ptx"], flags=re.M)
    steps = [b for b in blocks if "wgmma.mma_async" in b]
    assert len(steps) == 2                            # the first record, then the loop over the others
    assert re.search(r"bra(\.uni)?\s+" + re.escape(steps[1].split(":")[0]) + ";", steps[1])   # a loop
    for b in steps:
        assert b.count("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16") == 4
        assert b.count("mbarrier.try_wait") == 1 and b.count("mbarrier.arrive") == 1
        assert b.index("fence.proxy.async") < b.index("mbarrier.arrive")
        assert b.count("wgmma.wait_group.sync.aligned 0") == 1
    assert len([x for x in blocks if "cp.async.bulk.tensor" in x]) == 1
    code = sass(setup)
    assert code.count("HGMMA.64x32x16.F32.BF16") == 8 and inflight_a_writes(code) == []   # (peeled + loop)


@pytest.mark.skipif(not mma_tma.AVAILABLE, reason="Triton without Gluon's Hopper module")
def test_two_k_groups_compile_to_two_wgmma_loops_with_barriers_of_their_own():
    """``tma=3, kgroups=2``, compiled for sm_90: each warpgroup has its peeled record and its loop
    (four ``wgmma`` each, retired before the next record), the two groups synchronize their own
    warps on distinct named barriers (128 threads each), the consumers get their ``setmaxnreg``
    counts, nothing spills, and no instruction writes an in-flight ``wgmma``'s A registers."""
    setup = _SETUP.replace("REGS=128)", "REGS=104, WG=True, KGROUPS=2)").replace(
        "launch_regs(4, 128)", "launch_regs(8, 104, 4, 24)")
    rep = ptxas_report(setup)
    assert rep["rc"] == 0 and "0 bytes spill stores" in rep["log"], rep["log"]
    assert "serialized" not in rep["log"], rep["log"]
    ptx = rep["ptx"]
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16") == 16   # 2 groups x (peel + loop) x 4
    assert ptx.count("wgmma.wait_group.sync.aligned 0") >= 4
    named = set(re.findall(r"bar\.sync\s+(\d+),\s*128;", ptx))
    assert len(named) == 2, named                     # one barrier id per group
    assert ".reqntid 384" in ptx                      # 2 groups + the copy warp's warpgroup
    assert "setmaxnreg.inc.sync.aligned.u32 \t104;" in ptx
    code = sass(setup)
    assert code.count("HGMMA.64x32x16.F32.BF16") == 16 and inflight_a_writes(code) == []


def test_inflight_a_register_check_sees_a_reuse():
    """The SASS check itself: a register-A ``HGMMA`` left in flight (``DEPBAR.LE gsb0, 0x1``) whose
    A registers the next iteration loads into is reported; retired at once (``0x0``), it is not."""
    loop = """
.L_x_1:
        /*0100*/                   LDS.64 R56, [R18+0xb000] ;
        /*0110*/                   WARPGROUP.ARRIVE ;
        /*0120*/                   HGMMA.64x32x16.F32.BF16 R24, R56, gdesc[UR16], R24, gsb0 ;
        /*0130*/                   WARPGROUP.DEPBAR.LE gsb0, 0x{keep} ;
        /*0140*/               @P1 BRA `(.L_x_1) ;
"""
    assert inflight_a_writes(loop.format(keep=1)) == ["LDS.64 R56, [R18+0xb000]"]
    assert inflight_a_writes(loop.format(keep=0)) == []


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

CASES = [  # (rows, N, K, config): partial tiles and records, uneven splits, 2-8 slices, 2-64 x rows
    (2, 40, 200, mma.MmaConfig(32, 1, 4, 3, tma=1)),
    (8, 256, 512, mma.MmaConfig(64, 2, 4, 4, tma=1)),
    (17, 200, 320, mma.MmaConfig(64, 3, 4, 3, tma=1)),
    (32, 384, 1024, mma.MmaConfig(64, 4, 4, 6, tma=1)),
    (32, 136, 4160, mma.MmaConfig(32, 13, 4, 8, tma=1)),
    (64, 128, 256, mma.MmaConfig(64, 1, 4, 2, tma=1)),
    (16, 256, 1024, mma.MmaConfig(128, 3, 4, 4, tma=1)),   # eight consumer warps
    # the program's warps as one consumer group
    (17, 200, 320, mma.MmaConfig(64, 3, 4, 4, tma=2)),
    (32, 384, 1024, mma.MmaConfig(128, 4, 8, 6, tma=2)),
    (100, 136, 192, mma.MmaConfig(64, 2, 4, 3, tma=2)),
    # the group taking two records per step: an even and an odd record count per split
    (32, 384, 1024, mma.MmaConfig(64, 4, 4, 4, False, True, tma=2)),
    (17, 200, 320, mma.MmaConfig(64, 1, 4, 2, False, True, tma=2)),
]
WG_CASES = [  # the group on wgmma: 1-3 records per split, 4 and 8 warps, 2-64 x rows, two row blocks
    (2, 40, 200, mma.MmaConfig(64, 1, 4, 2, tma=3)),
    (17, 200, 320, mma.MmaConfig(64, 3, 4, 4, tma=3)),
    (32, 384, 1024, mma.MmaConfig(128, 4, 8, 6, tma=3)),
    (8, 256, 4160, mma.MmaConfig(64, 13, 4, 3, tma=3)),
    (100, 136, 192, mma.MmaConfig(64, 2, 4, 3, tma=3)),
    # two warpgroups taking every other record: 5 records (3 + 2), 1 per split (the second group has
    # none), 4 or 5 per split, two row blocks
    (17, 200, 320, mma.MmaConfig(64, 1, 4, 4, tma=3, kgroups=2)),
    (100, 136, 192, mma.MmaConfig(64, 3, 4, 4, tma=3, kgroups=2)),
    (8, 256, 4160, mma.MmaConfig(64, 13, 4, 6, tma=3, kgroups=2)),
    (32, 384, 1024, mma.MmaConfig(64, 4, 4, 2, tma=3, kgroups=2)),
    # four groups: 5 records (2 + 1 + 1 + 1), 2 per split (two groups without one), 16 per split
    (17, 200, 320, mma.MmaConfig(64, 1, 4, 8, tma=3, kgroups=4)),
    (32, 136, 256, mma.MmaConfig(64, 2, 4, 4, tma=3, kgroups=4)),
    (32, 384, 1024, mma.MmaConfig(64, 1, 4, 12, tma=3, kgroups=4)),
]


_PAST_N = r"""
import dataclasses, torch
from test_w12_mma import _cuda_layer
from specpilot.kernels.w12 import mma
_, _, kp = _cuda_layer(40, 200, seed=2)
n = kp.esc_rowptr.numel()
padded = torch.full((n + 64,), -(1 << 30), dtype=kp.esc_rowptr.dtype, device="cuda")
padded[:n] = kp.esc_rowptr
poisoned = dataclasses.replace(kp, esc_rowptr=padded[:n])
x = torch.randn(2, 200, generator=torch.Generator().manual_seed(2)).bfloat16().cuda()
cfg = mma.MmaConfig(32, 1, 4, 3, tma=1)
want = mma.w12_mma(x, kp, config=cfg, out_dtype=torch.float32)
got = mma.w12_mma(x, poisoned, config=cfg, out_dtype=torch.float32)
torch.cuda.synchronize()
print(torch.equal(got.view(torch.int32), want.view(torch.int32)))
"""


@_gpu_gluon
@pytest.mark.skipif(not mma_tma.AVAILABLE, reason="Triton without Gluon's Hopper module")
def test_a_slice_past_the_last_row_reads_no_row_pointer_past_n():
    """``tma=1`` with 32-row programs over 40 rows: the second program's second 16-row slice starts
    at row 48, past N. Its epilogue read the escape row pointer ``eptr[48]``, past the N + 1 there
    are (compute-sanitizer, PyTorch's allocator cache off: an invalid global read), and walked the
    escapes from whatever lay there (an illegal address when that was negative). With the row
    pointers followed by -2**30 the product still equals the plain pack's; in a child process,
    since a fault leaves the process's CUDA context unusable."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _PAST_N], capture_output=True, text=True, timeout=600,
                       cwd=os.path.dirname(os.path.abspath(__file__)))
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1:] == ["True"], r.stderr[-3000:]


@_gpu_gluon
@pytest.mark.skipif(not mma_tma.AVAILABLE, reason="Triton without Gluon's Hopper module")
def test_a_consumer_warp_per_16_rows_refuses_a_second_row_block():
    """tma=1 over two x row blocks faulted on the H200 (illegal address): refused, not launched."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90")
    _, _, kp = _cuda_layer(136, 192, seed=100)
    x = torch.randn(100, 192, generator=torch.Generator().manual_seed(100)).bfloat16().cuda()
    with pytest.raises(ValueError, match="tma=1 takes at most 64 x rows"):
        mma.w12_mma(x, kp, config=mma.MmaConfig(32, 2, 4, 4, tma=1), out_dtype=torch.float32)


@_gpu_gluon
@pytest.mark.skipif(not mma_tma.AVAILABLE, reason="Triton without Gluon's Hopper module")
@pytest.mark.parametrize("m,n,k,cfg", CASES)
def test_tma_matches_reference_and_the_wsmem_bits(m, n, k, cfg):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90")
    w, _, kp = _cuda_layer(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16().cuda()
    y = mma.w12_mma(x, kp, config=cfg, out_dtype=torch.float32)
    if k <= 1024:   # (longer fp32 tensor-core sums exceed check_close's 2e-6; the bits below still hold)
        check_close(y.cpu(), x.cpu(), w)
    assert torch.equal(y.view(torch.int32), mma.w12_mma(x, kp, config=cfg, out_dtype=torch.float32).view(torch.int32))
    ring = replace(cfg, tma=0, wsmem=True, unroll=False, depth=2, num_warps=cfg.block_n // 16)   # same fragments, MMA order
    for qpass in (False, True):
        ref = mma.w12_mma(x, kp, qpass=qpass, config=ring, out_dtype=torch.float32)
        got = mma.w12_mma(x, kp, qpass=qpass, config=cfg, out_dtype=torch.float32)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@_gpu_gluon
@pytest.mark.skipif(not mma_tma.AVAILABLE, reason="Triton without Gluon's Hopper module")
@pytest.mark.parametrize("m,n,k,cfg", WG_CASES)
def test_wgmma_group_matches_reference_and_is_deterministic(m, n, k, cfg):
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


@_gpu_gluon
@pytest.mark.skipif(not mma_tma.AVAILABLE, reason="Triton without Gluon's Hopper module")
def test_tma_rings_are_stable_with_several_programs_per_sm():
    """The race the proxy fence and the wgmma wait prevent (``lab/w12/tma_race.py``): on a
    4096 -> 28672 layer at 32 rows, three or four programs share an SM and the copy warp refills
    stages as soon as it may; every mode must then give the ring's bits (``tma=1|2``) or its own
    (``tma=3``) on every run (without the fence ``tma=2`` differs in 30 of 30 runs here)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs sm_90")
    w, _, kp = _cuda_layer(28672, 4096, seed=5)
    x = torch.randn(32, 4096, generator=torch.Generator().manual_seed(5)).bfloat16().cuda()
    ring = mma.w12_mma(x, kp, config=mma.MmaConfig(64, 1, 4, 2, True), out_dtype=torch.float32)
    for cfg in (mma.MmaConfig(64, 1, 4, 4, tma=2), mma.MmaConfig(64, 1, 4, 4, tma=1),
                mma.MmaConfig(64, 1, 4, 4, tma=3), mma.MmaConfig(64, 1, 4, 6, tma=3, kgroups=2),
                mma.MmaConfig(64, 1, 4, 8, tma=3, kgroups=4)):
        first = mma.w12_mma(x, kp, config=cfg, out_dtype=torch.float32)
        if cfg.tma != 3:
            assert torch.equal(first.view(torch.int32), ring.view(torch.int32)), cfg
        for _ in range(8):
            y = mma.w12_mma(x, kp, config=cfg, out_dtype=torch.float32)
            assert torch.equal(y.view(torch.int32), first.view(torch.int32)), cfg


def test_w12_mma_hands_a_tma_config_to_the_tma_launcher(monkeypatch):
    """``w12_mma`` with ``tma=1`` checks the config and calls :func:`.mma_tma.launch` with the
    aligned x and the split grid (caught on CPU: a signature slip cost a GPU run once)."""
    from specpilot.kernels.w12 import encode
    from specpilot.kernels.w12.gluon_common import esc_chunk
    from specpilot.kernels.w12.pack import KernelPack

    from test_w12_gemm import make_weight

    seen = {}

    def fake_launch(x, packed, out, qpass, cfg, grid, esc_ch):
        seen.update(x=x, cfg=cfg, grid=grid, esc_ch=esc_ch)

    monkeypatch.setattr(mma_tma, "launch", fake_launch)
    monkeypatch.setattr(mma_tma, "AVAILABLE", True)
    kp = KernelPack.from_w12(encode(make_weight(200, 320)), device="cpu")
    cfg = mma.MmaConfig(32, 3, 4, 4, tma=1)
    mma.w12_mma(torch.zeros(17, 320, dtype=torch.bfloat16), kp, config=cfg)
    assert seen["cfg"] is cfg and seen["grid"][:5] == (32, 2, 3, 7, 1) and seen["esc_ch"] == esc_chunk(32)
    with pytest.raises(ValueError):
        mma.w12_mma(torch.zeros(17, 320, dtype=torch.bfloat16), kp, config=mma.MmaConfig(48, 1, 4, 4, tma=1))


def _mma_entries():
    return [(e, mma.MmaConfig(**e["config"])) for e in tuning.table("w12", "sm90")["entries"] if e["kernel"] == "mma"]


def test_tuned_tma_entries_only_where_tma_runs():
    """The table's TMA entries are skipped off Hopper (the heuristic default instead), and CPU
    tensors never count as TMA-capable."""
    e = next(e for e, c in _mma_entries() if c.tma)
    (n, k), bm = (e["n"], e["k"]), e["rows"][1]
    assert mma.default_config(bm, n, k).tma
    assert not mma.default_config(bm, n, k, tma=False).tma
    assert not mma_tma.supported("cpu")
    wg = next(e for e, c in _mma_entries() if c.tma == 3)   # wgmma entries: Hopper 9.x only
    assert mma.default_config(wg["rows"][1], wg["n"], wg["k"]).kgroups > 1
    assert mma.default_config(wg["rows"][1], wg["n"], wg["k"], wgmma=False).tma != 3
    for _, cfg in _mma_entries():   # every TMA entry is one the TMA rings accept
        if cfg.tma:
            mma_tma.check(cfg)


def test_routing_puts_the_wgmma_entries_first_only_where_wgmma_runs(monkeypatch):
    """``routing.route``: on 4096 -> 6144 at 17-32 rows the table's four wgmma K groups go before the
    ``warpk`` entry on a Hopper GPU, the ``warpk`` entry stays the choice elsewhere; layers without a
    ``warpk`` entry take ``mma`` either way; 2-8 rows stay on ``warpk``; CPU tensors take ``gemm``."""
    from types import SimpleNamespace

    from specpilot.kernels.w12 import routing, warpk

    def pack(n, k):
        return SimpleNamespace(shape=(n, k))

    assert routing.route(torch.zeros(32, 4096, dtype=torch.bfloat16), pack(6144, 4096)) == "gemm"
    monkeypatch.setattr(warpk, "supported", lambda x, p: True)
    monkeypatch.setattr(mma, "supported", lambda x, p: True)
    for hopper, want in ((True, "mma"), (False, "warpk")):
        monkeypatch.setattr(mma_tma, "supported", lambda device, h=hopper: h)
        monkeypatch.setattr(mma_tma, "wgmma_supported", lambda device, h=hopper: h)
        assert mma.tuned_config(32, 6144, 4096).tma == 3 and warpk.tuned_config(32, 6144, 4096) is not None
        assert routing.route(torch.zeros(24, 4096, dtype=torch.bfloat16), pack(6144, 4096)) == want
        assert routing.route(torch.zeros(32, 4096, dtype=torch.bfloat16), pack(4096, 4096)) == "mma"
        assert routing.route(torch.zeros(8, 4096, dtype=torch.bfloat16), pack(6144, 4096)) == "warpk"


def test_sweep_shapes_take_the_unfused_projections_and_refuse_unknown_names():
    """``--shapes``: the seven layers by default, transformers' unfused k/v and up projections by
    name; an unknown name is a one-line error and exit 2 before any GPU work."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "w12_gemm.py"
    r = subprocess.run([sys.executable, str(script), "--shapes", "llama8b.kv,nope"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unknown shape nope" in r.stderr and len(r.stderr.strip().splitlines()) == 1
