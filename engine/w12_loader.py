"""The engine's W12 loader (``--w12``, ``engine:...,w12=1``): converts the target's projections to
lossless 12-bit weights at load. The format and kernels are ``specpilot.kernels.w12``; the SGLang
quantization method is the ``w12`` bundle (``specpilot.bundles.w12_quantization``).

At load, every ``nn.Linear`` inside the target's layers (fused q/k/v, o, fused gate/up, down, and
the Gated DeltaNet projections of hybrid models) is encoded to W12 and restored **bit for bit**
against the original before anything runs; a difference stops the load (it would be a bug). The
LM head and the embeddings stay dense (see docs/engine.md for why the certified head is not used).
Then one of two paths:

* ``fused`` (CUDA, bf16, Triton importable): the projection becomes a :class:`W12Projection`
  that keeps only the W12 records in the kernel layout (``KernelPack.from_w12``) and calls the
  fused Triton GEMM ``w12_linear`` (rows in chunks of at most ``KERNEL_MAX_ROWS``), bias added
  after. The dense weight is dropped. Outputs differ from the dense engine's by fp32
  accumulation order only (the weights are identical).
* ``decoded`` (CPU, or fp32/fp16 on CUDA): the weight is decoded once from the W12 records and
  written back into the ``nn.Linear`` in the engine's dtype (exact), so outputs equal the plain
  engine's token for token. This path says nothing about W12's speed: it runs the same dense
  ``F.linear`` as the plain engine.

W12 is lossless for bf16 weights only: with ``dtype=float32`` / ``float16`` every projection
weight must be exactly representable in bf16 (else :class:`InputError`, exit 2); ``w12=1``
without a ``dtype`` means bfloat16.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from specpilot.errors import InputError

# rows per kernel call at the most (the fused kernel's range in kernels/w12/module.py)
try:
    from specpilot.kernels.w12.module import KERNEL_MAX_ROWS
except Exception:  # pragma: no cover
    KERNEL_MAX_ROWS = 256

# row counts run once after conversion on CUDA (one per kernel row bucket, and the largest chunk):
# compiles the kernel variants before any CUDA graph is captured, and grows the kernel's shared
# split-K workspace to its final size up front (kernels/w12/gemm.py keeps outgrown workspaces
# alive, so a graph captured earlier stays valid either way)
WARMUP_ROWS = (1, 2, 4, 8, 16, 32, 64, KERNEL_MAX_ROWS)


@dataclass
class W12Summary:
    """What ``convert_engine_model`` did (``Engine.info["w12"]``, ``specpilot run`` JSON ``w12``)."""

    path: str  # "fused" or "decoded"
    tensors: list[str] = field(default_factory=list)
    weights: int = 0
    stored_bytes: int = 0
    escapes: int = 0
    seconds: float = 0.0
    warmup_seconds: float = 0.0

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.stored_bytes / self.weights if self.weights else 0.0

    def to_json(self) -> dict:
        return {"path": self.path, "tensors": len(self.tensors), "weights": self.weights,
                "bits_per_weight": self.bits_per_weight,
                "escape_rate": self.escapes / self.weights if self.weights else 0.0,
                "w12_bytes": self.stored_bytes, "bf16_bytes": 2 * self.weights,
                "convert_seconds": self.seconds, "warmup_seconds": self.warmup_seconds}


def _w12_matmul(x2: torch.Tensor, kp) -> torch.Tensor:
    """``x2 @ W.T`` through the routed kernel, at most KERNEL_MAX_ROWS rows per launch of the W12
    kernels (a prompt's rows above the route table's bound: the weight restored, then cuBLAS)."""
    from specpilot.kernels.w12.routing import route, w12_linear

    m = x2.shape[0]
    if m <= KERNEL_MAX_ROWS or route(x2, kp) == "restore":
        return w12_linear(x2, kp)
    return torch.cat([w12_linear(x2[a:a + KERNEL_MAX_ROWS], kp) for a in range(0, m, KERNEL_MAX_ROWS)])


_MATMUL = None


def _matmul():
    """The fused matmul as a torch custom op (``specpilot::w12_matmul``), so ``compile=1`` compiles
    each layer around it in one graph (an opaque op, no graph break). Defined on first use:
    ``torch.library`` imports Triton, and on a CPU-only machine Triton must be imported after
    ``TRITON_INTERPRET`` is set (kernels/w12/gemm.py sets it)."""
    global _MATMUL
    if _MATMUL is None:
        from specpilot.kernels.w12.pack import KernelPack

        @torch.library.custom_op("specpilot::w12_matmul", mutates_args=())
        def w12_matmul(x2: torch.Tensor, rec64: torch.Tensor, rec32: torch.Tensor, low_exp: torch.Tensor,
                       esc_rowptr: torch.Tensor, esc_row: torch.Tensor, esc_col: torch.Tensor,
                       esc_delta: torch.Tensor, esc_delta_q: torch.Tensor, esc_w: torch.Tensor, n: int, k: int,
                       rows_stored: int, max_escapes: int) -> torch.Tensor:
            kp = KernelPack((n, k), rows_stored, rec64, rec32, low_exp, esc_rowptr, esc_row, esc_col,
                            esc_delta, esc_delta_q, max_escapes, esc_w)
            return _w12_matmul(x2, kp)

        @w12_matmul.register_fake
        def _(x2, rec64, rec32, low_exp, esc_rowptr, esc_row, esc_col, esc_delta, esc_delta_q, esc_w, n, k,
              rows_stored, max_escapes):
            return x2.new_empty(x2.shape[0], n)

        def call(x2, kp):
            return w12_matmul(x2, kp.rec64, kp.rec32, kp.low_exp, kp.esc_rowptr, kp.esc_row, kp.esc_col,
                              kp.esc_delta, kp.esc_delta_q, kp.esc_w, kp.shape[0], kp.shape[1], kp.rows_stored,
                              kp.max_escapes_per_row)

        _MATMUL = call
    return _MATMUL


class W12Projection(nn.Module):
    """A projection whose weight exists only as W12 records in the kernel's layout (CUDA, bf16)."""

    def __init__(self, kp, bias: torch.Tensor | None, bits_per_weight: float):
        super().__init__()
        self.kp = kp  # KernelPack (tensors on the device); not a buffer: the engine never moves models
        self.out_features, self.in_features = kp.shape
        self.bits_per_weight = bits_per_weight
        self.register_buffer("bias", bias.detach().clone() if bias is not None else None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != torch.bfloat16:
            raise RuntimeError(f"W12Projection takes bf16 activations, got {x2.dtype}")
        if x2.shape[0] == 0:
            y = x2.new_zeros(0, self.out_features)
        else:
            y = _matmul()(x2, self.kp)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits_per_weight={self.bits_per_weight:.3f}")


def projections(model, w12: bool = False) -> list[tuple[nn.Module, str, str]]:
    """(parent module, attribute, name) of every ``nn.Linear`` inside the model's layers (``w12``:
    and of every :class:`W12Projection`)."""
    kinds = (nn.Linear, W12Projection) if w12 else nn.Linear
    out = []
    for i, blk in enumerate(model.layers):
        for mod_name, mod in blk.named_modules():
            for child_name, child in mod.named_children():
                if isinstance(child, kinds):
                    full = ".".join(x for x in (f"layers.{i}", mod_name, child_name) if x)
                    out.append((mod, child_name, full))
    return out


def fused_available(device: torch.device, dtype) -> bool:
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    try:
        from specpilot.kernels.triton_env import triton

        return triton is not None
    except Exception:
        return False


@torch.no_grad()
def convert_engine_model(model, warmup: bool = True, fused: bool | None = None,
                         qviews: dict | None = None) -> W12Summary:
    """Convert the target's projections to W12 in place (see the module doc); returns a summary.

    ``fused``: None picks the path (fused kernel on CUDA with bf16); True forces the kernel (the
    tests run it on the CPU under Triton's interpreter). Raises InputError when a weight is not
    exactly representable in bf16 (W12 would not be lossless). ``qviews``: a dict that receives
    each projection's 8-bit view (``decode(..., qpass=True)``) by name, for TLV's Q pass.
    """
    from specpilot.kernels.w12 import decode, encode

    t0 = time.perf_counter()
    dev = model.device
    fused = fused_available(dev, model.dtype) if fused is None else fused
    if fused and model.dtype != torch.bfloat16:
        raise InputError("the fused W12 kernel takes bf16 activations: use dtype=bfloat16")
    summary = W12Summary("fused" if fused else "decoded")
    targets = projections(model)
    if not targets:
        raise InputError(f"{model.spec.name}: no linear projections to convert to W12")
    # check every weight first, so a refused model is left untouched
    for parent, attr, name in targets:
        w = getattr(parent, attr).weight
        if w.dtype != torch.bfloat16:
            back = w.to(torch.bfloat16).to(w.dtype)
            if not torch.equal(back.view(torch.int16 if w.element_size() == 2 else torch.int32),
                               w.view(torch.int16 if w.element_size() == 2 else torch.int32)):
                raise InputError(f"w12=1: {name} is {str(w.dtype).replace('torch.', '')} and not exactly "
                                 f"representable in bf16, so W12 (lossless for bf16 only) would change the "
                                 f"model; use dtype=bfloat16 (the default with w12=1)")
    for parent, attr, name in targets:
        lin = getattr(parent, attr)
        w = lin.weight.detach()
        wb = w.to(torch.bfloat16)
        packed = encode(wb)
        restored = decode(packed)
        if not torch.equal(restored.view(torch.int16), wb.view(torch.int16)):
            raise RuntimeError(f"W12 restore of {name} differs from the weight (this is a bug)")
        summary.tensors.append(name)
        summary.weights += wb.numel()
        summary.stored_bytes += packed.stored_bytes()
        summary.escapes += packed.num_escapes
        if qviews is not None:
            qviews[name] = decode(packed, qpass=True)
        if fused:
            from specpilot.kernels.w12.pack import KernelPack

            kp = KernelPack.from_w12(packed, device=dev)
            setattr(parent, attr, W12Projection(kp, lin.bias, packed.bits_per_weight()))
        else:
            lin.weight.copy_(restored.to(lin.weight.dtype))
        del packed, restored, wb, w
    if fused and dev.type == "cuda":
        torch.cuda.synchronize(dev)
        summary.seconds = time.perf_counter() - t0
        if warmup:
            t1 = time.perf_counter()
            seen = set()
            for parent, attr, _ in targets:
                mod = getattr(parent, attr)
                key = (mod.out_features, mod.in_features)
                if key in seen:
                    continue
                seen.add(key)
                for m in WARMUP_ROWS:
                    mod(torch.zeros(m, mod.in_features, dtype=torch.bfloat16, device=dev))
            torch.cuda.synchronize(dev)
            summary.warmup_seconds = time.perf_counter() - t1
    else:
        summary.seconds = time.perf_counter() - t0
    return summary
