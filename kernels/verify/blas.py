"""The dense projections of a multi-row step, by the measured table
(``kernels/verify/tuned/<arch>.json``): one request's steps of the rows a ``warpk`` entry covers take
the warp-K tensor-core GEMM (:mod:`.warpk`); else the stream-K TMA-ring GEMM (:mod:`.ring`) or the
skinny GEMM (:mod:`.skinny`) where a ``ring`` or ``skinny`` entry names the layer (``n``, ``k``) and
the step's rows; else ``F.linear`` (cuBLAS) on the BLAS library the table's ``gemm`` entries pick
for the step's rows.

torch reads its preferred BLAS library (``torch.backends.cuda.preferred_blas_library``) when it
launches a GEMM, and a CUDA graph keeps the kernel chosen at capture, so a step captured at 32
rows holds cuBLASLt's kernels where the table says they win there and cuBLAS's elsewhere. The
preference is set around the one call and restored after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from .. import tuning
from . import ring, warpk
from .ring import RingConfig
from .skinny import SkinnyConfig, skinny_linear


@dataclass(frozen=True)
class GemmConfig:
    """``library``: ``default`` (torch's own choice: cuBLAS on CUDA) or ``cublaslt``."""

    library: str = "default"


LIBRARIES = ("default", "cublaslt")


@lru_cache(maxsize=None)
def _config(arch: str | None, rows: int) -> GemmConfig:
    found = tuning.lookup("verify", "gemm", arch, rows=rows)
    return GemmConfig(**found[0]["config"]) if found else GemmConfig()


def gemm_config(device, rows: int) -> GemmConfig:
    """The table's library for a step of ``rows`` rows on ``device``."""
    return _config(tuning.device_arch(device), rows)


@lru_cache(maxsize=None)
def _skinny(arch: str | None, n: int, k: int, rows: int) -> SkinnyConfig | None:
    found = tuning.lookup("verify", "skinny", arch, rows=rows, n=n, k=k)
    return SkinnyConfig(**found[0]["config"]) if found else None


def skinny_config(device, n: int, k: int, rows: int) -> SkinnyConfig | None:
    """The table's skinny-GEMM config for a layer [n, k] at ``rows`` rows on ``device``, None
    where cuBLAS runs it."""
    return _skinny(tuning.device_arch(device), n, k, rows)


@lru_cache(maxsize=None)
def _ring(arch: str | None, n: int, k: int, rows: int) -> RingConfig | None:
    found = tuning.lookup("verify", "ring", arch, rows=rows, n=n, k=k)
    return RingConfig(**found[0]["config"]) if found else None


def ring_config(device, n: int, k: int, rows: int) -> RingConfig | None:
    """The table's TMA-ring GEMM config for a layer [n, k] at ``rows`` rows on ``device``, None
    where another kernel runs it."""
    return _ring(tuning.device_arch(device), n, k, rows)


@lru_cache(maxsize=None)
def _warpk(arch: str | None, rows: int) -> bool:
    return bool(tuning.lookup("verify", "warpk", arch, rows=rows))


def takes_warpk(device, rows: int) -> bool:
    """Whether the table routes one request's steps of ``rows`` rows on ``device`` through the warp-K
    GEMM (a ``warpk`` entry covers them; it has no knobs)."""
    return _warpk(tuning.device_arch(device), rows)


def route(h: torch.Tensor, w: torch.Tensor, batched: bool = False) -> str:
    """The kernel :func:`linear` runs for ``h @ w.T``: ``warpk``, ``ring``, ``skinny`` or ``blas``
    (``F.linear``: cuBLAS, or the CPU's)."""
    if h.device.type != "cuda" or w.dtype not in (torch.bfloat16, torch.float16):
        return "blas"
    if not batched and takes_warpk(h.device, h.shape[0]) and warpk.supported(h, w):
        return "warpk"
    if ring_config(h.device, w.shape[0], w.shape[1], h.shape[0]) is not None and ring.supported(h, w):
        return "ring"
    if (skinny_config(h.device, w.shape[0], w.shape[1], h.shape[0]) is not None and h.dtype == w.dtype
            and h.stride(-1) == 1 and w.stride(-1) == 1):
        return "skinny"
    return "blas"


def linear(h: torch.Tensor, w: torch.Tensor, batched: bool = False) -> torch.Tensor:
    """``F.linear(h, w)`` (no bias); half-precision weights on CUDA go through the warp-K GEMM (one
    request's steps, ``batched`` False), the TMA-ring GEMM, the skinny GEMM or the BLAS library the
    table picks for the layer and ``h``'s rows (:func:`route`). Batched steps (the rows of several
    requests) never take the warp-K GEMM: with it a step of 4 requests x 1 row measured 4.74 -> 4.70
    ms (Llama-3.1-8B shapes, H200), within the spread between runs, and no other batched shape was
    measured with it. The ring entries were measured on batched steps too (docs/engine.md)."""
    if h.device.type != "cuda" or w.dtype not in (torch.bfloat16, torch.float16):
        return F.linear(h, w)
    kernel = route(h, w, batched)
    m, (n, k) = h.shape[0], w.shape
    if kernel == "warpk":
        return warpk.warpk_linear(h, w)
    if kernel == "ring":
        return ring.ring_linear(h, w, ring_config(h.device, n, k, m))
    if kernel == "skinny":
        return skinny_linear(h, w, skinny_config(h.device, n, k, m))
    lib = gemm_config(h.device, m).library
    if lib == "default":
        return F.linear(h, w)
    prev = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(lib)
    try:
        return F.linear(h, w)
    finally:
        torch.backends.cuda.preferred_blas_library(prev)
