"""Row-invariant GEMM ``y = x @ W.T``: each row of ``y`` has the bits it has when ``x`` is that row
alone, whatever the step's row count (deterministic steps, ``EngineSpec.deterministic``).

cuBLAS, and the skinny GEMM's routed configs, pick tiles, split-K and reduction order by the
number of rows, so a token's projections round one way in a one-row AR step and another way in a
33-row verify step: greedy tokens that sit near a tie then differ between AR and speculative
decoding (random weights hit such ties often). Here every launch takes the skinny kernel
(:mod:`.skinny`) with everything that shapes a row's arithmetic fixed independently of the rows:
row tiles of :data:`ROW_TILE` rows (each its own programs; the MMA's row side is always 16), the
``BLOCK_N`` x ``BLOCK_K`` tile, and the K split chosen from the weight's shape and the device
alone, its partial sums added in a fixed order. Rows past the step's rows read as zero and never
mix with a row's sums. The plain reference is :func:`.naive.linear` (same products, another
summation order).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from specpilot.kernels.triton_env import triton
from specpilot.kernels.verify import skinny

ROW_TILE = 16
STAGES = 4
# programs of one row tile: two per SM, so that a one-row step (AR decode) streams the weights
# from every SM; the split depends on the weight's shape and the device only
PROGRAMS_PER_SM = 2


@lru_cache(maxsize=None)
def _sms(device: str) -> int:
    if torch.device(device).type != "cuda":
        return 4     # Triton's interpreter (the CPU tests): any fixed count
    return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count


def split_for(n: int, k: int, device) -> int:
    """Programs along K per output block for an ``[n, k]`` weight on ``device``."""
    blocks = triton.cdiv(n, skinny.BLOCK_N)
    tiles = triton.cdiv(k, skinny.BLOCK_K)
    return max(1, min(tiles, triton.cdiv(PROGRAMS_PER_SM * _sms(str(device)), blocks)))


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for x [M, K] (any M >= 1, contiguous in K) and w [N, K] contiguous, of one dtype
    (bf16, fp16, or fp32 multiplied in IEEE fp32), row-invariant as the module says."""
    skinny.check_operands(x, w)
    if x.shape[0] < 1:
        raise ValueError("x has no rows")
    return skinny.launch(x, w, ROW_TILE, split_for(w.shape[0], w.shape[1], x.device), STAGES)
