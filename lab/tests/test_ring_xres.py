"""The TMA-ring GEMM with x resident per K slice (``lab/verify/ring_xres.py``): its slicing plan on
the CPU, an sm_90 compile (weights copied before ``griddepcontrol.wait``, x after it, ``wgmma`` on
shared memory, no spills), and the kernel against the fp32 reference on a Hopper GPU."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton")

from lab.verify import ring_xres as X  # noqa: E402

needs_gluon = pytest.mark.skipif(not X.AVAILABLE, reason="Triton without Gluon's Hopper module")
hopper = pytest.mark.skipif(not torch.cuda.is_available() or not X.AVAILABLE
                            or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU")


@pytest.mark.parametrize("m,n,k", [(16, 6144, 4096), (32, 4096, 4096), (64, 28672, 4096), (32, 4096, 14336),
                                   (64, 4096, 14336)])
def test_plan_fits_shared_memory_and_covers_every_block_once(m, n, k):
    cfg = X.XresConfig(0, 64, 3, 4) if (m, k) != (64, 14336) else X.XresConfig(0, 64, 3, 2)
    s, xt, per, progs = X.plan(m, n, k, cfg, 132)
    kt = k // 64
    assert s * xt == kt and xt % cfg.kboxes == 0
    bm = X.R.block_m(m)
    assert cfg.stages * cfg.kboxes * cfg.block_n * 128 + xt * bm * 128 + 1024 <= X.SMEM_BYTES
    nb = -(-n // cfg.block_n)
    groups = -(-nb // per)
    assert progs == s * groups and (groups - 1) * per < nb <= groups * per
    assert progs <= 2 * 132


def test_plan_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="no K slicing"):
        X.plan(64, 4096, 14336, X.XresConfig(1, 64, 4, 4), 132)   # the whole K of 64 rows: 1.8 MB of x


_SETUP = r"""
from lab.verify import ring_xres as X
k = X._xres_kernel
sl = X.R.smem_layout()
acc, ep = X.R.layouts(64, {bm})
ptrs = {{"y_ptr": "*bf16", "ws_ptr": "*fp32", "lock_ptr": "*i32",
        "w_desc": f"tensordesc<bf16[64, 64],{{sl!r}}>", "x_desc": f"tensordesc<bf16[{bm}, 64],{{sl!r}}>"}}
const = dict(BLOCK_N=64, BLOCK_M={bm}, STAGES=3, KB=4, XT={xt}, ACC=acc, L_EP=ep, PDL=True, TRIGGER=0)
div = ["y_ptr", "ws_ptr", "lock_ptr", "stride_ym"]
warps = 4
"""


@needs_gluon
@pytest.mark.parametrize("bm,xt", [(32, 16), (64, 8)])
def test_compiles_with_weights_before_the_wait_and_x_once_after_it(bm, xt):
    from gluon_ptx import ptxas_report

    rep = ptxas_report(_SETUP.format(bm=bm, xt=xt))
    assert rep["rc"] == 0, rep["log"][-2000:]
    assert not re.search(r"[1-9]\d* bytes spill (stores|loads)", rep["log"]), rep["log"]
    ptx = rep["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    assert 0 < ptx.find("cp.async.bulk.tensor") < wait < ptx.find("cp.async.bulk.tensor", wait)
    assert "wgmma.mma_async" in ptx and "griddepcontrol.launch_dependents" not in ptx


@hopper
@pytest.mark.parametrize("m", [1, 16, 33, 64])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (200, 512)])
def test_gpu_matches_the_reference_and_itself(m, n, k):
    from gemm_checks import check_configs

    # a config whose slicing of this K does not fit is refused by the plan (ValueError): at least one runs
    assert check_configs(X.xres_linear, m, n, k, (X.XresConfig(0, 64, 3, 4), X.XresConfig(0, 64, 2, 2)),
                         skip=ValueError), (m, n, k)
