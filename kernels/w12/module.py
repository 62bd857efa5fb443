"""``W12Linear``: a drop-in ``nn.Linear`` on W12 weights, and ``convert_model`` for HF models.

On CUDA with Triton the forward is the fused kernel (``routing.w12_linear``) for up to 256 rows and a
restore + cuBLAS above that; on the CPU it restores the bf16 weight (bit exact, cached after the
first call unless ``cache_restored=False``) and calls ``F.linear``.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch
from torch import nn

from .format import W12Tensor, decode, encode
from .pack import KernelPack

KERNEL_MAX_ROWS = 256


class W12Linear(nn.Module):
    def __init__(self, packed: W12Tensor, bias: torch.Tensor | None = None, qpass: bool = False,
                 cache_restored: bool = True):
        super().__init__()
        self.in_features = packed.shape[1]
        self.out_features = packed.shape[0]
        self.qpass = qpass
        self.cache_restored = cache_restored
        self._packed = packed.to("cpu")
        kp = KernelPack.from_w12(self._packed, device="cpu")
        self._kp_fields = [f for f in ("rec64", "low_exp", "esc_rowptr", "esc_row", "esc_col",
                                       "esc_delta", "esc_delta_q", "esc_w")]
        self._kp_meta = (kp.shape, kp.rows_stored, kp.max_escapes_per_row)
        for f in self._kp_fields:
            self.register_buffer(f"w12_{f}", getattr(kp, f), persistent=False)
        self.register_buffer("bias", bias.detach().clone() if bias is not None else None)
        self._restored: torch.Tensor | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, qpass: bool = False, verify: bool = True) -> "W12Linear":
        w = linear.weight.detach()
        if w.dtype != torch.bfloat16:
            w = w.to(torch.bfloat16)
        packed = encode(w.cpu() if not w.is_cuda else w)
        if verify and not torch.equal(decode(packed).view(torch.int16), w.view(torch.int16)):
            raise RuntimeError("W12 restore differs from the weight (this is a bug)")
        mod = cls(packed, linear.bias, qpass=qpass)
        return mod.to(w.device)

    def kernel_pack(self):
        rec64 = self.w12_rec64
        return KernelPack(self._kp_meta[0], self._kp_meta[1], rec64, rec64.view(torch.int32), self.w12_low_exp,
                          self.w12_esc_rowptr, self.w12_esc_row, self.w12_esc_col, self.w12_esc_delta,
                          self.w12_esc_delta_q, self._kp_meta[2], self.w12_esc_w)

    def restored_weight(self, dtype=torch.bfloat16) -> torch.Tensor:
        if self._restored is not None and self._restored.device == self.w12_rec64.device:
            return self._restored.to(dtype)
        w = decode(self._packed, qpass=self.qpass).to(self.w12_rec64.device)
        if self.cache_restored:
            self._restored = w
        return w.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.is_cuda and x2.shape[0] <= KERNEL_MAX_ROWS and x2.dtype == torch.bfloat16 and _triton_ok():
            from .routing import w12_linear

            y = w12_linear(x2, self.kernel_pack(), qpass=self.qpass)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        else:
            y = torch.nn.functional.linear(x2, self.restored_weight(x2.dtype),
                                           self.bias.to(x2.dtype) if self.bias is not None else None)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits_per_weight={self._packed.bits_per_weight():.3f}, qpass={self.qpass}")


def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401

        return True
    except Exception:
        return False


@dataclass
class ConversionReport:
    converted: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bf16_bytes: int = 0
    w12_bytes: int = 0

    @property
    def bits_per_weight(self) -> float:
        return 16.0 * self.w12_bytes / self.bf16_bytes if self.bf16_bytes else 0.0


def convert_model(model: nn.Module, include: tuple[str, ...] = ("*",),
                  exclude: tuple[str, ...] = ("lm_head", "*embed*"), qpass: bool = False) -> ConversionReport:
    """Replace matching ``nn.Linear`` modules by ``W12Linear`` in place (restores verified bit for bit)."""
    rep = ConversionReport()
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if not isinstance(child, nn.Linear):
                continue
            if not any(fnmatch.fnmatch(full, p) for p in include) or any(fnmatch.fnmatch(full, p) for p in exclude):
                rep.skipped.append(full)
                continue
            new = W12Linear.from_linear(child, qpass=qpass, verify=True)
            setattr(mod, child_name, new)
            rep.converted.append(full)
            rep.bf16_bytes += child.weight.numel() * 2
            rep.w12_bytes += new._packed.stored_bytes()
    return rep
