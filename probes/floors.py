"""Byte floors: bytes and FLOPs per kernel class for one decode/verify step.

A step verifies ``rows`` rows for each of ``batch`` requests whose committed context is
``context`` tokens. For every kernel class the floor is (paper 3.2, DESIGN.md)::

    floor = max(FLOPs / (flops_fraction x peak dense), bytes / (bw_fraction x peak bandwidth))

with fractions 0.60 and 0.90 by default; the peak is the fp8 one for GEMMs on fp8 weights
(:func:`fp8_gemm_classes`), the bf16 one otherwise. Classes run one after another, so the step floor is the
sum of class floors. Counting rules (stated so that users can check them by hand):

- ``linear``: every dense projection GEMM (attention q/k/v/o, GDN in/out projections, dense
  MLPs, MoE router and shared expert) reads its weights once per step, plus bf16 activations in
  and out for each of the step's ``rows x batch`` rows. FLOPs = 2 x rows x K x N per GEMM.
- ``lm_head``: vocab x hidden weights once per step; every row produces logits.
- ``attention``: per request and full-attention layer, the K and V cache of ``context`` tokens
  is read, the new rows' K/V written; FLOPs = 4 x rows x (context + rows) x heads x head_dim.
- ``gdn``: per request and Gated DeltaNet layer, the fp32 recurrent state
  ``[value_heads, key_dim, value_dim]`` is read and written once, the conv state too; per row the
  recurrence costs 7 x key_dim x value_dim FLOPs per value head (decay, k^T S, correction,
  rank-one update, q S) plus the causal conv. Rows are counted as one chain of updates (the
  path-recompute of a tree costs more: sum of node depths, which replay can supply).
- ``moe``: per MoE layer the routed experts actually touched by the step's rows (expected distinct
  experts under uniform routing, ``MoESpec.expected_touched``), each read once; FLOPs = 2 x rows x
  top-k x expert params.
- ``norm``: RMSNorms, residual adds, SwiGLU and RoPE: bf16 activations read and written per row,
  plus norm weights.
- ``drafter``: when a drafter model is given, its own whole step (all its classes) for
  ``draft_rows`` rows per request, times ``draft_passes`` for a sequential drafter (one pass per
  drafted position, each re-reading the drafter's weights); a parallel (block) drafter is one pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specpilot.errors import InputError
from specpilot.gpus import GPUSpec
from specpilot.models import DTYPE_BITS, FULL_ATTENTION, ModelSpec

CLASSES = ("linear", "lm_head", "attention", "gdn", "moe", "norm", "drafter")
ACT_BYTES = 2  # bf16 activations


@dataclass
class ClassCost:
    bytes: float
    flops: float
    floor_ms: float = 0.0
    bound: str = "bytes"  # which term sets the floor

    def as_dict(self) -> dict:   # numbers as floats in every class (some classes count whole bytes)
        return {"bytes": float(self.bytes), "flops": float(self.flops), "floor_ms": self.floor_ms, "bound": self.bound}


@dataclass
class StepFloor:
    model: str
    gpu: str
    rows: int
    batch: int
    context: int
    classes: dict[str, ClassCost] = field(default_factory=dict)
    total_floor_ms: float = 0.0
    weight_dtype: str = "bf16"

    @property
    def total_bytes(self) -> float:
        return sum(c.bytes for c in self.classes.values())

    @property
    def total_flops(self) -> float:
        return sum(c.flops for c in self.classes.values())

    def as_dict(self) -> dict:
        return {"rows": self.rows, "batch": self.batch, "context": self.context,
                "classes": {k: v.as_dict() for k, v in self.classes.items()},
                "total_bytes": self.total_bytes, "total_flops": self.total_flops,
                "total_floor_ms": self.total_floor_ms}


def gemms(model: ModelSpec) -> list[tuple[str, int, int, int]]:
    """Dense projection GEMMs of one step as (name, K_in, N_out, count over layers)."""
    d, hd = model.hidden_size, model.head_dim
    out: dict[tuple[str, int, int], int] = {}

    def add(name, k, n):
        out[(name, k, n)] = out.get((name, k, n), 0) + 1

    for kind, is_moe in zip(model.layer_types, model.moe_layers):
        if kind == FULL_ATTENTION:
            q = model.num_heads * hd * (2 if model.attn_output_gate else 1)
            add("qkv_proj", d, q + 2 * model.num_kv_heads * hd)
            add("o_proj", model.num_heads * hd, d)
        else:
            g = model.gdn
            add("in_proj_qkvz", d, 2 * g.key_dim + 2 * g.value_dim)
            add("in_proj_ba", d, 2 * g.num_value_heads)
            add("out_proj", g.value_dim, d)
        if is_moe:
            m = model.moe
            add("router", d, m.num_experts)
            if m.shared_intermediate:
                add("shared_gate_up", d, 2 * m.shared_intermediate)
                add("shared_down", m.shared_intermediate, d)
                if m.shared_expert_gate:
                    add("shared_expert_gate", d, 1)
        else:
            add("gate_up_proj", d, 2 * model.intermediate_size)
            add("down_proj", model.intermediate_size, d)
    return [(name, k, n, c) for (name, k, n), c in out.items()]


def _bits(dtype: str, what: str) -> float:
    try:
        return DTYPE_BITS[dtype]
    except KeyError:
        raise InputError(f"unknown {what} dtype {dtype!r}; choose from {', '.join(DTYPE_BITS)}") from None


def class_costs(model: ModelSpec, rows: int, batch: int = 1, context: int = 2048, weight_dtype: str = "bf16",
                lm_head_dtype: str | None = None, kv_dtype: str = "bf16") -> dict[str, ClassCost]:
    """Bytes and FLOPs per class (no floor yet) for one step of ``model``."""
    if rows <= 0 or batch <= 0:
        raise InputError(f"rows and batch must be positive (got rows={rows}, batch={batch})")
    if context < 0:
        raise InputError(f"context must be >= 0 (got {context})")
    wb = _bits(weight_dtype, "weight") / 8
    hb = _bits(lm_head_dtype_of(weight_dtype, lm_head_dtype), "lm_head") / 8
    kvb = _bits(kv_dtype, "kv") / 8
    t = rows * batch
    d = model.hidden_size
    costs: dict[str, ClassCost] = {}

    # linear projections
    lin_bytes = lin_flops = 0.0
    for _, k, n, count in gemms(model):
        lin_bytes += count * (k * n * wb + t * (k + n) * ACT_BYTES)
        lin_flops += count * 2.0 * t * k * n
    costs["linear"] = ClassCost(lin_bytes, lin_flops)

    # LM head: weights once, every row gets logits
    v = model.vocab_size
    costs["lm_head"] = ClassCost(v * d * hb + t * (d + v) * ACT_BYTES, 2.0 * t * v * d)

    # attention over the KV cache
    n_attn = model.num_full_attention_layers
    hd, kvh, h = model.head_dim, model.num_kv_heads, model.num_heads
    per_layer_req_bytes = (context * 2 * kvh * hd * kvb  # read K and V of the committed context
                           + rows * 2 * kvh * hd * kvb  # write the new rows' K/V
                           + rows * 2 * h * hd * ACT_BYTES)  # read q, write out
    costs["attention"] = ClassCost(n_attn * batch * per_layer_req_bytes,
                                   n_attn * batch * 4.0 * rows * (context + rows) * h * hd)

    # Gated DeltaNet recurrent layers
    n_gdn = model.num_gdn_layers
    if n_gdn and model.gdn is not None:
        g = model.gdn
        state = g.state_elems() * 4  # fp32
        conv_state = (g.conv_kernel - 1) * g.conv_dim * ACT_BYTES
        per_req = 2 * state + 2 * conv_state
        per_row = (g.conv_dim + g.value_dim + 2 * g.num_value_heads) * ACT_BYTES * 2
        gdn_bytes = n_gdn * (batch * per_req + t * per_row + g.conv_params() * ACT_BYTES)
        gdn_flops = n_gdn * t * (7.0 * g.num_value_heads * g.key_head_dim * g.value_head_dim + 2.0 * g.conv_kernel * g.conv_dim)
        costs["gdn"] = ClassCost(gdn_bytes, gdn_flops)
    else:
        costs["gdn"] = ClassCost(0.0, 0.0)

    # MoE routed experts
    if model.moe is not None and model.num_moe_layers:
        m = model.moe
        touched = m.expected_touched(t)
        ep = model.expert_params()
        act = t * m.experts_per_tok * (d + 2 * m.expert_intermediate + m.expert_intermediate + d) * ACT_BYTES
        costs["moe"] = ClassCost(model.num_moe_layers * (touched * ep * wb + act),
                                 model.num_moe_layers * 2.0 * t * m.experts_per_tok * ep)
    else:
        costs["moe"] = ClassCost(0.0, 0.0)

    # norms and elementwise: bf16 elements read + written per row
    L = model.num_layers
    elems = L * (4 * d + 6 * d) + 2 * d  # per layer 2 RMSNorms (r+w) and 2 residual adds (2r+w); final norm
    elems += n_attn * (h + kvh) * hd * 2  # RoPE on q and k (r+w)
    for is_moe in model.moe_layers:
        inter = (model.moe.experts_per_tok * model.moe.expert_intermediate + model.moe.shared_intermediate
                 if is_moe else model.intermediate_size)
        elems += 3 * inter  # SwiGLU: read gate and up, write the product
    costs["norm"] = ClassCost(t * elems * ACT_BYTES + (2 * L + 1) * d * ACT_BYTES, 4.0 * t * elems)
    return costs


def lm_head_dtype_of(weight_dtype: str, lm_head_dtype: str | None) -> str:
    """The LM head's storage: as given, else the weights' (bf16 beside W12, which packs no LM head)."""
    return lm_head_dtype or ("bf16" if weight_dtype == "w12" else weight_dtype)


def fp8_gemm_classes(weight_dtype: str, lm_head_dtype: str | None) -> frozenset[str]:
    """The classes whose GEMMs run on fp8 weights and so take the fp8 peak: the projections and
    routed experts under fp8 weights, the LM head when it is fp8. Attention (bf16 or fp8 KV, bf16
    queries), norms and Gated DeltaNet stay at the bf16 peak."""
    out = {"linear", "moe"} if weight_dtype == "fp8" else set()
    if lm_head_dtype_of(weight_dtype, lm_head_dtype) == "fp8":
        out.add("lm_head")
    return frozenset(out)


def apply_floors(costs: dict[str, ClassCost], gpu: GPUSpec, fp8_classes: frozenset[str] = frozenset(),
                 flops_fraction: float = 0.60, bw_fraction: float = 0.90) -> float:
    """Fill ``floor_ms`` of every class; returns the step floor (sum) in ms. The classes named in
    ``fp8_classes`` (GEMMs on fp8 weights) take the fp8 tensor-core peak, every other the bf16 one."""
    if not (0 < flops_fraction <= 1 and 0 < bw_fraction <= 1):
        raise InputError("--flops-fraction and --bw-fraction must be in (0, 1]")
    bw = gpu.bandwidth * bw_fraction
    total = 0.0
    for name, c in costs.items():
        peak = gpu.peak_flops("fp8" if name in fp8_classes else "bf16") * flops_fraction
        t_f = c.flops / peak * 1e3
        t_b = c.bytes / bw * 1e3
        c.floor_ms, c.bound = (t_f, "flops") if t_f > t_b else (t_b, "bytes")
        total += c.floor_ms
    return total


def step_floor(model: ModelSpec, gpu: GPUSpec, rows: int, *, batch: int = 1, context: int = 2048,
               weight_dtype: str = "bf16", lm_head_dtype: str | None = None, kv_dtype: str = "bf16",
               drafter: ModelSpec | None = None, draft_rows: int | None = None,
               flops_fraction: float = 0.60, bw_fraction: float = 0.90, draft_passes: int = 1) -> StepFloor:
    """The floor of one decode/verify step, per kernel class (see module docs for the rules)."""
    costs = class_costs(model, rows, batch, context, weight_dtype, lm_head_dtype, kv_dtype)
    total = apply_floors(costs, gpu, fp8_gemm_classes(weight_dtype, lm_head_dtype), flops_fraction, bw_fraction)
    drafter_cost = ClassCost(0.0, 0.0)
    if drafter is not None:
        # the drafter's whole step: its own classes floored separately, summed (they run in sequence);
        # a sequential drafter (EAGLE-style) runs ``draft_passes`` passes of ``draft_rows`` rows each
        if draft_passes < 1:
            raise InputError(f"--draft-passes must be >= 1, got {draft_passes}")
        dcosts = class_costs(drafter, draft_rows or rows, batch, context, "bf16", None, kv_dtype)
        for c in dcosts.values():
            c.bytes, c.flops = c.bytes * draft_passes, c.flops * draft_passes
        d_total = apply_floors(dcosts, gpu, frozenset(), flops_fraction, bw_fraction)
        bound = "flops" if sum(c.floor_ms for c in dcosts.values() if c.bound == "flops") > d_total / 2 else "bytes"
        drafter_cost = ClassCost(sum(c.bytes for c in dcosts.values()), sum(c.flops for c in dcosts.values()),
                                 d_total, bound)
        total += d_total
    costs["drafter"] = drafter_cost
    ordered = {k: costs[k] for k in CLASSES}
    return StepFloor(model=model.name, gpu=gpu.key, rows=rows, batch=batch, context=context, classes=ordered,
                     total_floor_ms=total, weight_dtype=weight_dtype)
