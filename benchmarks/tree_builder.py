"""Batched best-first tree builder on the GPU (``specpilot.kernels.tree.build_batched``, the heap in
registers): exactness first, then CUDA-graph timing of the kernel, of the plain-torch reference
and of the host heap; and real paired timings judged by the compare rule (A/A must not be
approved; the kernel vs the torch reference). ``lab/tree/compare.py`` adds the level-sort kernel
and the kernel's warps and L1 prefetch.

    python benchmarks/tree_builder.py            # writes benchmarks/results/tree_builder.json

Rows: B requests x m positions x K candidates, N nodes per request, shared budget or not,
marginal or parent-conditioned scores. Target (issue 6): <= 50 us for 32 x 32 nodes from 16 x 16.

Exactness, per row, before any timing: the kernel's trees (tokens, parents, depths, candidates and
float32 scores of every kept node, ``valid`` and ``count``) must equal the torch reference's, on
the row's lattice and on a dyadic one full of exact ties; ``*_mismatch_requests`` counts requests
that differ from the engine's float64 heap (``specpilot.kernels.tree``; with a shared budget its
uncapped shared heap, see the note in the results file).
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


from common import bootstrap  # noqa: E402

bootstrap()

from common import L2Flusher, capture_and_time, environment, print_table, write_results  # noqa: E402

KERNELS = ("frontier",)
BUILDERS: dict = {}   # kernels a lab script adds (name -> builder taking build_batched's arguments)
BASES = {"torch": "torch reference"}   # what the paired timings judge the frontier kernel against


def lattice(B, m, K, seed, device, quant=None):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    off = torch.randint(0, 50000, (B, m, 1), generator=g)
    tok = (off + torch.arange(K) * 3137) % 50000          # distinct candidates per position
    lp = torch.log_softmax(torch.randn(B, m, K, generator=g) * 2.5, -1).sort(-1, descending=True).values
    tr = torch.log_softmax(torch.randn(B, m - 1, K, K, generator=g) * 2.5, -1)
    if quant:  # dyadic scores: exact ties everywhere, exact float32 sums
        lp, tr = (lp * quant).round() / quant, (tr * quant).round() / quant
    return tok.to(device), lp.to(device), tr.to(device)


def build(name, tok, lp, t, n, bud, out=None, **kw):
    from specpilot.kernels.tree.batched import build_batched
    from specpilot.kernels.tree.naive import build_batched_ref

    if name == "torch":
        return build_batched_ref(tok, lp, t, n, bud)
    if name in BUILDERS:
        return BUILDERS[name](tok, lp, t, n, bud, out=out, **kw)
    return build_batched(tok, lp, t, n, budget=bud, backend="triton", out=out, **kw)


def same_trees(a, b) -> bool:
    """Identical kept nodes (every field, scores bit for bit), valid masks and counts."""
    import torch

    if not (torch.equal(a.valid, b.valid) and torch.equal(a.count, b.count)):
        return False
    v = a.valid
    return all(torch.equal(x[v], y[v]) for x, y in ((a.tokens, b.tokens), (a.parents, b.parents),
                                                     (a.depth, b.depth), (a.cand, b.cand), (a.score, b.score)))


def heap_mismatches(out, tok, lp, t, n, budget):
    """Requests whose tree differs from specpilot.kernels.tree (float64 heap on the host)."""
    from specpilot.kernels.tree import build_best_first, build_best_first_shared

    B = tok.shape[0]
    tok_h, lp_h = tok.cpu().tolist(), lp.cpu().double().tolist()
    tr_h = t.cpu().double().tolist() if t is not None else None
    bad = 0
    if budget is None:
        for b in range(B):
            e = build_best_first(tok_h[b], lp_h[b], None if tr_h is None else tr_h[b], n)
            g = out.request(b)
            bad += (g.tokens, g.parents, g.depth, g.cand) != (e.tokens, e.parents, e.depth, e.cand)
    else:
        shared = build_best_first_shared([(tok_h[b], lp_h[b], None if tr_h is None else tr_h[b]) for b in range(B)],
                                         budget)
        for b in range(B):
            e, g = shared[b], out.request(b)
            if len(e) > n:  # the engine's shared builder has no per-request cap: compare the capped prefix
                e_key = (e.tokens[:n], e.parents[:n])
            else:
                e_key = (e.tokens, e.parents)
            bad += (g.tokens, g.parents) != e_key
    return bad


def check_row(B, m, K, n, budget, trans, row, kernels=KERNELS):
    """Exactness of each kernel, before timing: vs the torch reference (plain and tied lattices)
    and vs the engine's heap."""
    import torch

    bud = None if budget is None else torch.tensor(budget, device="cuda")
    for tag, quant in (("", None), ("_ties", 4)):
        tok, lp, tr = lattice(B, m, K, 1234 + B + n, "cuda", quant)
        t = tr if trans else None
        ref = build("torch", tok, lp, t, n, bud)
        if not tag:
            row["torch_mismatch_requests"] = heap_mismatches(ref, tok, lp, t, n, budget)
        for k in kernels:
            try:
                out = build(k, tok, lp, t, n, bud)
                torch.cuda.synchronize()
                row[f"{k}_equals_reference{tag}"] = same_trees(out, ref)
                if not tag:
                    row[f"{k}_mismatch_requests"] = heap_mismatches(out, tok, lp, t, n, budget)
            except Exception as e:
                row[f"{k}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                row[f"{k}_equals_reference{tag}"] = False
                traceback.print_exc()
    return all(row.get(f"{k}_equals_reference{tag}") for k in kernels for tag in ("", "_ties"))


def graph_us(fn, reps=200, flush=None):
    return capture_and_time(fn, reps=reps, warmup=10, flush=flush)


def bench_row(B, m, K, n, budget, trans, flush, kernels=KERNELS):
    import torch

    from specpilot.kernels.tree.batched import alloc

    row = {"requests": B, "positions": m, "candidates": K, "nodes_per_request": n,
           "shared_budget": budget, "scores": "parent-conditioned" if trans else "marginal"}
    row["exact"] = check_row(B, m, K, n, budget, trans, row, kernels)
    tok, lp, tr = lattice(B, m, K, 7 + B, "cuda")
    t = tr if trans else None
    bud = None if budget is None else torch.tensor(budget, device="cuda")
    for name in kernels + ("torch",):
        try:
            out = alloc(B, n, "cuda")
            fn = lambda: build(name, tok, lp, t, n, bud, out=out)  # noqa: E731
            us, g = graph_us(fn)
            row[f"{name}_graph_us"] = round(us, 2)
            row[f"{name}_graph_us_l2_flushed"] = round(graph_us(fn, flush=flush)[0], 2)
            if name != "torch":   # the graph replays to the eager answer
                eager = build(name, tok, lp, t, n, bud)
                out.count.zero_()
                g.replay()
                torch.cuda.synchronize()
                row[f"{name}_graph_equals_eager"] = same_trees(out, eager)
        except Exception as e:  # keep the other rows
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
    # the engine's host heap over the same batch (what a Python scheduler would pay)
    from specpilot.kernels.tree import build_best_first, build_best_first_shared

    tok_h, lp_h = tok.cpu().tolist(), lp.cpu().tolist()
    tr_h = tr.cpu().tolist() if trans else None
    t0 = time.perf_counter()
    for _ in range(3):
        if budget is None:
            for b in range(B):
                build_best_first(tok_h[b], lp_h[b], None if tr_h is None else tr_h[b], n)
        else:
            build_best_first_shared([(tok_h[b], lp_h[b], None if tr_h is None else tr_h[b]) for b in range(B)], budget)
    row["host_heap_us"] = round((time.perf_counter() - t0) / 3 * 1e6, 1)
    return row


def aa_timing(flush, kernels=KERNELS, bases=BASES):
    """Real paired timings of GPU kernels judged by the compare rule: A/A (frontier vs itself) must
    not be approved; frontier vs each of ``bases`` (name -> label) is a real difference."""
    import torch

    from specpilot.auditors.timing import Sample, judge
    from specpilot.kernels.tree.batched import alloc

    tok, lp, tr = lattice(32, 16, 16, 99, "cuda")
    graphs, outs = {}, {}          # outs: a graph writes into buffers that must stay alive
    for name in kernels + ("torch",):
        outs[name] = alloc(32, 32, "cuda")
        graphs[name] = graph_us(lambda: build(name, tok, lp, tr, 32, None, out=outs[name]), reps=5)[1]  # noqa: B023

    def sample(name, reps=20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g = graphs[name]
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3 / reps

    def paired(base, cand, seed=0):
        s = []
        for blk in range(8):  # ABBA
            a1, b1, b2, a2 = sample(base), sample(cand), sample(cand), sample(base)
            s += [Sample(2 * blk, blk, a1, b1, "AB"), Sample(2 * blk + 1, blk, a2, b2, "BA")]
        aa = [(x.base, y.base) for x, y in zip(s[::2], s[1::2])]
        return judge(s, higher_is_better=False, aa_pairs=aa, seed=seed)

    rows = []
    for trial in range(20):
        v = paired("frontier", "frontier", seed=trial)
        rows.append({"kind": "A/A frontier vs frontier", "trial": trial, "gain": v.gain, "ci_low": v.ci_low,
                     "noise": v.noise, "approved": v.approved})
    for base, label in bases.items():
        v = paired(base, "frontier")
        rows.append({"kind": f"frontier vs {label}", "trial": 0, "gain": v.gain, "ci_low": v.ci_low,
                     "noise": v.noise, "approved": v.approved})
    return rows


def main():
    import torch

    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 3
    t_start = time.time()
    flush = L2Flusher()
    configs = [
        (32, 16, 16, 32, None, False), (32, 16, 16, 32, None, True),
        (32, 16, 16, 32, 512, True), (32, 16, 16, 32, 1024, True),
        (24, 16, 16, 32, 192, True), (1, 16, 16, 32, None, True), (1, 16, 16, 64, None, True),
        (8, 8, 16, 32, None, False), (64, 16, 16, 32, 1024, True),
    ]
    rows = []
    for c in configs:
        t0 = time.time()
        rows.append(bench_row(*c, flush))
        print(f"{c}: {time.time() - t0:.1f}s exact={rows[-1]['exact']}", file=sys.stderr, flush=True)
    try:
        aa = aa_timing(flush)
    except Exception as e:
        traceback.print_exc()
        aa = [{"error": f"{type(e).__name__}: {e}"}]
    aa_trials = [r for r in aa if r.get("kind", "").startswith("A/A")]
    summary = {"aa_false_approvals": sum(r["approved"] for r in aa_trials), "aa_trials": len(aa_trials),
               "all_rows_exact": all(r["exact"] for r in rows)}
    target = [r for r in rows if (r["requests"], r["positions"], r["candidates"], r["nodes_per_request"])
              == (32, 16, 16, 32)]
    summary["target_rows_frontier_us"] = {f"{r['scores']}, budget {r['shared_budget']}": r.get("frontier_graph_us")
                                          for r in target}
    summary["target_met"] = bool(target) and summary["all_rows_exact"] and all(
        (r.get("frontier_graph_us") or 1e9) <= 50 for r in target)
    summary["wall_s"] = round(time.time() - t_start, 1)
    write_results("tree_builder", rows, extra={
        "aa_timing": aa, "summary": summary, "target": "<= 50 us for 32 requests x 32 nodes from 16 x 16 lattices",
        "notes": "frontier = the kernel (the heap in registers). "
                 "*_equals_reference[_ties]: every kept node (token, parent, depth, candidate, float32 score), "
                 "valid and count identical to the torch reference, on the row's lattice and on a dyadic one "
                 "with exact ties. *_mismatch_requests: requests differing from the engine's float64 heap; with a "
                 "shared budget that heap has no per-request cap, so rows whose budget lets a request exceed "
                 "its cap (budget 1024 = 32 x 32) differ by design there."})
    print_table(rows, ["requests", "positions", "nodes_per_request", "shared_budget", "scores", "exact",
                       "frontier_graph_us", "frontier_graph_us_l2_flushed",
                       "torch_graph_us", "host_heap_us", "frontier_mismatch_requests"])
    print(summary, [r for r in aa if not r.get("kind", "").startswith("A/A")])
    print(environment())
    return 0


if __name__ == "__main__":
    sys.exit(main())
