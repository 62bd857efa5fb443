"""The Gluon tensor-core W12 GEMM (``kernels/w12/mma.py``): layouts on CPU, an sm_90 compile that
proves the operand conversions move no data, and the kernel against the reference on a GPU."""

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
from specpilot.kernels.w12 import fragments, mma, routing  # noqa: E402
from specpilot.kernels.w12.pack import KernelPack  # noqa: E402
from specpilot.kernels.w12.naive import w12_linear_ref  # noqa: E402

from gluon_ptx import main_loop_ptx, waits_before_any_global_access  # noqa: E402
from test_w12_gemm import check_close, make_weight  # noqa: E402


def _gpu_gluon(fn):
    """Marked ``gpu``; skipped without CUDA or Gluon."""
    skip = pytest.mark.skipif(not torch.cuda.is_available() or mma.gluon is None, reason="needs CUDA and Gluon")
    return pytest.mark.gpu(skip(fn))


def _cuda_layer(n, k, seed):
    """A test weight (escapes included), its W12 encoding and the kernel layout on the GPU."""
    w = make_weight(n, k, seed=seed)
    t = encode(w)
    return w, t, KernelPack.from_w12(t, device="cuda")


needs_gluon = pytest.mark.skipif(mma.gluon is None, reason="Triton without Gluon")


def _span(bases, rank_shape):
    """Every coordinate the bases reach (XOR combinations), as a set of tuples."""
    pts = {tuple([0] * len(rank_shape))}
    for b in bases:
        pts |= {tuple(p ^ q for p, q in zip(pt, b)) for pt in pts}
    return pts


@pytest.mark.parametrize("bn,bm,w", [(64, 8, 4), (128, 32, 4), (128, 64, 8), (64, 16, 2)])
def test_load_layouts_cover_each_tile_once(bn, bm, w):
    b = fragments.layout_bases(bn, bm, w)
    for name, (reg, lane, warp, shape) in b.items():
        nonzero = [v for v in reg + lane + warp if any(v)]
        pts = _span(nonzero, shape)
        assert len(pts) == shape[0] * shape[1] == 2 ** len(nonzero), name   # a bijection onto the tile
        assert all(0 <= p[0] < shape[0] and 0 <= p[1] < shape[1] for p in pts)
    # a thread's four view words are consecutive (one 16-byte load), and its x values too
    assert b["view"][0][:2] == [[0, 1], [0, 2]]
    assert b["x"][0][:4] == [[0, 1], [0, 2], [0, 4], [0, 8]]


def test_mma_k_order_is_a_permutation_matching_the_thread_words():
    perm = [fragments.mma_k_to_physical(k) for k in range(64)]
    assert sorted(perm) == list(range(64))
    for t in range(4):   # lane t's MMA k {16j + 8s + 2t + c} are physical k 16t .. 16t + 15
        ks = [16 * j + 8 * s + 2 * t + c for j in range(4) for s in range(2) for c in range(2)]
        assert sorted(perm[k] for k in ks) == list(range(16 * t, 16 * t + 16))


@pytest.mark.parametrize("bad", [(96, 32, 4), (256, 32, 4), (128, 24, 4), (128, 128, 4)])
def test_layout_bases_reject_bad_blocks(bad):
    with pytest.raises(ValueError):
        fragments.layout_bases(*bad)


_SETUP = r"""
from specpilot.kernels.w12 import fragments, mma
k = mma._w12_mma_kernel
ptrs = {"x_ptr": "*bf16", "y_ptr": "*bf16", "rec_ptr": "*i32", "low_ptr": "*u8", "eptr_ptr": "*i32",
        "erow_ptr": "*i32", "ecol_ptr": "*i32", "edelta_ptr": "*fp32", "ws_ptr": "*fp32", "lock_ptr": "*i32"}
lv, ln, lx, mm, a, b, l3, xc, xs = fragments.mma_layouts(128, 32, 4)
wc, qc, wsl = mma.wsmem_layouts(4)
const = dict(BLOCK_N=128, BLOCK_M=32, USE_SPLIT=True, QPASS=False, ESC_CH=8, DEPTH=2, WSMEM=False, UNROLL=False,
             L_VIEW=lv, L_NIB=ln, L_X=lx, MMA=mm, A_OP=a, B_OP=b, L_EP=l3, L_XC=xc, XS=xs, L_WC=wc, L_QC=qc, WSL=wsl)
div = list(ptrs) + ["K", "stride_xm", "stride_ym"]
warps = 4
"""


@needs_gluon
def test_under_pdl_the_kernel_waits_before_it_reads():
    """``PDL=True``: the wait for the previous kernel precedes the first record or x copy;
    dependents are not triggered early."""
    assert waits_before_any_global_access(_SETUP.replace("WSL=wsl)", "WSL=wsl, PDL=True)"))


@needs_gluon
def test_compiles_for_sm90_with_register_only_operand_conversions():
    """The A and B operand conversions are compiled with ``assert_trivial=True``; compiling for
    sm_90 on any machine (no GPU needed) fails if one of them would move data. In the main loop the
    weights never touch shared memory (16-byte view and 8-byte nibble loads straight into
    registers), x arrives by cp.async and is read as 16-byte shared loads, then mma.sync."""
    body = main_loop_ptx(_SETUP, header="Inner Loop Header")
    stats = {"mma": body.count("mma.sync.aligned.m16n8k16"), "st_shared": body.count("st.shared"),
             "ld_shared_v4": len(re.findall(r"ld\.shared\.v4", body)), "cp_async": body.count("cp.async.cg"),
             "v4": len(re.findall(r"ld\.global[^;]*\.v4", body))}
    assert stats["mma"] == 32            # 2 m16 x 4 k16 x 4 n8 per warp per record
    assert stats["st_shared"] == 0       # no shared-memory round trip for the weights
    assert stats["v4"] == 4              # the next record's views: 4 rows per thread
    assert stats["cp_async"] >= 1 and stats["ld_shared_v4"] == 8   # x: 4 rows x 32 bytes per thread


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

CASES = [  # (rows, N, K, config)
    (2, 40, 200, mma.MmaConfig(64, 1)),        # a partial tile, a partial record
    (8, 256, 512, mma.MmaConfig(128, 2)),
    (17, 200, 320, mma.MmaConfig(64, 3)),      # uneven split
    (32, 384, 1024, mma.MmaConfig(128, 4, 8)),
    (64, 128, 256, mma.MmaConfig(128, 1)),
    (100, 136, 192, mma.MmaConfig(64, 2)),     # two row blocks, the last one partial
    # weights through the shared-memory ring
    (2, 40, 200, mma.MmaConfig(64, 1, 4, 2, True)),
    (17, 200, 320, mma.MmaConfig(64, 3, 4, 4, True)),
    (32, 384, 1024, mma.MmaConfig(128, 4, 8, 6, True)),
    (100, 136, 192, mma.MmaConfig(128, 2, 4, 1, True)),
    # unrolled register rings: an even and an odd record count (the last record after the loop)
    (8, 256, 512, mma.MmaConfig(64, 1, 4, 2, False, True)),
    (17, 200, 320, mma.MmaConfig(64, 1, 4, 2, False, True)),
    (32, 384, 1024, mma.MmaConfig(128, 3, 8, 3, False, True)),
    (64, 136, 448, mma.MmaConfig(64, 2, 4, 3, False, True)),
]


@_gpu_gluon
@pytest.mark.parametrize("m,n,k,cfg", CASES)
def test_w12_mma_matches_fp32_reference_and_is_deterministic(m, n, k, cfg):
    w, _, kp = _cuda_layer(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16().cuda()
    y = mma.w12_mma(x, kp, config=cfg, out_dtype=torch.float32)
    check_close(y.cpu(), x.cpu(), w)
    y2 = mma.w12_mma(x, kp, config=cfg, out_dtype=torch.float32)
    assert torch.equal(y.view(torch.int32), y2.view(torch.int32))


@_gpu_gluon
@pytest.mark.parametrize("cfg", [None, mma.MmaConfig(64, 2, 4, 3, True)])
def test_w12_mma_qpass_and_default_config(cfg):
    _, t, kp = _cuda_layer(256, 640, seed=5)
    x = torch.randn(24, 640).bfloat16().cuda()
    yq = mma.w12_mma(x, kp, qpass=True, config=cfg, out_dtype=torch.float32).cpu()
    rq = w12_linear_ref(x.cpu().float(), t, qpass=True)
    fin = torch.isfinite(rq)
    assert float(((yq - rq).abs()[fin] / (rq.abs()[fin] + 1e-2)).max()) < 1e-4
    yb = mma.w12_mma(x, kp)
    assert yb.dtype == torch.bfloat16 and yb.shape == (24, 256)


def _preferred(m: int) -> bool:
    """Whether the routing table sends ``m`` rows here when the kernel runs (and warpk does not)."""
    rules = tuning.table("w12", "sm90")["route"]
    return routing.pick(rules, m, 4096, lambda kern: kern == "mma", lambda kern: None) == "mma"


def test_routing_and_tuned_table():
    assert not _preferred(1) and _preferred(2) and _preferred(64)
    assert mma.default_config(32, 28672, 4096) == mma.tuned_config(32, 28672, 4096) is not None
    assert mma.default_config(3, 6144, 4096) == mma.tuned_config(8, 6144, 4096)   # 2-8 rows share an entry
    # transformers' unfused k/v: its own entry, on Hopper and (without the TMA entries) elsewhere
    assert mma.default_config(32, 1024, 4096, tma=False) == mma.tuned_config(32, 1024, 4096) is not None
    assert mma.default_config(20, 14336, 4096) == mma.tuned_config(32, 14336, 4096) is not None
    assert not mma.default_config(20, 14336, 4096, tma=False).tma
    cfg = mma.default_config(40, 1000, 3000)                                      # untuned: heuristic
    assert cfg.block_n == 64 and 1 <= cfg.split_k <= 47
    kp = KernelPack.from_w12(encode(make_weight(16, 64)), device="cpu")
    assert not mma.supported(torch.zeros(8, 64, dtype=torch.bfloat16), kp)      # CPU: the other kernels


@pytest.mark.parametrize("cfg", [mma.MmaConfig(64, 1, 4, 5), mma.MmaConfig(64, 1, 4, 7, True),
                                 mma.MmaConfig(64, 1, 4, 1, False, True), mma.MmaConfig(64, 1, 4, 2, True, True)])
def test_bad_configs_are_rejected(cfg):
    kp = KernelPack.from_w12(encode(make_weight(16, 64)), device="cpu")
    with pytest.raises((ValueError, RuntimeError)):
        mma.w12_mma(torch.zeros(8, 64, dtype=torch.bfloat16), kp, config=cfg)


@_gpu_gluon
def test_w12_linear_routes_verify_rows_to_mma():
    from specpilot.kernels.w12.routing import w12_linear

    _, _, kp = _cuda_layer(256, 512, seed=9)
    x = torch.randn(24, 512).bfloat16().cuda()      # (2-8 rows and table layers go to kernels/w12/warpk.py)
    assert torch.equal(w12_linear(x, kp).view(torch.int16), mma.w12_mma(x, kp).view(torch.int16))


@_gpu_gluon
def test_w12_mma_strided_rows():
    """x rows 264 elements apart (not a multiple of 16): the launcher realigns them for cp.async."""
    w, _, kp = _cuda_layer(128, 256, seed=11)
    big = torch.randn(12, 264).bfloat16().cuda()
    x = big[:, :256]
    y = mma.w12_mma(x, kp, out_dtype=torch.float32)
    check_close(y.cpu(), x.cpu(), w)
