"""Bundle ``w12``: the lossless 12-bit weight format as an SGLang quantization method (plain part).

This module holds what the SGLang classes in :mod:`.w12_sglang` do, without importing SGLang, so
it runs (and is tested) on any machine: create the bf16 weight SGLang's loader fills, convert it
to W12 at load and check the restored tensor bit for bit against the checkpoint, then run the W12
GEMM. The format and the kernels are ``specpilot.kernels.w12``.
"""

from __future__ import annotations

from dataclasses import dataclass


class W12LoadError(RuntimeError):
    """A converted weight did not restore bit for bit: the server must not start."""


@dataclass
class W12LayerStats:
    out_features: int
    in_features: int
    escapes: int
    bits_per_weight: float


def _kernels():
    from specpilot.kernels import w12

    return w12


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
    """Pack ``weight`` (bf16 [out, in]) to W12 and check the restore bit for bit; returns
    (packed, stats). Raises :class:`W12LoadError` naming the first differing element."""
    import torch

    k = _kernels()
    if weight.dtype != torch.bfloat16:
        raise W12LoadError(f"W12 converts bf16 weights; this layer holds {weight.dtype}")
    packed = k.pack(weight)
    restored = k.decode(packed)
    a = weight.contiguous().view(torch.int16)
    b = restored.to(weight.device).contiguous().view(torch.int16)
    if a.shape != b.shape or not torch.equal(a, b):
        if a.shape != b.shape:
            raise W12LoadError(f"W12 restore has shape {tuple(b.shape)}, checkpoint {tuple(a.shape)}")
        idx = (a != b).nonzero()[0].tolist()
        raise W12LoadError(f"W12 restore differs from the checkpoint at {idx} "
                           f"({weight[tuple(idx)].item()!r} vs {restored[tuple(idx)].item()!r})")
    out, inp = weight.shape
    escapes = int(getattr(packed, "num_escapes", getattr(packed, "escapes", 0)) if not callable(
        getattr(packed, "num_escapes", None)) else packed.num_escapes())
    bits = float(k.bits_per_weight(packed)) if hasattr(k, "bits_per_weight") else float("nan")
    return packed, W12LayerStats(out, inp, escapes, bits)


def process_weights_after_loading(layer) -> W12LayerStats:
    """Convert ``layer.weight`` in place: the bf16 parameter is dropped, ``layer.w12`` holds the
    packed weight. Raises :class:`W12LoadError` if the restore is not bit-exact."""
    packed, stats = convert_weight(layer.weight.data)
    del layer.weight
    layer.w12 = packed
    layer.w12_stats = stats
    return stats


def apply(layer, x, bias=None):
    """y = x W^T + b with the W12 GEMM (the exact pass: all 16 bits restored)."""
    return _kernels().w12_linear(x, layer.w12, bias)
