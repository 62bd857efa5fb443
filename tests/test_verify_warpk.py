"""The warp-K bf16 GEMM of one request's short steps (kernels/verify/warpk.py) against its plain
reference, its routing by the table, and bad input.

Gluon kernels do not run under Triton's interpreter: on the CPU the kernel is compiled for sm_90
and its main loop checked (tensor-core MMAs fed from 16-byte global loads, no shared memory);
``-m gpu`` runs it at the engine's layer shapes, eager and captured."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from specpilot.kernels.verify import blas, warpk  # noqa: E402
from specpilot.kernels.verify import naive as R  # noqa: E402
from kernel_checks import gemm_inputs, within_bf16_rounding  # noqa: E402
from specpilot.engine.graphs import capture  # noqa: E402

needs_gluon = pytest.mark.skipif(warpk.gluon is None, reason="no Gluon in this Triton")


def _setup(bm: int, depth: int) -> str:
    return f"""
from specpilot.kernels.verify import warpk as W
k = W._warpk_kernel
l_w, l_x, mma, a_op, b_op, l_ep = W.layouts(W.ROWS, {bm}, W.WARPS)
const = dict(ROWS=W.ROWS, BM={bm}, WARPS=W.WARPS, DEPTH={depth}, L_W=l_w, L_X=l_x, MMA=mma, A_OP=a_op,
             B_OP=b_op, L_EP=l_ep, PDL=True)
ptrs = {{"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16"}}
div = ["x_ptr", "w_ptr", "y_ptr", "stride_x", "stride_w", "stride_y"]
warps = W.WARPS
"""


@needs_gluon
@pytest.mark.parametrize("bm", [8, 16, 32])
def test_main_loop_feeds_the_mmas_from_global_loads_without_shared_memory(bm):
    """Per register set and warp: 4 MMAs along k per 8 x rows, the weight slice as four 16-byte
    loads per lane and x as two per 8 rows; no shared memory and no CTA barrier in the loop (the
    layout conversions into the MMA operands are asserted trivial at compile time)."""
    from gluon_ptx import main_loop_ptx

    ptx = main_loop_ptx(_setup(bm, warpk.DEPTH))
    assert ptx.count("mma.sync.aligned.m16n8k16") == warpk.DEPTH * 4 * (bm // 8)
    assert ptx.count("ld.global.v4") == warpk.DEPTH * (4 + 2 * (bm // 8))
    assert "ld.shared" not in ptx and "st.shared" not in ptx and "bar.sync" not in ptx


@needs_gluon
def test_every_routed_config_compiles_without_spills_and_reads_weights_before_the_wait():
    """The kernel at each x block the table's entries serve (2-8 rows: 8): no register spills (a
    depth that spills streams its register sets through local memory: two or three sets at 8-16 x
    rows spill, and those made whole steps 2-5 ms slower on the H200), the first weight slices
    loaded before ``griddepcontrol.wait``, x after it, and no early trigger of the dependents."""
    import json
    import re

    from gluon_ptx import ptxas_report

    from specpilot.kernels import tuning

    entries = [e for e in json.loads(tuning._path("verify", "sm90").read_text())["entries"] if e["kernel"] == "warpk"]
    assert entries
    for e in entries:
        for bm in sorted({warpk.block_m(m) for m in range(e["rows"][0], e["rows"][1] + 1)}):
            r = ptxas_report(_setup(bm, warpk.DEPTH))
            assert r["rc"] == 0, r["log"][-2000:]
            assert not re.search(r"[1-9]\d* bytes spill (stores|loads)", r["log"]), r["log"]
            ptx = r["ptx"]
            wait = ptx.find("griddepcontrol.wait")
            assert 0 < ptx.find("ld.global.v4") < wait < ptx.find("ld.global.v4", wait)
            assert "griddepcontrol.launch_dependents" not in ptx


def test_input_checks():
    x, w = gemm_inputs(4, 128, 32)
    assert not warpk.supported(x, w)   # CPU tensors
    with pytest.raises(ValueError, match="warpk_linear takes 1-32 contiguous bf16 rows"):
        warpk.warpk_linear(x, w)


def test_block_m_pads_rows_to_mma_column_blocks():
    assert [warpk.block_m(m) for m in (1, 8, 9, 16, 17, 32)] == [8, 8, 16, 16, 32, 32]


def test_table_routes_one_requests_short_steps_only():
    """The sm90 table's ``warpk`` entry covers one request's steps of 2-8 rows; other row counts and
    the CPU take the other kernels, and ``batched`` never asks for it."""
    assert [blas._warpk("sm90", m) for m in (1, 2, 8, 9, 16, 33)] == [False, True, True, False, False, False]
    x, w = gemm_inputs(4, 128, 32)
    assert torch.equal(blas.linear(x, w), torch.nn.functional.linear(x, w))
    assert torch.equal(blas.linear(x, w, batched=True), torch.nn.functional.linear(x, w))


gpu = pytest.mark.gpu


def _cuda():
    if not torch.cuda.is_available() or warpk.gluon is None:
        pytest.skip("needs CUDA and Gluon")


@gpu
@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 12352),
                                 (12288, 4096), (128, 130)])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 16, 17, 32])
def test_warpk_matches_the_reference_on_cuda(k, n, m):
    _cuda()
    x, w = gemm_inputs(m, k, n, seed=m, device="cuda")
    want = R.linear(x.float(), w.float())
    got = warpk.warpk_linear(x, w)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert within_bf16_rounding(got, want), float((got.float() - want).abs().max())
    assert torch.equal(got, warpk.warpk_linear(x, w))


@gpu
def test_warpk_in_a_cuda_graph_gives_the_eager_bits_and_blas_routes_it(monkeypatch):
    _cuda()
    x, w = gemm_inputs(4, 4096, 4096, seed=9, device="cuda")
    eager = blas.linear(x, w)
    assert blas.takes_warpk(x.device, 4) and torch.equal(eager, warpk.warpk_linear(x, w))
    g, y = capture(lambda: blas.linear(x, w), 1)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)
    def refused(*a, **k):
        raise AssertionError("a batched step took the warp-K GEMM")

    monkeypatch.setattr(warpk, "warpk_linear", refused)
    batched = blas.linear(x, w, batched=True)   # the skinny GEMM or cuBLAS
    assert within_bf16_rounding(batched, R.linear(x.float(), w.float()))
