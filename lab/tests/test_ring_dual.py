"""The TMA-ring GEMM with two consumer warpgroups on one x box (``lab/verify/ring_dual.py``): its
config checks on the CPU, an sm_90 compile (two ``wgmma`` chains on 64-row accumulators, weights
copied before ``griddepcontrol.wait``, no spills), and the kernel against the fp32 reference on a
Hopper GPU."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton")

from lab.verify import ring_dual as D  # noqa: E402

needs_gluon = pytest.mark.skipif(not D.AVAILABLE, reason="Triton without Gluon's Hopper module")
hopper = pytest.mark.skipif(not torch.cuda.is_available() or not D.AVAILABLE
                            or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU")


def test_config_checks():
    D.check(D.DualConfig(), 64)
    with pytest.raises(ValueError, match="exceed"):
        D.check(D.DualConfig(stages=6, kboxes=2), 64)   # 6 x 2 x (128 + 64) rows x 128 B = 288 KB
    with pytest.raises(ValueError, match="2-8 stages"):
        D.check(D.DualConfig(kboxes=3), 16)
    assert all(c.smem_bytes(16) <= D.SMEM_BYTES for c in D.sweep_configs())


_SETUP = r"""
from lab.verify import ring_dual as D
k = D._dual_kernel
sl = D.R.smem_layout()
acc, ep = D.R.layouts(64, {bm})
ptrs = {{"y_ptr": "*bf16", "ws_ptr": "*fp32", "lock_ptr": "*i32",
        "w_desc": f"tensordesc<bf16[128, 64],{{sl!r}}>", "x_desc": f"tensordesc<bf16[{bm}, 64],{{sl!r}}>"}}
const = dict(BLOCK_M={bm}, STAGES=3, KB=2, ACC=acc, L_EP=ep, PDL=True, INFLIGHT=1, TRIGGER=0, REGS=152)
div = ["y_ptr", "ws_ptr", "lock_ptr", "stride_ym"]
warps = 4
opts = {{"maxnreg": D.launch_regs(8, 152, 4, 24)}}
"""


@needs_gluon
@pytest.mark.parametrize("bm", [16, 64])
def test_compiles_two_wgmma_chains_with_weights_before_the_wait(bm):
    from gluon_ptx import ptxas_report

    rep = ptxas_report(_SETUP.format(bm=bm))
    assert rep["rc"] == 0, rep["log"][-2000:]
    assert not re.search(r"[1-9]\d* bytes spill (stores|loads)", rep["log"]), rep["log"]
    ptx = rep["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    assert 0 < ptx.find("cp.async.bulk.tensor") < wait < ptx.find("cp.async.bulk.tensor", wait)
    # two consumer partitions, each with its own wgmma chain on a 64-row tile (m64nBMk16)
    assert len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{bm}k16", ptx)) >= 4
    assert "griddepcontrol.launch_dependents" not in ptx


@hopper
@pytest.mark.parametrize("m", [1, 16, 33, 64])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (200, 512)])
def test_gpu_matches_the_reference_and_itself(m, n, k):
    from gemm_checks import check_configs

    assert check_configs(D.dual_linear, m, n, k, (D.DualConfig(), D.DualConfig(2, 4, inflight=0))) == 2
