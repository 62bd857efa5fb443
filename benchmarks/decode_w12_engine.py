"""W12 in the engine's fused AR step: bf16 fused decode vs W12 layer modules vs the W12 fused decode
kernels (Triton and Gluon).

Two Llama-3.1-8B-shaped engines with the same random bf16 weights (seed 0) on the GPU, fused
attention, the LM head as asked (``--head``), context 1024:

* ``bf16 fused``: the dense engine with ``decode=fused`` (the four GEMV kernels per layer, PDL);
* ``w12 layers``: the W12 engine (``w12=1``) stepping through the layer modules (``decode=layers``,
  each projection one ``w12_linear`` call);
* ``w12 layers compiled``: the same with the layers under ``torch.compile`` (``compile=1``);
* ``w12 fused triton``: the W12 engine with ``decode=fused`` on the Triton kernels
  (kernels/decode/gemv_w12.py, ``gemv_w12_gluon.ENABLED = False`` while captured);
* ``w12 fused gluon``: the same on the Gluon kernels (kernels/decode/gemv_w12_gluon.py), what
  ``w12=1`` runs on CUDA.

Each variant's AR step is captured in a CUDA graph; ``--rounds`` rounds time every variant in turn
(``--reps`` replays, CUDA events, median), and the median over rounds is reported, so clock drift
falls on all alike. The W12 engine's one-row logits are checked both ways (layers vs each fused
path, eager), and each fused step's output replayed twice must agree. The Gluon kernels' configs
are the measured table's (``kernels/decode/tuned/``; ``lab/decode/tune_w12_engine.py`` tunes them
inside this step).

    python benchmarks/decode_w12_engine.py [--rounds 5] [--reps 200] [--head linear|certified]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import bootstrap  # noqa: E402

bootstrap()

from common import write_results  # noqa: E402

KERNELS = (("rope", 6144, 4096), ("resid", 4096, 4096), ("silu", 28672, 4096), ("resid", 4096, 14336))


def build_engines(context: int, head: str):
    """The dense engine (``decode=fused``) and the W12 one, Llama-3.1-8B shapes with the same random
    bf16 weights, fused attention, ``head``; and the W12 conversion summary."""
    import torch

    from specpilot.engine import w12_loader as ew
    from specpilot.engine.model import Transformer
    from specpilot.models import load_model_spec

    spec = load_model_spec("llama-3.1-8b")

    def build():
        m = Transformer(spec, max_seq=context + 64, dtype=torch.bfloat16, device="cuda").init_random_fast(0).eval()
        m.set_attention("fused")
        m.set_head(head)
        return m

    dense = build()
    dense.set_decode("fused")
    w12 = build()
    t0 = time.perf_counter()
    summary = ew.convert_engine_model(w12)
    print(f"W12: {len(summary.tensors)} projections, {summary.bits_per_weight:.3f} bits/weight, "
          f"converted in {time.perf_counter() - t0:.1f} s", flush=True)
    return spec, dense, w12, summary


def graph(model, decode: str, context: int):
    """The model's AR step with ``decode`` captured in a CUDA graph: (runner, graph, output)."""
    from specpilot.engine.graphs import GraphRunner

    model.set_decode(decode)
    runner = GraphRunner(model)
    g, out = runner.ar_graph(context, token=11)
    return runner, g, out


def step_ms(model, decode: str, context: int, reps: int) -> float:
    """Median milliseconds of the captured AR step."""
    from specpilot.engine.graphs import time_replays

    runner, g, _ = graph(model, decode, context)
    ms = statistics.median(time_replays(g, reps))
    del runner, g
    return ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--head", choices=["linear", "certified"], default="linear")
    args = ap.parse_args()
    if args.rounds < 1 or args.reps < 1 or not 16 <= args.context <= 8192:
        print("decode_w12_engine: --rounds and --reps must be >= 1 and --context 16-8192", file=sys.stderr)
        return 2
    import torch

    from specpilot.engine.graphs import time_replays
    from specpilot.engine.step_input import StepInput
    from specpilot.kernels.decode import gemv_w12_gluon

    if not torch.cuda.is_available():
        print("decode_w12_engine: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.set_grad_enabled(False)
    ctx = args.context
    spec, dense, w12, summary = build_engines(ctx, args.head)

    # correctness: one eager AR step of the W12 engine through the layers and through the kernels
    n = 16
    pos = torch.arange(n, device="cuda")
    mask = torch.arange(w12.max_seq, device="cuda")[None, :] <= pos[:, None]
    w12.set_decode("layers")
    w12.forward(StepInput(torch.arange(100, 100 + n, device="cuda"), pos, pos, mask, "seq"), kv_len=w12.max_seq)
    one = StepInput(torch.tensor([7], device="cuda"), torch.tensor([n], device="cuda"), torch.tensor([n], device="cuda"),
                    torch.arange(w12.max_seq, device="cuda")[None, :] <= n, "seq")
    ref = w12.forward(one, kv_len=w12.max_seq).float()
    w12.set_decode("fused")
    got = w12.forward(one, kv_len=w12.max_seq).float()
    gemv_w12_gluon.ENABLED = False
    got_t = w12.forward(one, kv_len=w12.max_seq).float()
    gemv_w12_gluon.ENABLED = True
    check = {"logits_max_abs_diff": float((got - ref).abs().max()), "logits_max_abs": float(ref.abs().max()),
             "argmax_equal": bool(torch.equal(got.argmax(-1), ref.argmax(-1))),
             "triton_logits_max_abs_diff": float((got_t - ref).abs().max()),
             "triton_argmax_equal": bool(torch.equal(got_t.argmax(-1), ref.argmax(-1)))}
    # the same check on the dense engine (bf16 fused kernels vs its layers): the scale of bf16 noise
    dense.set_decode("layers")
    dense.forward(StepInput(torch.arange(100, 100 + n, device="cuda"), pos, pos, mask, "seq"), kv_len=dense.max_seq)
    dref = dense.forward(one, kv_len=dense.max_seq).float()
    dense.set_decode("fused")
    dgot = dense.forward(one, kv_len=dense.max_seq).float()
    check["dense_logits_max_abs_diff"] = float((dgot - dref).abs().max())
    check["dense_argmax_equal"] = bool(torch.equal(dgot.argmax(-1), dref.argmax(-1)))
    check["w12_fused_vs_dense_fused_max_abs_diff"] = float((got - dgot).abs().max())

    variants = [("bf16 fused", dense, "fused"), ("w12 layers", w12, "layers"), ("w12 layers compiled", w12, "layers"),
                ("w12 fused triton", w12, "fused"), ("w12 fused gluon", w12, "fused")]
    graphs = []
    for name, model, decode in variants:
        gemv_w12_gluon.ENABLED = name != "w12 fused triton"
        if name == "w12 layers compiled":
            t1 = time.perf_counter()
            model.compile_blocks()
            runner, g, out = graph(model, decode, ctx)
            print(f"compiled the W12 layers in {time.perf_counter() - t1:.0f} s", flush=True)
        else:
            runner, g, out = graph(model, decode, ctx)
        graphs.append((name, runner, g, out))
    gemv_w12_gluon.ENABLED = True
    for name, _, g, out in graphs[3:]:
        g.replay()
        first = out.clone()
        g.replay()
        check[f"{name.split()[-1]}_replays_equal"] = bool(torch.equal(first, out))
    times = {name: [] for name, *_ in graphs}
    for _ in range(args.rounds):
        for name, _, g, _ in graphs:
            times[name].append(statistics.median(time_replays(g, args.reps)))
    rows = []
    base = statistics.median(times["bf16 fused"])
    for name, *_ in graphs:
        ms = statistics.median(times[name])
        rows.append({"variant": name, "step_ms": round(ms, 4), "tokens_per_s": round(1e3 / ms, 1),
                     "speedup_vs_bf16_fused": round(base / ms, 3), "rounds_ms": [round(t, 4) for t in times[name]]})
        print(f"{name:>19}: {ms:.3f} ms/step  {1e3 / ms:6.1f} tok/s  {base / ms:.3f}x", flush=True)
    print(f"check: {check}", flush=True)
    table = {"/".join(map(str, key)): gemv_w12_gluon.config_for(*key, device="cuda").key() for key in KERNELS}
    regs = {"/".join(map(str, key)): v for key, v in gemv_w12_gluon.COMPILED.items()}
    write_results("decode_w12_engine", rows,
                  {"model": spec.name, "context": ctx, "head": args.head, "w12": summary.to_json(),
                   "gluon_table": table, "gluon_regs_spills": regs, "check": check,
                   "method": f"AR step CUDA graphs, {args.rounds} rounds x {args.reps} replays (CUDA events), "
                             "median of round medians; variants interleaved per round"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
