"""Bundle ``w12``: the lossless 12-bit weight format as an SGLang quantization method (plain part).

This module holds what the SGLang classes in :mod:`.w12_quantization_sglang` do, without importing SGLang, so
it runs (and is tested) on any machine: create the bf16 weight SGLang's loader fills, convert it
to W12 at load and check the restored tensor bit for bit against the checkpoint, then run the W12
GEMM. The format and the kernels are ``specpilot.kernels.w12``.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

# Set by the ``tlv`` bundle around its Q pass: W12 layers then read only the 8-bit view (low
# mantissa bits at their midpoint, ``specpilot.kernels.w12`` ``qpass``). False (the exact pass)
# everywhere else.
QPASS: contextvars.ContextVar[bool] = contextvars.ContextVar("specpilot_w12_qpass", default=False)


class W12LoadError(RuntimeError):
    """A converted weight did not restore bit for bit: the server must not start."""


@dataclass
class W12LayerStats:
    out_features: int
    in_features: int
    escapes: int
    bits_per_weight: float


def create_weights(layer, input_size_per_partition: int, output_partition_sizes, params_dtype, **extra_weight_attrs):
    """The same bf16 ``weight`` parameter SGLang's unquantized method creates (the checkpoint's
    loader writes into it), marked for W12 conversion after loading."""
    import torch

    weight = torch.nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition,
                                            dtype=params_dtype), requires_grad=False)
    for k, v in {"input_dim": 1, "output_dim": 0, **extra_weight_attrs}.items():
        setattr(weight, k, v)
    layer.register_parameter("weight", weight)


def convert_weight(weight):
    """Encode ``weight`` (bf16 [out, in]) to W12 and check the restore bit for bit; returns
    (W12Tensor, stats). Raises :class:`W12LoadError` naming the first differing element."""
    import torch

    from specpilot.kernels.w12 import decode, encode

    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise W12LoadError(f"W12 converts 2-D bf16 weights; this layer holds {weight.dtype} {tuple(weight.shape)}")
    t = encode(weight.detach())
    restored = decode(t)
    a = weight.detach().contiguous().view(torch.int16)
    b = restored.to(weight.device).contiguous().view(torch.int16)
    if a.shape != b.shape:
        raise W12LoadError(f"W12 restore has shape {tuple(b.shape)}, checkpoint {tuple(a.shape)}")
    if not torch.equal(a, b):
        idx = tuple((a != b).nonzero()[0].tolist())
        raise W12LoadError(f"W12 restore differs from the checkpoint at {list(idx)} "
                           f"(bits {int(a[idx]) & 0xFFFF:#06x} vs {int(b[idx]) & 0xFFFF:#06x})")
    out, inp = weight.shape
    return t, W12LayerStats(out, inp, t.num_escapes, t.bits_per_weight())


def process_weights_after_loading(layer) -> W12LayerStats:
    """Convert ``layer.weight`` in place: the bf16 parameter is dropped; on CUDA ``layer.w12`` is
    the kernel layout (``KernelPack``), on CPU the W12 tensor for the plain-torch path. Raises
    :class:`W12LoadError` if the restore is not bit-exact (the server must not serve the layer)."""
    t, stats = convert_weight(layer.weight.data)
    device = layer.weight.device
    del layer.weight
    if device.type == "cuda":
        from specpilot.kernels.w12.pack import KernelPack

        layer.w12 = KernelPack.from_w12(t, device=device)
    else:
        layer.w12 = t
    layer.w12_stats = stats
    return stats


def apply(layer, x, bias=None):
    """y = x W^T + b, W the restored weights: the fused W12 GEMM on CUDA, the plain torch
    reference (``specpilot.kernels.w12.naive``) elsewhere. Accepts x of shape [..., in].
    Inside a Q pass (:data:`QPASS` set) W is the 8-bit view instead."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    qpass = QPASS.get()
    if x2.is_cuda:
        from specpilot.kernels.w12.routing import w12_linear

        y = w12_linear(x2, layer.w12, qpass=qpass)
        if bias is not None:
            y = y + bias
    else:
        from specpilot.kernels.w12.naive import w12_linear_ref

        y = w12_linear_ref(x2, layer.w12, qpass=qpass, bias=bias)
    return y.reshape(*lead, y.shape[-1])
