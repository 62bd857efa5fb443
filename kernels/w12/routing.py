"""Which W12 kernel runs a product, with which config: :func:`route`, and :func:`w12_linear`.

The kernels, registered in :data:`KERNELS` (name -> module):

* ``restore``    :mod:`.restore`, the weight restored to bf16, then cuBLAS: prompt-sized products
* ``mma``        :mod:`.mma` (its TMA rings: :mod:`.mma_tma`), tensor cores, rows split over warps: verify steps
* ``warpk``      :mod:`.warpk`, tensor cores, K split over warps: 2-8 rows, and where its table says
* ``gemv-gluon`` :mod:`.gemv_gluon`, one row, K split over warps, CUDA-core FMAs
* ``gemv``       :mod:`.gemv`, the Triton streaming GEMV for up to 16 rows (no Gluon)
* ``gemm``       :mod:`.gemm`, the general Triton kernel (any shape; the CPU under the interpreter)

Each module has ``supported(x, packed)`` (dtype, device, capability, rows), a config dataclass,
``default_config`` (the measured table's entry for the layer and rows where the device runs it,
else a heuristic) and a launcher. What runs where is data: the device's table
(:mod:`specpilot.kernels.tuning`, ``kernels/w12/tuned/<arch>.json``) has a ``route`` list, tried in
order; a rule names a kernel and when it applies:

* ``rows`` ``[lo, hi]``: the x rows it takes (``hi`` null: no bound), ``n_below``: layers of fewer
  outputs only;
* ``when_tuned``: only where the kernel's table has an entry for the layer and rows that the device
  runs, with these config fields (``{}``: any entry).

The first rule that applies and whose kernel supports the call is taken; the last rule (``gemm``)
applies to everything. The kernel then runs its default config.
"""

from __future__ import annotations

import torch

from .. import tuning
from ..triton_env import triton
from . import gemm, gemv, gemv_gluon, mma, mma_tma, restore, warpk
from .pack import KernelPack

KERNELS = {"restore": restore, "mma": mma, "warpk": warpk, "gemv-gluon": gemv_gluon, "gemv": gemv, "gemm": gemm}
LAUNCHERS = {"restore": restore.w12_restore_linear, "mma": mma.w12_mma, "warpk": warpk.w12_warpk,
             "gemv-gluon": gemv_gluon.w12_gemv_gluon, "gemv": gemv.w12_gemv, "gemm": gemm.w12_gemm}
CONFIGS = {restore.RestoreConfig: "restore", mma.MmaConfig: "mma", warpk.WarpKConfig: "warpk",
           gemv_gluon.GluonGemvConfig: "gemv-gluon", gemv.GemvConfig: "gemv", gemm.Config: "gemm"}


def tuned_config(kernel: str, m: int, n: int, k: int, device=None, tma: bool = True, wgmma: bool = True):
    """The table's config of ``kernel`` for ``m`` rows of the ``n x k`` layer that a device runs
    (``tma``, ``wgmma``: see :func:`.mma.runs`), or None."""
    if kernel == "mma":
        return mma.tuned_config(m, n, k, tma, wgmma, device=device)
    if kernel == "gemv-gluon":
        return gemv_gluon.tuned_config(n, k, device=device) if m == 1 else None
    return KERNELS[kernel].tuned_config(m, n, k, device=device)


def pick(rules: list[dict], m: int, n: int, supports, tuned) -> str:
    """The kernel of the first rule in ``rules`` (a table's ``route``) that applies to ``m`` rows of a
    layer of ``n`` outputs and whose kernel ``supports(kernel)`` the call; ``tuned(kernel)``: the
    table's config of that kernel for the call that the device runs, or None."""
    for rule in rules:
        kernel, rows = rule["kernel"], rule.get("rows")
        if rows is not None and not (rows[0] <= m and (rows[1] is None or m <= rows[1])):
            continue
        if "n_below" in rule and not n < rule["n_below"]:
            continue
        if "when_tuned" in rule:
            cfg = tuned(kernel)
            if cfg is None or any(getattr(cfg, f) != v for f, v in rule["when_tuned"].items()):
                continue
        if supports(kernel):
            return kernel
    return "gemm"


def route(x: torch.Tensor, packed: KernelPack, rules: list[dict] | None = None) -> str:
    """The kernel :func:`w12_linear` runs for ``x`` without a config (see the module); ``rules``:
    other route rules than the device table's (the lab compares kernels with a rule left out)."""
    (m, k), n = x.shape, packed.shape[0]
    dev = x.device

    def tuned(kernel):
        return tuned_config(kernel, m, n, k, dev, mma_tma.supported(dev), mma_tma.wgmma_supported(dev))

    if rules is None:
        rules = tuning.table("w12", tuning.device_arch(dev) if x.is_cuda else None)["route"]
    return pick(rules, m, n, lambda kernel: KERNELS[kernel].supported(x, packed), tuned)


def w12_linear(x: torch.Tensor, packed: KernelPack, qpass: bool = False, config=None,
               out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T`` for x ``[M, K]`` (bf16), W in W12 form; fp32 accumulation, deterministic. Without
    ``config`` the routed kernel (:func:`route`) with its default config, else the kernel of the
    config's type (e.g. a :class:`.gemm.Config` runs the general kernel)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    if x.dim() != 2 or x.shape[1] != packed.shape[1]:
        raise ValueError(f"x shape {tuple(x.shape)} does not match weight {packed.shape}")
    if x.stride(1) != 1:
        x = x.contiguous()
    kernel = route(x, packed) if config is None else CONFIGS[type(config)]
    return LAUNCHERS[kernel](x, packed, qpass=qpass, config=config, out=out, out_dtype=out_dtype)
