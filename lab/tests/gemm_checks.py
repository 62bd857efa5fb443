"""Lab tests' helper: a GEMM variant's configs against the fp32 product on a GPU."""

from __future__ import annotations

import torch


def check_configs(run, m: int, n: int, k: int, configs, skip=()) -> int:
    """``run(x, w, cfg)`` for each of ``configs`` on random bf16 x [m, k] and w [n, k]: bitwise the
    same twice, and within a bf16 rounding (plus 2e-2) of the fp32 product. A config raising one of
    ``skip`` (a plan's refusal of the shape) is passed over; returns how many ran."""
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    ref = x.float() @ w.float().T
    ran = 0
    for cfg in configs:
        try:
            y = run(x, w, cfg)
        except skip:
            continue
        ran += 1
        assert torch.equal(y, run(x, w, cfg))
        tol = ref.abs() * 2 ** -7 + 2e-2
        assert ((y.float() - ref).abs() <= tol).all(), (m, n, k, cfg, float((y.float() - ref).abs().max()))
    return ran
