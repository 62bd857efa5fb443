"""Verify steps against the AR step: T_step(N) / T_AR on Llama-3.1-8B shapes (H200).

Random bf16 weights (std 0.02), context 1024 committed in the cache (a real prefill), batch 1.
Every step is one CUDA-graph replay timed with CUDA events (median of ``--reps``), the engine's
own graphs (``GraphRunner``): N rows at the slots after the context, each attending the context
and its chain (``probe rows``' inputs), the LM head and the rows' argmax included. T_AR is the
fused one-row AR step of the same weights, timed in the same run. Paths:

* ``fused``  the fused multi-row kernels (``decode=fused``: kernels/verify/gemm.py + attention),
* ``split``  cuBLAS GEMMs with one fused kernel between two GEMMs (kernels/verify/rows.py),
* ``layers`` the layer modules, eager inside the graph (the engine's verify step before them),
* W12 (``--w12``): the projections as W12 records; the multi-row steps run ``w12_linear``.

Also, in the same run: a tree (``--nodes`` nodes, best-first from a synthetic lattice) and a chain
(``--depth`` + 1 rows) through the decoder's padded graph verify pass; correctness (fused against
the layers: argmax agreement and logits difference; graph replays against eager, bit for bit);
``--profile``: kernels per step under the PyTorch profiler (layers and fused, 33 rows); ``--sweep``:
each fused projection kernel alone against cuBLAS ``F.linear`` (L2 flushed by reading 256 MB
before each replay) over a few configs per row tile, the winners written as the table
``verify_tuned_sm90.json`` into ``$OUT`` (and applied to the step timings of this run).

    python benchmarks/verify_step.py [--reps 50] [--w12] [--profile] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bootstrap  # noqa: E402

bootstrap()

from common import L2Flusher, capture_and_time, print_table, write_results  # noqa: E402

CONTEXT = 1024
ROWS = [1, 2, 4, 8, 16, 32, 33, 64]
LAYERS = {"rope": (6144, 4096), "resid_o": (4096, 4096), "silu": (28672, 4096), "resid_down": (4096, 14336)}
SWEEP = {16: [(8, 512, 4, 3), (8, 256, 4, 4), (16, 512, 8, 3), (16, 256, 4, 3), (8, 1024, 8, 2), (32, 256, 8, 3)],
         32: [(8, 256, 4, 3), (8, 512, 8, 3), (16, 256, 8, 3), (16, 128, 4, 4), (8, 128, 4, 4), (32, 128, 8, 3)],
         64: [(8, 128, 4, 3), (8, 256, 8, 2), (16, 128, 8, 3), (16, 64, 4, 4), (8, 64, 4, 4), (32, 128, 8, 2)]}


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def section(name, fn, errors):
    t = time.perf_counter()
    try:
        out = fn()
        log(f"{name}: {time.perf_counter() - t:.1f} s")
        return out
    except Exception as e:  # keep the rest of the run (one device call)
        errors.append(f"{name}: {type(e).__name__}: {e}")
        traceback.print_exc()
        return None


# ---------------------------------------------------------------------------------------------- sweep
def _kernel_call(epi, n, k, T, cfg, dev="cuda"):
    import torch

    from specpilot.kernels.verify import gemm

    g = torch.Generator(device=dev).manual_seed(n + k + T)
    x = torch.randn(T, k, device=dev, generator=g).to(torch.bfloat16)
    gamma = torch.rand(k, device=dev, generator=g).to(torch.bfloat16) + 0.5
    w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    if epi == "resid":
        res = torch.randn(T, n, device=dev, generator=g).to(torch.bfloat16)
        return (lambda: gemm.gemm_residual(x, w, res, cfg)), x, w
    if epi == "silu":
        return (lambda: gemm.norm_gate_up_silu(x, gamma, 1e-5, w, n // 2, cfg)), x, w
    cos = torch.randn(4096, 128, device=dev)
    sin = torch.randn(4096, 128, device=dev)
    pos = torch.arange(T, device=dev) + 1000
    kc = torch.zeros(8, 2048, 128, device=dev, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    return (lambda: gemm.norm_qkv_rope_store(x, gamma, 1e-5, w, cos, sin, pos, pos, kc, vc, 32, 8, cfg)), x, w


def _precompile(job):
    """One worker's share of the sweep's kernels: compile them into Triton's cache."""
    import torch

    from specpilot.kernels.verify import gemm

    done = 0
    for epi, (n, k), T, c in job:
        try:
            fn, _, _ = _kernel_call(epi, n, k, T, gemm.RowsConfig(*c))
            fn()
            torch.cuda.synchronize()
            done += 1
        except Exception as e:  # reported again when the main process runs it
            print(f"precompile {epi} {c}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    return done


def sweep(reps):
    import multiprocessing as mp

    import torch
    import torch.nn.functional as F

    from specpilot.kernels.verify import gemm

    jobs = [(name.split("_")[0], shape, T, c) for name, shape in LAYERS.items() for T, cs in SWEEP.items() for c in cs]
    # the configs' compile keys do not depend on the layer: compile one layer per epilogue in parallel
    keys, seen = [], set()
    for j in jobs:
        key = (j[0], j[2], j[3])
        if key not in seen:
            seen.add(key)
            keys.append(j)
    workers = min(14, len(keys))
    ctx = mp.get_context("spawn")
    t = time.perf_counter()
    with ctx.Pool(workers) as pool:
        n_ok = sum(pool.map(_precompile, [keys[i::workers] for i in range(workers)]))
    log(f"precompiled {n_ok}/{len(keys)} kernels in {time.perf_counter() - t:.1f} s ({workers} processes)")
    flush = L2Flusher()
    rows, best = [], {}
    for name, (n, k) in LAYERS.items():
        epi = name.split("_")[0]
        for T, cs in SWEEP.items():
            fn0, x, w = _kernel_call(epi, n, k, T, None)
            base_us = capture_and_time(lambda: F.linear(x, w), reps=reps, flush=flush)[0]
            for c in cs:
                cfg = gemm.RowsConfig(*c)
                try:
                    fn, _, _ = _kernel_call(epi, n, k, T, cfg)
                    us = capture_and_time(fn, reps=reps, flush=flush)[0]
                except Exception as e:
                    log(f"sweep {name} T={T} {cfg.key()}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                rows.append({"layer": name, "epilogue": epi, "n": n, "k": k, "rows": T, "config": cfg.key(),
                             "us": us, "cublas_us": base_us, "speedup": base_us / us})
                b = best.get((epi, n, k, T))
                if b is None or us < b[0]:
                    best[(epi, n, k, T)] = (us, cfg, base_us)
    entries = []
    lo = {16: 2, 32: 17, 64: 33}
    for (epi, n, k, T), (us, cfg, base) in sorted(best.items()):
        entries.append({"kernel": "gemm", "epilogue": epi, "n": n, "k": k, "rows": [lo[T], T],
                        "config": {"pairs": cfg.pairs, "block_k": cfg.block_k, "warps": cfg.warps,
                                   "stages": cfg.stages},
                        "date": time.strftime("%Y-%m-%d"),
                        "note": f"Llama-3.1-8B: {us:.1f} us alone, cuBLAS F.linear {base:.1f} us ({T} rows, L2 flushed)"})
    return rows, entries


def apply_table(entries):
    """Use the sweep's winners in this process (what the committed table will hold)."""
    from specpilot.kernels import tuning

    tab = tuning.table("verify", "sm90")
    tab["entries"] = entries
    index = {}
    for e in entries:
        index.setdefault(("gemm",) + tuple(sorted({"epilogue": e["epilogue"], "n": e["n"], "k": e["k"]}.items())),
                         []).append(e)
    tab["index"] = index


# ---------------------------------------------------------------------------------------------- steps
def build(reps):
    import torch

    from specpilot.engine.model import StepInput, Transformer
    from specpilot.models import load_model_spec

    spec = load_model_spec("llama-3.1-8b")
    m = Transformer(spec, max_seq=CONTEXT + 2 * 64 + 64, dtype=torch.bfloat16, device="cuda").init_random_fast(0).eval()
    m.set_attention("fused")
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(CONTEXT, device="cuda")
    m.set_decode("layers")
    m.hidden(StepInput(torch.randint(0, spec.vocab_size, (CONTEXT,), generator=g).cuda(), pos, pos,
                       torch.arange(m.max_seq, device="cuda")[None] <= pos[:, None], "seq"), kv_len=m.max_seq)
    return m


def step_inputs(m, T):
    from specpilot.engine.rows import step_input

    return step_input(m, T, CONTEXT)


def time_rows(m, rows, reps, path, weights):
    """T_step(N) of the engine's graph for each N (probe rows' inputs, the cache kept)."""
    import torch

    from specpilot.engine import fused_verify
    from specpilot.engine.graphs import GraphRunner, time_replays

    fused_verify.DENSE_PATH = "split" if path == "split" else "fused"
    m.set_decode("layers" if path == "layers" else "fused")
    out = []
    for T in rows:
        inp = step_inputs(m, T)
        runner = GraphRunner(m)
        g, sinp, _ = runner.get(T)
        for a, b in ((sinp.tokens, inp.tokens), (sinp.pos, inp.pos), (sinp.slots, inp.slots), (sinp.mask, inp.mask)):
            a.copy_(b)
        ms = statistics.median(time_replays(g, reps, 5))
        out.append({"weights": weights, "path": path if T > 1 or path == "layers" else "fused-ar", "rows": T,
                    "step_ms": ms})
        del runner, g
        torch.cuda.empty_cache()
    return out


def check(m, T=33):
    """Fused (and split) against the layers on one T-row step: logits, argmax; graph vs eager bits."""
    import torch

    from specpilot.engine import fused_verify
    from specpilot.engine.graphs import GraphRunner

    inp = step_inputs(m, T)
    res = {}
    m.set_decode("layers")
    ref = m.forward(inp, kv_len=m.max_seq).float()
    for path in ("fused", "split"):
        fused_verify.DENSE_PATH = path
        m.set_decode("fused")
        got = m.forward(inp, kv_len=m.max_seq).float()
        eager = m.greedy(inp, kv_len=m.max_seq).clone()
        runner = GraphRunner(m)
        g, sinp, out = runner.get(T)
        for a, b in ((sinp.tokens, inp.tokens), (sinp.pos, inp.pos), (sinp.slots, inp.slots), (sinp.mask, inp.mask)):
            a.copy_(b)
        same = True
        for _ in range(3):
            g.replay()
            same = same and torch.equal(out, eager)
        res[path] = {"logits_max_abs_diff": float((got - ref).abs().max()), "logits_max_abs": float(ref.abs().max()),
                     "argmax_equal_rows": int((got.argmax(-1) == ref.argmax(-1)).sum()), "rows": T,
                     "graph_equals_eager": bool(same)}
        del runner, g
    fused_verify.DENSE_PATH = "fused"
    return res


def decoder_passes(m, reps, weights, nodes=32, depth=8):
    """Tree and chain verify passes through the decoder's padded graphs (inputs from the host, argmax
    back), CUDA events around the pass as the decode loop times it."""
    import torch

    from specpilot.engine.decode import Decoder
    from specpilot.engine.graphs import GraphRunner
    from specpilot.kernels import tree as treelib

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
        Tp = next(b for b in dec.verify_buckets if b >= T)
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
        out.append({"weights": weights, "mode": mode, "rows": T, "bucket": Tp, "pass_ms": statistics.median(ts)})
        del dec
    return out


def profile(m, T, path, steps=10):
    import torch
    from torch.profiler import ProfilerActivity, profile as tprofile

    from specpilot.engine import fused_verify
    from specpilot.engine.graphs import GraphRunner

    fused_verify.DENSE_PATH = "split" if path == "split" else "fused"
    m.set_decode("layers" if path == "layers" else "fused")
    inp = step_inputs(m, T)
    runner = GraphRunner(m)
    g, sinp, _ = runner.get(T)
    for a, b in ((sinp.tokens, inp.tokens), (sinp.pos, inp.pos), (sinp.slots, inp.slots), (sinp.mask, inp.mask)):
        a.copy_(b)
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
        cls = ("gemm" if low.startswith("_rows_kernel") or any(s in low for s in ("gemm", "nvjet", "cutlass", "xmma",
                                                                                  "w12")) else
               "attention" if "attn" in low else "argmax" if "argmax" in low or "reduce" in low else "other")
        cl = classes.setdefault(cls, [0.0, 0.0])
        cl[0] += c
        cl[1] += us
    del runner, g
    return {"path": path, "rows": T, "kernels_per_step": sum(r[1] for r in top),
            "kernel_us_per_step": sum(r[2] for r in top),
            "classes": {k: {"kernels": v[0], "us": v[1]} for k, v in classes.items()},
            "top": [{"name": n[:120], "calls": c, "us": us} for n, c, us in top[:15]]}


def prefill_profile(m):
    """A 1000-token prefill (as a request's), after one warm-up prefill: wall ms and kernel classes."""
    import torch

    from specpilot.engine.decode import Decoder

    dec = Decoder(m, "ar")
    ids = [(17 * i) % 30000 for i in range(1000)]
    dec.prefill(ids)
    torch.cuda.synchronize()
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        dec.prefill(ids)
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    return {"prefill_ms": statistics.median(ts), "tokens": 1000, "decode": "fused" if m.fused_decode else "layers"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--w12", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--paths", default="fused,split,layers")
    args = ap.parse_args()
    import torch

    torch.set_grad_enabled(False)
    errors: list[str] = []
    extra: dict = {"model": "llama-3.1-8b", "context": CONTEXT, "dtype": "bfloat16",
                   "method": f"CUDA graph replays, CUDA events, median of {args.reps}; T_AR = the fused AR step "
                             "of the same weights in the same run"}
    if args.sweep:
        sw = section("sweep", lambda: sweep(20), errors)
        if sw:
            extra["sweep"], entries = sw
            apply_table(entries)
            out = os.environ.get("OUT")
            if out:
                doc = json.loads((Path(__file__).resolve().parents[1] / "kernels/verify/tuned/sm90.json").read_text())
                doc["entries"] = entries
                Path(out, "verify_tuned_sm90.json").write_text(json.dumps(doc, indent=1) + "\n")
    m = section("build", lambda: build(args.reps), errors)
    rows: list[dict] = []
    paths = args.paths.split(",")
    for path in paths:
        r = section(f"rows {path}", lambda: time_rows(m, ROWS[1:] if path == "split" else ROWS, args.reps, path,
                                                      "bf16"), errors)
        rows.extend(r or [])
    ar = {r["weights"]: r["step_ms"] for r in rows if r["rows"] == 1 and r["path"] == "fused-ar"}
    extra["check"] = section("check", lambda: check(m), errors)
    m.set_decode("fused")
    extra["passes"] = section("passes", lambda: decoder_passes(m, args.reps, "bf16"), errors) or []
    extra["prefill"] = section("prefill", lambda: prefill_profile(m), errors)
    if args.profile:
        extra["profile"] = [section(f"profile {p}", lambda: profile(m, 33, p), errors) for p in ("layers", "fused", "split")]
    if args.w12:
        def w12():
            from specpilot.engine.w12_loader import convert_engine_model

            extra["w12"] = convert_engine_model(m).to_json()
            out = time_rows(m, ROWS, args.reps, "fused", "w12")
            out += time_rows(m, [1, 33], args.reps, "layers", "w12")
            extra["passes"].extend(decoder_passes(m, args.reps, "w12"))
            return out

        rows.extend(section("w12", w12, errors) or [])
        ar.update({r["weights"]: r["step_ms"] for r in rows if r["rows"] == 1 and r["path"] == "fused-ar"})
    for r in rows:
        r["ar_ms"] = ar.get(r["weights"])
        r["ratio"] = r["step_ms"] / r["ar_ms"] if r["ar_ms"] else None
    for p in extra["passes"]:
        p["ar_ms"] = ar.get(p["weights"])
        p["ratio"] = p["pass_ms"] / p["ar_ms"] if p["ar_ms"] else None
    summary = {}
    for w in ar:
        for n, lim in ((32, 1.15), (64, 1.3)):
            r = next((r for r in rows if r["weights"] == w and r["path"] == "fused" and r["rows"] == n), None)
            if r:
                summary[f"{w}_ratio_{n}"] = r["ratio"]
                summary[f"{w}_ratio_{n}_target"] = lim
    extra["summary"] = summary
    extra["errors"] = errors
    print_table(rows, ["weights", "path", "rows", "step_ms", "ratio"])
    print_table(extra["passes"], ["weights", "mode", "rows", "bucket", "pass_ms", "ratio"])
    print(json.dumps({k: extra.get(k) for k in ("summary", "check", "prefill", "errors")}, indent=1))
    if args.profile:
        for p in extra.get("profile") or []:
            if p:
                print(p["path"], p["kernels_per_step"], round(p["kernel_us_per_step"]), p["classes"])
                for t in p["top"][:8]:
                    print("   ", round(t["us"], 1), round(t["calls"], 1), t["name"][:90])
    write_results("verify_step", rows, extra)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
