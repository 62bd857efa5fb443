"""Bundle ``w12``: the lossless 12-bit weight format as an SGLang quantization method (plain part).

This module holds what the SGLang classes in :mod:`.w12_quantization_sglang` do, without importing SGLang, so
it runs (and is tested) on any machine: create the bf16 weight SGLang's loader fills, give it its
W12 form, then run the W12 GEMM. The format and the kernels are ``specpilot.kernels.w12``.

Two sources of the W12 form, both checked bit for bit before anything is served:

* a checkpoint packed by ``specpilot w12 pack``: :func:`restore_stream` turns the four stored parts
  of each packed weight in SGLang's weight stream into the restored bf16 tensor (CRC of every part,
  then the sha256 of the restored bytes against the digest ``pack`` recorded from the original)
  and keeps the W12 tensor; at :func:`process_weights_after_loading` the layer takes it (fused
  q/k/v and gate/up layers: the shards' records concatenated), after checking that it decodes to
  exactly the weights SGLang loaded. No weight is re-encoded.
* a plain bf16 checkpoint: the weight is encoded at load and its restore compared with it.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Iterable, Iterator

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
    source: str = "encoded at load"  # or "packed checkpoint"


# fused SGLang layers and the checkpoint tensors they load, in load order (models also declare
# this as ``packed_modules_mapping``, which takes precedence)
FUSED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_PART_MARK = ".w12."


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


def packed_tables(files: Iterable[str]) -> dict[str, tuple[dict, str]]:
    """``{weight name: (metadata entry, file)}`` for every W12 weight in the safetensors ``files``
    (headers only; files without W12 metadata contribute nothing)."""
    from safetensors import safe_open

    from specpilot.kernels.w12.checkpoint import W12FormatError, w12_info

    out: dict[str, tuple[dict, str]] = {}
    for f in files:
        if not str(f).endswith(".safetensors"):
            continue
        try:
            with safe_open(str(f), framework="pt") as h:
                meta = dict(h.metadata() or {})
            info = w12_info(meta, str(f))
        except W12FormatError as e:
            raise W12LoadError(str(e)) from None
        except Exception as e:  # safetensors' own header errors
            raise W12LoadError(f"{f}: not a readable safetensors file ({str(e).splitlines()[0][:160]})") from None
        out.update({name: (entry, str(f)) for name, entry in info.items()})
    return out


def restore_packed(name: str, parts: dict, entry: dict, source: str, device=None):
    """(W12Tensor on the CPU, restored bf16 weight on the CPU) of one packed weight: CRC of every
    part, structure, then the restored bytes against the sha256 ``pack`` took of the original."""
    from specpilot.kernels.w12 import decode
    from specpilot.kernels.w12.checkpoint import W12FormatError, bf16_sha256, load_w12

    try:
        t = load_w12(parts, name, entry, source)
    except W12FormatError as e:
        raise W12LoadError(str(e)) from None
    digest = entry.get("sha256")
    if not digest:
        raise W12LoadError(f"{source}: {name} carries no restore digest (packed by an older SpecPilot); "
                           "pack the bf16 checkpoint again with 'specpilot w12 pack'")
    restored = decode(t.to(device) if device is not None else t).cpu()
    got = bf16_sha256(restored)
    if got != digest:
        raise W12LoadError(f"{source}: {name}: the restored weight differs from the checkpoint it was packed "
                           f"from (sha256 {got[:16]}... vs {str(digest)[:16]}...)")
    return t, restored


def restore_stream(weights: Iterable, tables: dict[str, tuple[dict, str]], registry: dict,
                   device=None) -> Iterator:
    """SGLang's ``(name, tensor)`` weight stream with the four parts of every packed weight
    replaced by ``(name, restored bf16 weight)``, checked bit for bit (:func:`restore_packed`);
    the W12 tensors go to ``registry`` by name. Other tensors pass through unchanged."""
    pending: dict[str, dict] = {}
    for name, tensor in weights:
        base = name.rsplit(_PART_MARK, 1)[0] if _PART_MARK in name else None
        if base is None or base not in tables:
            yield name, tensor
            continue
        parts = pending.setdefault(base, {})
        parts[name] = tensor
        if len(parts) == 4:
            entry, source = tables[base]
            t, restored = restore_packed(base, pending.pop(base), entry, source, device)
            registry[base] = t
            yield base, restored
    if pending:
        name = next(iter(pending))
        raise W12LoadError(f"{tables[name][1]}: packed weight {name} is missing part(s) "
                           f"(have {', '.join(sorted(k.rsplit('.', 1)[-1] for k in pending[name]))})")


def concat_rows(tensors: list):
    """The W12 form of the row-wise concatenation of ``tensors`` (the records a fused q/k/v or
    gate/up layer would encode to: windows and codes are per output row), or None when a shard
    other than the last does not fill whole 128-row tiles, or the shards' K differ."""
    import torch

    from specpilot.kernels.w12.format import TILE_N, W12Tensor

    if not tensors:
        return None
    k = tensors[0].shape[1]
    if any(t.shape[1] != k for t in tensors) or any(t.shape[0] % TILE_N or t.rows_stored != t.shape[0]
                                                   for t in tensors[:-1]):
        return None
    if len(tensors) == 1:
        return tensors[0]
    offsets, rows = [], 0
    for t in tensors:
        offsets.append(rows)
        rows += t.shape[0]
    return W12Tensor((rows, k), offsets[-1] + tensors[-1].rows_stored,
                     torch.cat([t.records for t in tensors]), torch.cat([t.low_exp for t in tensors]),
                     torch.cat([t.esc_pos + off * k for t, off in zip(tensors, offsets)]),
                     torch.cat([t.esc_bits for t in tensors]))


def shard_names(prefix: str, mapping: dict | None = None) -> list[list[str]]:
    """Checkpoint weight names a layer at ``prefix`` may have been loaded from: itself, or the
    shards of a fused layer (``mapping`` is the model's ``packed_modules_mapping``)."""
    out = [[f"{prefix}.weight"]]
    parent, _, leaf = prefix.rpartition(".")
    shards = (mapping or {}).get(leaf) or FUSED_SHARDS.get(leaf)
    if shards and isinstance(shards, (list, tuple)):
        out.append([f"{parent}.{s}.weight" if parent else f"{s}.weight" for s in shards])
    return out


def from_packed(weight, registry: dict, prefix: str | None, mapping: dict | None = None):
    """The W12 tensor of a loaded layer weight from the packed tensors in ``registry`` (taken out
    of it), when its shards are there and decode to exactly ``weight``; else None."""
    import torch

    from specpilot.kernels.w12 import decode

    if not registry or not prefix:
        return None
    for names in shard_names(prefix, mapping):
        if not all(n in registry for n in names):
            continue
        t = concat_rows([registry[n] for n in names])
        if t is None or tuple(t.shape) != tuple(weight.shape):
            continue
        restored = decode(t.to(weight.device))
        if torch.equal(restored.view(torch.int16), weight.detach().contiguous().view(torch.int16)):
            for n in names:
                registry.pop(n, None)
            return t.to(weight.device)
    return None


def process_weights_after_loading(layer, registry: dict | None = None, prefix: str | None = None,
                                  mapping: dict | None = None) -> W12LayerStats:
    """Give ``layer`` its W12 form in place and drop the bf16 parameter: from a packed checkpoint
    (``registry``, filled by :func:`restore_stream`) when the layer's shards are there, else by
    encoding ``layer.weight``. On CUDA ``layer.w12`` is the kernel layout (``KernelPack``), on
    CPU the W12 tensor for the plain-torch path. Raises :class:`W12LoadError` if a restore is not
    bit-exact (the server must not serve the layer)."""
    t = from_packed(layer.weight.data, registry or {}, prefix, mapping)
    if t is not None:
        out, inp = layer.weight.shape
        stats = W12LayerStats(out, inp, t.num_escapes, t.bits_per_weight(), source="packed checkpoint")
    else:
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
