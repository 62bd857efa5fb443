"""Run the one-row W12 GEMV on two layers a few times, for Nsight Compute.

    ncu --clock-control none -k regex:_w12_gemv_kernel --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
        --section LaunchStats --section Occupancy python3 lab/w12/ncu_gemv.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from lab.common import bootstrap  # noqa: E402

bootstrap()

import torch  # noqa: E402

from specpilot.kernels.w12 import encode  # noqa: E402
from specpilot.kernels.w12.pack import KernelPack  # noqa: E402
from specpilot.kernels.w12.gemv import w12_gemv  # noqa: E402

for k, n in ((4096, 28672), (4096, 4096)):
    w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
    kp = KernelPack.from_w12(encode(w), device="cuda")
    x = torch.randn(1, k, device="cuda").bfloat16()
    for _ in range(3):
        w12_gemv(x, kp)
    torch.cuda.synchronize()
