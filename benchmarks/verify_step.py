"""Verify steps against the AR step: T_step(N) / T_AR on Llama-3.1-8B shapes (H200).

Random bf16 weights (std 0.02), context 1024 committed in the cache (a real prefill), batch 1.
Every step is one CUDA-graph replay timed with CUDA events (median of ``--reps``), the engine's
own graphs (``GraphRunner``) on ``probe rows``' inputs: N rows at the slots after the context,
each attending the context and its chain, the LM head and the rows' argmax included. T_AR is the
fused one-row AR step of the same weights in the same run. Paths: ``fused`` (``decode=fused``,
what the engine runs: the fused one-row chain for 1 row, the table's GEMMs (the warp-K GEMM,
cuBLAS, the skinny GEMM) with one fused kernel between two GEMMs for 2..64 rows,
engine/fused_verify.py) and ``layers`` (the layer modules, eager inside the graph: the engine's
verify step before the fused one). ``--w12`` then converts
the projections to W12 in place and times the same on W12 weights (T_AR: the W12 AR step).

In the same run: a tree (32 nodes, best-first from a synthetic lattice) and a chain (9 rows)
through the decoder's padded graph verify pass (host inputs to host argmax, CUDA events);
correctness (fused against the layers on a 33-row step: logits difference and argmax agreement;
graph replays against the eager step, bit for bit); kernels per step under the PyTorch profiler;
the decode loop (``Decoder.generate``, what ``specpilot run`` calls) after the engine's load-time
warm-up: the first request's 1000-token prefill, AR decode tokens/s over 256 tokens (the second
request's SM clock and power beside it, and its fastest and slowest tenth of steps), and a tree
run (a drafter proposing a full 32-node tree every step) with its per-step GPU time (CUDA events in
the loop) against T_step of the same rows; and the
``probe rows`` JSON (``measure_rows``, the command's own function) for bf16 and W12, written to
``$OUT`` as ``probe_rows_llama8b_{bf16,w12}.json``.

    python benchmarks/verify_step.py [--reps 50] [--w12] [--profile]

``--profile`` runs last: the PyTorch profiler is suspected to leave per-launch overhead behind in
the process (a run that profiled before the decode loop measured the eager 1000-token prefill at
140-190 ms against 58 ms in a run that profiled after it, and the loop's AR step 0.4 ms above its
graph replay).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bootstrap  # noqa: E402

bootstrap()

from common import log, print_table, section, write_results  # noqa: E402

CONTEXT = 1024
ROWS = [1, 2, 4, 8, 16, 32, 33, 64]
PROBE_ROWS = [1, 2, 4, 8, 16, 32, 33, 64]


def build(model: str = "llama-3.1-8b"):
    """``model`` with random bf16 weights on CUDA, fused attention, its cache holding a prompt of
    :data:`CONTEXT` random tokens (prefilled through the layer modules)."""
    import torch

    from specpilot.engine.model import Transformer
    from specpilot.engine.step_input import StepInput
    from specpilot.models import load_model_spec

    spec = load_model_spec(model)
    m = Transformer(spec, max_seq=CONTEXT + 512, dtype=torch.bfloat16, device="cuda").init_random_fast(0).eval()
    m.set_attention("fused")
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(CONTEXT, device="cuda")
    m.set_decode("layers")
    m.hidden(StepInput(torch.randint(0, spec.vocab_size, (CONTEXT,), generator=g).cuda(), pos, pos,
                       torch.arange(m.max_seq, device="cuda")[None] <= pos[:, None], "seq"), kv_len=m.max_seq)
    return m


def _graph(m, T):
    from specpilot.engine.graphs import GraphRunner
    from specpilot.engine.rows import step_input

    inp = step_input(m, T, CONTEXT)
    runner = GraphRunner(m)
    g, sinp, out = runner.get(T)
    for a, b in ((sinp.tokens, inp.tokens), (sinp.pos, inp.pos), (sinp.slots, inp.slots), (sinp.mask, inp.mask)):
        a.copy_(b)
    return runner, g, inp, out


def time_rows(m, rows, reps, path, weights):
    """T_step(N) of the engine's graph for each N (probe rows' inputs, the cache kept)."""
    import torch

    from specpilot.engine.graphs import time_replays

    m.set_decode(path)
    out = []
    for T in rows:
        runner, g, _, _ = _graph(m, T)
        out.append({"weights": weights, "path": path, "rows": T, "step_ms": statistics.median(time_replays(g, reps, 5))})
        del runner, g
        torch.cuda.empty_cache()
    return out


def check(m, T=33):
    """The fused step against the layers on one T-row step (logits, argmax); graph vs eager bits
    (the graph replays the eager step's own inputs)."""
    import torch

    m.set_decode("fused")
    runner, g, inp, out = _graph(m, T)
    m.set_decode("layers")
    ref = m.forward(inp, kv_len=m.max_seq).float()
    m.set_decode("fused")
    got = m.forward(inp, kv_len=m.max_seq).float()
    eager = m.greedy(inp, kv_len=m.max_seq).clone()
    same = True
    for _ in range(3):
        g.replay()
        same = same and torch.equal(out, eager)
    return {"rows": T, "logits_max_abs_diff": float((got - ref).abs().max()), "logits_max_abs": float(ref.abs().max()),
            "argmax_equal_rows": int((got.argmax(-1) == ref.argmax(-1)).sum()), "graph_equals_eager": bool(same)}


def decoder_passes(m, reps, weights, nodes=32, depth=8):
    """Tree and chain verify passes through the decoder's padded graphs (inputs from the host, argmax
    back), CUDA events around the pass as the decode loop times it."""
    import torch

    from specpilot.engine.decode import Decoder
    from specpilot.engine.graphs import GraphRunner
    from specpilot.kernels import tree as treelib

    m.set_decode("fused")
    g = torch.Generator().manual_seed(0)
    V = m.spec.vocab_size
    lp = torch.log_softmax(torch.randn(depth, 4, generator=g), -1).tolist()
    toks = torch.randint(0, V, (depth, 4), generator=g).tolist()
    trees = {"tree": treelib.build_best_first(toks, lp, None, nodes),
             "chain": treelib.chain_tree([t[0] for t in toks], [r[0] for r in lp])}
    out = []
    for mode, tree in trees.items():
        dec = Decoder(m, mode, drafter=object(), nodes=nodes, depth=depth, runner=GraphRunner(m))
        T = 1 + len(tree)
        for _ in range(3):
            dec._graph_verify(7, tree, CONTEXT)
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dec._graph_verify(7, tree, CONTEXT)
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        out.append({"weights": weights, "mode": mode, "rows": T, "bucket": next(b for b in dec.verify_buckets if b >= T),
                    "pass_ms": statistics.median(ts)})
        del dec
    return out


def profile(m, T, path, steps=10):
    import torch
    from torch.profiler import ProfilerActivity, profile as tprofile

    m.set_decode(path)
    runner, g, _, _ = _graph(m, T)
    g.replay()
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            g.replay()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    top = sorted(((n, c / steps, us / steps) for n, (c, us) in kernels.items()), key=lambda r: -r[2])
    classes = {}
    for n, c, us in top:
        low = n.lower()
        cls = ("gemm" if any(s in low for s in ("gemm", "nvjet", "cutlass", "xmma", "splitk", "w12")) else
               "attention" if "attn" in low else "fused rows kernels" if "_rows_kernel" in low else
               "argmax" if "argmax" in low else "other")
        cl = classes.setdefault(cls, [0.0, 0.0])
        cl[0] += c
        cl[1] += us
    del runner, g
    return {"path": path, "rows": T, "kernels_per_step": sum(r[1] for r in top),
            "kernel_us_per_step": sum(r[2] for r in top),
            "classes": {k: {"kernels": v[0], "us": v[1]} for k, v in classes.items()},
            "top": [{"name": n[:120], "calls": c, "us": us} for n, c, us in top[:12]]}


def probe_json(m, reps, weights, w12_info=None):
    """``probe rows``' JSON for this model (``measure_rows``, as the command writes it)."""
    from specpilot.engine.rows import measure_rows

    m.set_decode("fused")
    res = measure_rows(m, PROBE_ROWS, CONTEXT, reps=reps, warmup=5)
    res.model = "llama-3.1-8b"
    res.extra.update({"w12": w12_info, "attn": "fused", "head": "linear", "decode": "fused"})
    doc = res.to_json()
    out = os.environ.get("OUT")
    if out:
        Path(out, f"probe_rows_llama8b_{weights}.json").write_text(json.dumps(doc, indent=1) + "\n")
    return {p["rows"]: p["step_ms"] for p in doc["points"]}


class FixedDrafter:
    """Proposes the same random lattice (depth 8, 4 candidates) every step, so that every step of a
    tree run verifies a full tree (random weights accept almost nothing: timing, not tau)."""

    def __init__(self, vocab: int, depth: int = 8, k: int = 4):
        import random

        from specpilot.engine.drafters import Lattice

        rnd = random.Random(0)
        self.lattice = Lattice([[rnd.randrange(vocab) for _ in range(k)] for _ in range(depth)],
                               [[-0.5 * (j + 1) for j in range(k)] for _ in range(depth)], None)

    def reset(self, model, prompt_ids):
        pass

    def propose(self, context, n_cache, m, k):
        return self.lattice


def decode_loop(m, weights, probe):
    """The decode loop after the engine's load-time warm-up (what ``load_engine`` does): the first
    request's 1000-token prefill, AR tokens/s over 256 new tokens, and a tree run's in-loop step
    times per bucket against ``probe`` (T_step of the same rows)."""
    import torch

    from specpilot.engine.clocks import ClockWatch
    from specpilot.engine.decode import Decoder
    from specpilot.engine.graphs import GraphRunner

    m.set_decode("fused")
    res = {"weights": weights}
    dec = Decoder(m, "ar", runner=GraphRunner(m))
    res["warmup_seconds"] = dec.warm_up()
    prompt = [(977 * i + 13) % 120000 for i in range(1000)]
    first = dec.generate(prompt, 256)
    with ClockWatch(m.device) as watch:
        second = dec.generate(prompt[::-1], 256)
    steps = sorted(t[1] for t in second.step_times)
    res.update({"first_prefill_ms": first.prefill_seconds * 1e3, "second_prefill_ms": second.prefill_seconds * 1e3,
                "ar_decode_tokens_per_s": [first.decode_tokens_per_second, second.decode_tokens_per_second],
                "ar_step_timing": second.step_timing(), "ar_gpu_clocks": watch.summary(),
                # GPU ms of the fastest tenth of the steps and of the slowest: at full clock and as the clock fell
                "ar_step_gpu_ms_fastest_tenth": statistics.fmean(steps[: max(1, len(steps) // 10)]),
                "ar_step_gpu_ms_slowest_tenth": statistics.fmean(steps[-max(1, len(steps) // 10):])})
    del dec
    torch.cuda.empty_cache()
    tree = Decoder(m, "tree", FixedDrafter(m.spec.vocab_size), nodes=32, depth=8, topk=4, runner=GraphRunner(m))
    tree.warm_up()
    r = tree.generate(prompt, 128)
    t = r.step_timing()
    res["tree"] = {"steps": r.steps, "tau": r.tau, "decode_tokens_per_s": r.decode_tokens_per_second, "timing": t}
    res["loop_vs_probe"] = [{"rows": b["rows"], "steps": b["steps"], "loop_gpu_ms": b["gpu_ms"],
                             "probe_ms": probe.get(b["rows"]),
                             "ratio": b["gpu_ms"] / probe[b["rows"]] if b["rows"] in probe else None}
                            for b in t["by_rows"]]
    del tree
    torch.cuda.empty_cache()
    return res


def tiny_lossless():
    """fp32 tiny model on CUDA with graphs: chain and tree (fused multi-row steps) equal AR."""
    from specpilot.engine.api import load_engine

    prompt = list(b"abcabcabc hello hello abcabc")
    base = "engine:model=tiny,dtype=float32,device=cuda,ctx=512"
    ar = load_engine(base + ",mode=ar").generate(prompt, 48).output_ids
    out = {}
    for mode in ("chain", "tree"):
        e = load_engine(base + f",mode={mode}")
        r = e.generate(prompt, 48)
        out[mode] = {"equal_ar": r.output_ids == ar, "steps": r.steps, "decode": e.info["decode"]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--w12", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    import torch

    torch.set_grad_enabled(False)
    errors: list[str] = []
    extra: dict = {"model": "llama-3.1-8b", "context": CONTEXT, "dtype": "bfloat16",
                   "method": f"CUDA graph replays, CUDA events, median of {args.reps}; ratio = T_step(N) / T_AR, "
                             "T_AR = the fused AR step of the same weights in the same run"}
    m = section("build", build, errors)
    rows: list[dict] = []
    for path in ("fused", "layers"):
        rows.extend(section(f"rows {path}", lambda: time_rows(m, ROWS, args.reps, path, "bf16"), errors) or [])
    extra["check"] = section("check", lambda: check(m), errors)
    extra["passes"] = section("passes", lambda: decoder_passes(m, args.reps, "bf16"), errors) or []
    probe = section("probe bf16", lambda: probe_json(m, args.reps, "bf16"), errors) or {}
    extra["loop"] = [section("loop bf16", lambda: decode_loop(m, "bf16", probe), errors)]
    if args.w12:
        def w12():
            from specpilot.engine.w12_loader import convert_engine_model

            extra["w12"] = convert_engine_model(m).to_json()
            out = time_rows(m, ROWS, args.reps, "fused", "w12") + time_rows(m, [1, 33], args.reps, "layers", "w12")
            extra["passes"].extend(decoder_passes(m, args.reps, "w12"))
            return out

        rows.extend(section("w12", w12, errors) or [])
        if "w12" in extra:
            probe = section("probe w12", lambda: probe_json(m, args.reps, "w12", extra["w12"]), errors) or {}
            extra["loop"].append(section("loop w12", lambda: decode_loop(m, "w12", probe), errors))
    if args.profile:   # last: the profiler leaves per-launch overhead behind in the process
        extra["profile"] = [section(f"profile {p}", lambda: profile(m, 33, p), errors) for p in ("layers", "fused")]
    del m
    torch.cuda.empty_cache()
    extra["lossless_tiny_fp32"] = section("tiny lossless", tiny_lossless, errors)
    ar = {r["weights"]: r["step_ms"] for r in rows if r["rows"] == 1 and r["path"] == "fused"}
    for r in rows + extra["passes"]:
        r["ar_ms"] = ar.get(r["weights"])
        t = r.get("step_ms", r.get("pass_ms"))
        r["ratio"] = t / r["ar_ms"] if r["ar_ms"] else None
    summary = {}
    for w in ar:
        for n, lim in ((32, 1.15), (33, 1.15), (64, 1.3)):
            r = next((r for r in rows if r["weights"] == w and r["path"] == "fused" and r["rows"] == n), None)
            if r:
                summary[f"{w}_ratio_{n}"] = r["ratio"]
                summary[f"{w}_ratio_{n}_target"] = lim
    extra["summary"] = summary
    extra["errors"] = errors
    print_table(rows, ["weights", "path", "rows", "step_ms", "ratio"])
    print_table(extra["passes"], ["weights", "mode", "rows", "bucket", "pass_ms", "ratio"])
    print(json.dumps({k: extra.get(k) for k in ("summary", "check", "loop", "lossless_tiny_fp32", "errors")},
                     indent=1, default=str)[:6000])
    for p in extra.get("profile") or []:
        if p:
            print(p["path"], round(p["kernels_per_step"]), round(p["kernel_us_per_step"]), p["classes"])
    write_results("verify_step", rows, extra)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
