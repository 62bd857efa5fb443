"""The persistent MLP ring kernel (``lab/verify/ring_mlp.py``): an sm_90 compile on any machine
(the down weights' copies before the wait for the second grid barrier, no spills), and on a Hopper
GPU the same bits as the three routed kernels, launch after launch (the barriers' counters return
to zero)."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton")

from lab.verify import ring_mlp as M  # noqa: E402

needs_gluon = pytest.mark.skipif(not M.AVAILABLE, reason="Triton without Gluon's Hopper module")
hopper = pytest.mark.skipif(not torch.cuda.is_available() or not M.AVAILABLE
                            or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU")

_SETUP = r"""
from lab.verify import ring_mlp as D
k = D._mlp_kernel
sl = D.R.smem_layout()
acc, ep = D.R.layouts(64, 16)
desc = lambda rows: f"tensordesc<bf16[{rows}, 64],{sl!r}>"
ptrs = {"gu_ptr": "*bf16", "act_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32", "lock_ptr": "*i32",
        "bar_ptr": "*i32", "w1_desc": desc(64), "x1_desc": desc(16), "w2_desc": desc(64), "x2_desc": desc(16)}
const = dict(BLOCK_N=64, BLOCK_M=16, STAGES=4, ACC=acc, L_EP=ep, L_SILU=D.silu_layout(),
             L_FENCE=D.fence_layout(), PDL=True, KB=4)
div = ["gu_ptr", "act_ptr", "y_ptr", "ws_ptr", "lock_ptr", "bar_ptr", "stride_g", "stride_a", "stride_y"]
warps = 4
"""


@needs_gluon
def test_compiles_without_spills():
    from gluon_ptx import ptxas_report

    rep = ptxas_report(_SETUP)
    assert rep["rc"] == 0, rep["log"][-2000:]
    assert not re.search(r"[1-9]\d* bytes spill (stores|loads)", rep["log"]), rep["log"]
    ptx = rep["ptx"]
    assert ptx.count("fence.proxy.async.global") >= 2
    assert "griddepcontrol.launch_dependents" in ptx
    assert ptx.find("griddepcontrol.launch_dependents") < ptx.find("griddepcontrol.wait")


@hopper
@pytest.mark.parametrize("m", [1, 9, 16, 33, 64])
@pytest.mark.parametrize("hidden,inter", [(4096, 14336), (512, 200)])
def test_gpu_same_bits_as_the_three_kernels(m, hidden, inter):
    torch.manual_seed(m)
    h = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    ref = M.reference(h, w13, w2)
    for _ in range(3):
        assert torch.equal(M.mlp_ring(h, w13, w2), ref)
    torch.cuda.synchronize()
    assert int(M.workspace.counters(h.device, "mlp_ring.grid", 3)[:3].abs().sum()) == 0
