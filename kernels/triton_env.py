"""Triton for the kernel modules, imported one way everywhere.

Without CUDA the kernels can only run under Triton's interpreter, and that has to be chosen
before ``triton`` is imported, so this module sets ``TRITON_INTERPRET`` first. Triton is optional
at import time: CPU-only installs still import the kernel modules (``triton`` is then None).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # no GPU: the kernels can only run under Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None


def interpreting() -> bool:
    """Whether kernels run under Triton's interpreter (the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pdl_args(enabled: bool, x) -> dict:
    """Kernel arguments for programmatic dependent launch (PDL): ``PDL`` (the kernel's constexpr)
    and Triton's ``launch_pdl``, on only when ``enabled``, ``x`` is a CUDA tensor and kernels are
    compiled (the interpreter has no ``griddepcontrol``). A kernel launched so may start while the
    previous kernel finishes: it must read nothing but constant data (weights) before ``gdc_wait``."""
    on = bool(enabled) and x.is_cuda and not interpreting()
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
