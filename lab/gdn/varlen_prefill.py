"""A batch's prompt chunks through the GDN layers: one fla call per request (what the batch decoder
does now) against one variable-length call (``cu_seqlens``) over all of them, at Qwen3.5-9B GDN
shapes on the GPU.

For each set of prompt lengths (the batch_hybrid_gpu benchmark's 16 prompts of 72-144 tokens; a
512-row prefill chunk of a few prompts; one 1000-token prompt) and for ``--layers`` GDN layers
(each its own inputs and per-request states): the wall time of the per-request loop and of the
varlen call (host included: eager steps launch from the host), CUDA-event time of each, and the
largest difference between the two in outputs and final states (fp32; fla sums in chunks, so
the two are not bit-identical, and the per-request chunks start at different offsets).

    python lab/gdn/varlen_prefill.py [--layers 24] [--reps 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from lab.common import bootstrap  # noqa: E402

bootstrap()

from lab.common import print_table, write_results  # noqa: E402

NK, DK, NV, DV = 16, 128, 32, 128
SETS = {"16 prompts, 72-144 tokens": [72, 96, 120, 144] * 4, "512-row chunk of 5 prompts": [100, 80, 140, 120, 72],
        "one 1000-token prompt": [1000]}


def inputs(lengths, layers, gen):
    import torch

    T = sum(lengths)
    out = []
    for _ in range(layers):
        q = torch.randn(T, NK, DK, device="cuda", generator=gen).bfloat16()
        k = torch.randn(T, NK, DK, device="cuda", generator=gen).bfloat16()
        v = torch.randn(T, NV, DV, device="cuda", generator=gen).bfloat16()
        g = -torch.rand(T, NV, device="cuda", generator=gen) * 0.5
        beta = torch.rand(T, NV, device="cuda", generator=gen)
        h0 = torch.randn(len(lengths), NV, DK, DV, device="cuda", generator=gen) * 0.1
        out.append((q, k, v, g, beta, h0))
    return out


def per_request(fn, layer, lengths):
    import torch

    q, k, v, g, beta, h0 = layer
    outs, finals, at = [], [], 0
    for i, n in enumerate(lengths):
        r = slice(at, at + n)
        o, f = fn(q[None, r], k[None, r], v[None, r], g[None, r], beta[None, r], scale=DK ** -0.5,
                  initial_state=h0[i:i + 1], output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(o[0])
        finals.append(f[0])
        at += n
    return torch.cat(outs), torch.stack(finals)


def varlen(fn, layer, cu, cu_cpu):
    q, k, v, g, beta, h0 = layer
    o, f = fn(q[None], k[None], v[None], g[None], beta[None], scale=DK ** -0.5, initial_state=h0,
              output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    return o[0], f


def timed(call, reps):
    """(median wall ms, median CUDA-event ms) of ``call`` over ``reps`` runs after two warm-ups."""
    import statistics

    import torch

    for _ in range(2):
        call()
    torch.cuda.synchronize()
    walls, events = [], []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        call()
        b.record()
        b.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
        events.append(a.elapsed_time(b))
    return statistics.median(walls), statistics.median(events)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, lengths in SETS.items():
        layers = inputs(lengths, args.layers, gen)
        cu_cpu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.long)
        cu = cu_cpu.cuda()
        loop_o, loop_f = per_request(fn, layers[0], lengths)
        var_o, var_f = varlen(fn, layers[0], cu, cu_cpu)
        d_out = (loop_o.float() - var_o.float()).abs().max().item()
        d_state = (loop_f - var_f).abs().max().item()
        lw, le = timed(lambda: [per_request(fn, lay, lengths) for lay in layers], args.reps)
        vw, ve = timed(lambda: [varlen(fn, lay, cu, cu_cpu) for lay in layers], args.reps)
        rows.append({"prompts": name, "requests": len(lengths), "rows": sum(lengths), "layers": args.layers,
                     "loop_wall_ms": lw, "loop_gpu_ms": le, "varlen_wall_ms": vw, "varlen_gpu_ms": ve,
                     "wall_speedup": lw / vw, "max_abs_out_diff": d_out, "max_abs_state_diff": d_state})
    print_table(rows, ["prompts", "rows", "loop_wall_ms", "loop_gpu_ms", "varlen_wall_ms", "varlen_gpu_ms",
                       "wall_speedup", "max_abs_out_diff", "max_abs_state_diff"])
    write_results("varlen_prefill", rows, {"shapes": f"nk={NK} dk={DK} nv={NV} dv={DV}, bf16 q/k/v, fp32 state"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
