"""Hybrid targets (Qwen3.5-9B shapes: 24 Gated DeltaNet + 8 gated attention layers) on the H200.

Random bf16 weights (std 0.02), batch 1, a 1000-token prompt committed by a real prefill
(context 1024 for the step timings). In one run:

* correctness at the model's shapes: the GDN row kernel against the fp32 torch path reference
  (33 and 64 rows, random trees of depth <= 15), commit replay and verify rows bit-equal to AR steps,
  the WY kernel (when present) within one bf16 ulp of the path kernel, fla's chunked prefill
  against the torch recurrence;
* the AR step as one CUDA graph: the fused decode chain (``decode=fused``) and the layer modules
  (``decode=layers``, the baseline), against ``ceiling``'s byte floor;
* prefill of 1000 tokens after warm-up (fla chunked GDN + the layers), first request and repeat;
* the decode loop (``Decoder.generate``, what ``specpilot run`` calls): AR tokens/s over 256 tokens;
  chain and tree outputs against AR's on these weights; a tree run (32-node trees every step);
* ``probe rows`` (``measure_rows``) for N = 1..64 with the fused AR step as T_AR, written to
  ``$OUT/probe_rows_qwen35_9b_bf16.json``;
* batched verify steps (continuous batching, 4 and 16 requests x 4/8/16 chain rows): the bucket
  CUDA graph against the same step launched eagerly from the host;
* GDN kernel timings over all 24 GDN layers (a CUDA graph of 24 launches on 24 layers' states):
  the path kernel, the WY kernel, the commit (replay of a depth-8 accepted path) and the AR step's
  GDN kernel, against fla's fused recurrent kernel for one token; peak memory of a tree verify.

    python benchmarks/hybrid_gpu.py [--reps 30] [--quick] [--skip-lossless]
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

from common import floors_gpu, kernel_profile, log, prefill_profile, print_table, section, write_results  # noqa: E402

CONTEXT = 1024
MODEL = "qwen3.5-9b"
PROBE_ROWS = [1, 2, 4, 8, 16, 32, 33, 48, 64]
BATCHES = (4, 16)      # requests in a batched step
BATCH_ROWS = [4, 8, 16]  # verify rows per request (chains)
NK, NV, DK, DV = 16, 32, 128, 128


def floor_ms(rows: int) -> float:
    from specpilot.models import load_model_spec
    from specpilot.probes.floors import step_floor

    return step_floor(load_model_spec(MODEL), floors_gpu(), rows, context=CONTEXT).total_floor_ms


def layer_inputs(R, seed):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    C = 2 * NK * DK + NV * DV
    qkv = torch.randn(R, C, generator=g, device="cuda").to(torch.bfloat16)
    ab = torch.randn(R, 2 * NV, generator=g, device="cuda").to(torch.bfloat16)
    A_log = torch.rand(NV, generator=g, device="cuda") * 2.7
    dt_bias = torch.ones(NV, device="cuda", dtype=torch.bfloat16)
    state = torch.randn(NV, DK, DV, generator=g, device="cuda") * 0.1
    return qkv, ab, A_log, dt_bias, state


def wy_module():
    try:
        from specpilot.kernels.gdn import wy
    except ImportError:
        return None
    return wy


def bf16_ulps(x, ref, floor_frac=2.0 ** -12):
    """Largest distance of bf16(x) from bf16(ref) in bf16 ulps of ref, the ulp taken at least at
    ``floor_frac`` of the (row, head)'s largest |ref|: values that cancel to near zero differ by the
    fp32 rounding of their terms, not by ulps of themselves."""
    import torch

    pb, wb = ref.to(torch.bfloat16).double(), x.to(torch.bfloat16).double()
    mag = torch.maximum(pb.abs(), pb.abs().amax(-1, keepdim=True) * floor_frac)
    _, e = torch.frexp(mag.float())
    return float(((wb - pb).abs() / torch.ldexp(torch.ones_like(mag), e.double() - 8)).max())


def kernel_checks():
    import torch
    import torch.nn.functional as F

    from specpilot.kernels.gdn import naive, path as gpath, prefill, rows as grows

    out = {}
    for R in (17, 33, 64):
        qkv, ab, A_log, dt_bias, state = layer_inputs(R, R)
        paths = gpath.row_paths(gpath.random_parents(R, R)).to("cuda")
        o = grows.gdn_rows(qkv, ab, A_log, dt_bias, state, paths, NK)
        q, k, v = qkv.float().split([NK * DK, NK * DK, NV * DV], -1)
        b, a = ab.float().chunk(2, -1)
        g = -A_log.exp() * F.softplus(a + dt_bias.float())
        rep = NV // NK
        prep = naive.prepare(q.view(R, NK, DK).repeat_interleave(rep, 1), k.view(R, NK, DK).repeat_interleave(rep, 1),
                             v.view(R, NV, DV), g, torch.sigmoid(b))
        ref = gpath.path_verify(*prep, state, paths)
        exact = gpath.path_verify(*(t.double() for t in prep), state.double(), paths)   # float64 walk
        row = {"rows": R, "path_vs_fp32_ref_max_abs": float((o.view(R, NV, DV) - ref).abs().max()),
               "ref_max_abs": float(ref.abs().max()), "path_vs_fp64_ulps": bf16_ulps(o.view(R, NV, DV), exact)}
        wy = wy_module()
        if wy is not None:
            ow = wy.wy_verify(qkv[:, :NK * DK].view(R, NK, DK), qkv[:, NK * DK:2 * NK * DK].view(R, NK, DK),
                              qkv[:, 2 * NK * DK:].view(R, NV, DV), g, torch.sigmoid(b), state, paths)
            row["wy_vs_path_max_ulps"] = bf16_ulps(ow, o.view(R, NV, DV))
            row["wy_vs_path_max_ulps_no_floor"] = bf16_ulps(ow, o.view(R, NV, DV), 0.0)
            row["wy_vs_fp64_ulps"] = bf16_ulps(ow, exact)
            row["wy_vs_fp32_ref_max_abs"] = float((ow - ref).abs().max())
        out[f"rows_{R}"] = row
    # commit replay and verify rows against AR steps, bit for bit
    qkv, ab, A_log, dt_bias, state = layer_inputs(17, 5)
    parents = gpath.random_parents(17, 5)
    paths = gpath.row_paths(parents)
    verify = grows.gdn_rows(qkv, ab, A_log, dt_bias, state, paths.to("cuda"), NK)
    acc = [x for x in paths[16].tolist() if x >= 0]
    committed = state.clone()
    grows.gdn_rows(qkv, ab, A_log, dt_bias, committed, torch.tensor([acc], device="cuda"), NK, output=False,
                   new_state=committed)
    seq = state.clone()
    same = True
    for r in acc:
        o = grows.gdn_rows(qkv[r:r + 1], ab[r:r + 1], A_log, dt_bias, seq, None, NK, new_state=seq)
        same = same and torch.equal(o[0], verify[r])
    out["verify_rows_equal_ar_steps"] = bool(same)
    out["commit_equals_sequential"] = bool(torch.equal(committed, seq))
    # fla's chunked prefill against the torch recurrence (Qwen3.5-9B heads, 256 tokens)
    if prefill.available("cuda"):
        T = 256
        gg = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(T, NK, DK, generator=gg, device="cuda").to(torch.bfloat16)
        k = torch.randn(T, NK, DK, generator=gg, device="cuda").to(torch.bfloat16)
        v = torch.randn(T, NV, DV, generator=gg, device="cuda").to(torch.bfloat16)
        gate = -torch.rand(T, NV, generator=gg, device="cuda")
        beta = torch.rand(T, NV, generator=gg, device="cuda")
        s0 = torch.randn(NV, DK, DV, generator=gg, device="cuda") * 0.1
        st = s0.clone()
        o = prefill.chunk_prefill(q, k, v, gate, beta, st)
        prep = naive.prepare(q.repeat_interleave(2, 1), k.repeat_interleave(2, 1), v, gate, beta)
        ref, last = naive.recurrent(*prep, s0, keep_states=False)
        out["fla_prefill"] = {"out_max_abs_diff": float((o - ref).abs().max()), "out_max_abs": float(ref.abs().max()),
                              "state_max_abs_diff": float((st - last[0]).abs().max())}
    else:
        out["fla_prefill"] = "fla-core not installed"
    return out


def fla_baseline_process(reps, tries=2):
    """:func:`fla_baseline` in a child process, tried up to ``tries`` times: an intermittent illegal
    memory access inside fla's kernel (seen in some runs on the H200 with fla-core 0.6.0, never
    under CUDA_LAUNCH_BLOCKING=1) leaves a CUDA context unusable, so it gets one of its own."""
    import subprocess

    err = ""
    for _ in range(tries):
        p = subprocess.run([sys.executable, __file__, "--fla-only", "--reps", str(reps)], capture_output=True,
                           text=True, timeout=300)
        if p.returncode == 0:
            return json.loads(p.stdout.strip().splitlines()[-1])
        err = (p.stderr.strip().splitlines() or ["no output"])[-1]
        log(f"fla baseline: child exited {p.returncode}: {err}")
    raise RuntimeError(f"fla baseline failed {tries} times; last: {err}")


def fla_baseline(reps):
    """fla's fused recurrent kernel for one token over the 24 GDN layers (one CUDA graph), the AR
    GDN kernels' baseline."""
    import torch
    import torch.nn.functional as F
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    pre, st = [], []
    for i in range(24):
        qkv, ab, A_log, dt_bias, state = layer_inputs(1, 200 + i)
        b, a = ab.float().chunk(2, -1)
        pre.append((qkv[:, :NK * DK].reshape(1, 1, NK, DK).contiguous(),
                    qkv[:, NK * DK:2 * NK * DK].reshape(1, 1, NK, DK).contiguous(),
                    qkv[:, 2 * NK * DK:].reshape(1, 1, NV, DV).contiguous(),
                    (-A_log.exp() * F.softplus(a + dt_bias.float())).reshape(1, 1, NV).contiguous(),
                    torch.sigmoid(b).reshape(1, 1, NV).contiguous()))
        st.append(state[None].clone())
    return {"fla_fused_recurrent_us": 1e3 * graph_time(
        lambda: [fused_recurrent_gated_delta_rule(q, k, v, g, b, initial_state=s, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True) for (q, k, v, g, b), s in zip(pre, st)],
        reps)}


def graph_time(fn, reps):
    import torch

    from specpilot.engine.graphs import capture, time_replays

    g, _ = capture(fn, 3)
    t = statistics.median(time_replays(g, reps, 5))
    del g
    return t


def gdn_kernel_times(reps):
    """Per-step time of the GDN kernels over 24 layers (24 launches in one graph, each layer its own
    state and inputs), nodes = rows - 1 of a random tree of depth <= 15."""
    import torch
    import torch.nn.functional as F

    from specpilot.kernels.gdn import path as gpath, rows as grows

    L = 24
    wy = wy_module()
    out = []
    states = [layer_inputs(1, 100 + i)[4] for i in range(L)]
    for nodes in (1, 4, 8, 16, 32, 48, 63):
        R = nodes + 1
        ins = [layer_inputs(R, 7 + i) for i in range(L)]
        paths = gpath.row_paths(gpath.random_parents(R, R)).to("cuda")
        row = {"nodes": nodes, "rows": R, "layers": L}
        row["path_us"] = 1e3 * graph_time(lambda: [grows.gdn_rows(x[0], x[1], x[2], x[3], s, paths, NK)
                                                   for x, s in zip(ins, states)], reps)
        if wy is not None and R <= 64:
            pre = []
            for x in ins:
                b, a = x[1].float().chunk(2, -1)
                pre.append((x[0][:, :NK * DK].view(R, NK, DK), x[0][:, NK * DK:2 * NK * DK].view(R, NK, DK),
                            x[0][:, 2 * NK * DK:].view(R, NV, DV), -x[2].exp() * F.softplus(a + x[3].float()),
                            torch.sigmoid(b)))
            row["wy_us"] = 1e3 * graph_time(lambda: [wy.wy_verify(*p, s, paths) for p, s in zip(pre, states)], reps)
            row["wy_over_path"] = row["wy_us"] / row["path_us"]
        depth_path = [x for x in gpath.row_paths(gpath.random_parents(R, R))[-1].tolist() if x >= 0][:8]
        acc = torch.tensor([depth_path], device="cuda")
        work = [s.clone() for s in states]
        row["commit_depth"] = len(depth_path)
        row["commit_us"] = 1e3 * graph_time(lambda: [grows.gdn_rows(x[0], x[1], x[2], x[3], s, acc, NK, output=False,
                                                                    new_state=s) for x, s in zip(ins, work)], reps)
        out.append(row)
    # the AR step's GDN kernels (one row, state written; the gated norm) against fla's fused
    # recurrent kernel; the row kernel's warps swept for the AR row and a 33-row tree
    ins = [layer_inputs(1, 200 + i) for i in range(L)]
    z = torch.randn(1, NV * DV, device="cuda").to(torch.bfloat16)
    w = torch.ones(DV, device="cuda", dtype=torch.bfloat16)

    def ar_layer(x, s, wp=None):
        o = grows.gdn_rows(x[0], x[1], x[2], x[3], s, None, NK, new_state=s, warps=wp)
        return grows.gated_norm_rows(o.view(1, NV, DV), z, w, 1e-6)

    ar = {"ar_gdn_us": 1e3 * graph_time(lambda: [ar_layer(x, s) for x, s in zip(ins, states)], reps),
          "default_warps": grows.default_warps(DK, DV)}
    ins33 = [layer_inputs(33, 300 + i) for i in range(L)]
    p33 = gpath.row_paths(gpath.random_parents(33, 33)).to("cuda")
    for wp in (2, 4, 8):
        ar[f"ar_gdn_us_w{wp}"] = 1e3 * graph_time(lambda: [ar_layer(x, s, wp) for x, s in zip(ins, states)], reps)
        ar[f"tree33_path_us_w{wp}"] = 1e3 * graph_time(
            lambda: [grows.gdn_rows(x[0], x[1], x[2], x[3], s, p33, NK, warps=wp) for x, s in zip(ins33, states)], reps)
    return out, ar


def build():
    from verify_step import build as prefilled

    return prefilled(MODEL)


def ar_steps(m, reps):
    """The AR step's CUDA graph, fused and layers, against the floor (the GDN states are kept)."""
    import torch

    from specpilot.engine.graphs import GraphRunner, time_replays

    out = []
    for path in ("fused", "layers"):
        m.set_decode(path)
        runner = GraphRunner(m)
        g, _ = runner.ar_graph(CONTEXT, 7)
        saved = [t.clone() for x in m.gdn_layers() for t in (x.state, x.conv_state)]
        t = statistics.median(time_replays(g, reps, 5))
        for d, s in zip([t for x in m.gdn_layers() for t in (x.state, x.conv_state)], saved):
            d.copy_(s)
        fl = floor_ms(1)
        out.append({"what": "ar_step", "path": path, "step_ms": t, "floor_ms": fl, "of_floor": fl / t,
                    "tokens_per_s_at_step": 1e3 / t})
        del runner, g
        torch.cuda.empty_cache()
    m.set_decode("fused")
    return out


def ar_consistency(m):
    """The fused AR step against the layers on the same state: logits difference, argmax."""
    import torch

    from specpilot.engine.step_input import StepInput

    one = StepInput(torch.tensor([11], device="cuda"), torch.tensor([CONTEXT], device="cuda"),
                    torch.tensor([CONTEXT], device="cuda"), torch.arange(m.max_seq, device="cuda")[None] <= CONTEXT, "seq")
    saved = [t.clone() for x in m.gdn_layers() for t in (x.state, x.conv_state)]

    def restore():
        for d, s in zip([t for x in m.gdn_layers() for t in (x.state, x.conv_state)], saved):
            d.copy_(s)

    m.set_decode("layers")
    ref = m.forward(one, kv_len=m.max_seq).float()
    restore()
    m.set_decode("fused")
    got = m.forward(one, kv_len=m.max_seq).float()
    restore()
    return {"logits_max_abs_diff": float((got - ref).abs().max()), "logits_max_abs": float(ref.abs().max()),
            "argmax_equal": bool(got.argmax() == ref.argmax())}


def verify_graph(m, T):
    """(runner, graph) of the engine's ``T``-row verify step (chain rows after the context), its
    static inputs filled (keep the runner while replaying: it owns the graph's buffers)."""
    from specpilot.engine.graphs import GraphRunner
    from specpilot.engine.rows import step_input

    inp = step_input(m, T, CONTEXT)
    runner = GraphRunner(m)
    gr, sinp, _ = runner.get(T)
    for a, b in ((sinp.tokens, inp.tokens), (sinp.pos, inp.pos), (sinp.slots, inp.slots), (sinp.mask, inp.mask)):
        a.copy_(b)
    return runner, gr


def verify_methods(m, reps):
    """T_step(N) of the engine's verify graph with every GDN layer on the path kernel and on WY."""
    import torch

    from specpilot.engine.graphs import time_replays

    m.set_decode("fused")
    out = []
    for T in (9, 17, 33, 64):
        row = {"what": "verify_method", "rows": T}
        for method in ("path", "wy"):
            for g in m.gdn_layers():
                g.verify = method
            runner, gr = verify_graph(m, T)
            row[f"{method}_step_ms"] = statistics.median(time_replays(gr, reps, 5))
            del runner, gr
            torch.cuda.empty_cache()
        out.append(row)
    for g in m.gdn_layers():
        g.verify = "auto"
    return out


def probe_json(m, reps):
    from specpilot.engine.rows import measure_rows

    m.set_decode("fused")
    res = measure_rows(m, PROBE_ROWS, CONTEXT, reps=reps, warmup=5)
    res.model = MODEL
    res.extra.update({"w12": None, "attn": "fused", "head": "linear", "decode": "fused"})
    doc = res.to_json()
    out = os.environ.get("OUT")
    if out:
        Path(out, "probe_rows_qwen35_9b_bf16.json").write_text(json.dumps(doc, indent=1) + "\n")
    return [{"what": "probe_rows", "rows": p["rows"], "step_ms": p["step_ms"], "c": p["c"], "path": p["path"],
             "floor_c": floor_ms(p["rows"]) / floor_ms(1)} for p in doc["points"]]


def batched_steps(m, reps):
    """Batched verify steps of B requests x N chain rows at CONTEXT each: the bucket graph the batch
    decoder replays (every row's GDN path walked from its static path table) against the eager
    step it ran before graphs covered hybrid verify steps (the same kernels, launched from the host)."""
    from specpilot.engine.batch.probe import measure_rows_batched

    m.set_decode("fused")
    out = []
    for B in BATCHES:
        got = {g: measure_rows_batched(m, B, BATCH_ROWS, CONTEXT, reps=reps, warmup=5, graphs=g) for g in (True, False)}
        for pg, pe in zip(got[True].points, got[False].points):
            out.append({"what": "batched_step", "batch": B, "rows": pg["rows"], "graph_ms": pg["step_ms"],
                        "eager_ms": pe["step_ms"], "graph_c": pg["c"],
                        "eager_over_graph": pe["step_ms"] / pg["step_ms"], "method": got[True].method})
    return out


def logit_gap(m, context, tok_a, tok_b):
    """Logits of two candidate next tokens after ``context`` (one prefill through the layers, bf16),
    and the top logit's lead over the runner-up."""
    import torch

    from specpilot.engine.step_input import StepInput

    m.reset()
    n = len(context)
    pos = torch.arange(n, device="cuda")
    inp = StepInput(torch.tensor(context, device="cuda"), pos, pos,
                    torch.arange(m.max_seq, device="cuda")[None] <= pos[:, None], "seq")
    logits = m.forward(inp, kv_len=m.max_seq)[-1].float()
    top = logits.topk(2).values
    return {"logit_ar_token": float(logits[tok_a]), "logit_other_token": float(logits[tok_b]),
            "top2_gap": float(top[0] - top[1])}


def decode_loop(m, quick):
    """Decoder.generate after warm-up: first/second prefill, AR tokens/s, chain/tree = AR, a tree run."""
    import torch

    from specpilot.engine.decode import Decoder
    from specpilot.engine.graphs import GraphRunner

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from verify_step import FixedDrafter

    m.set_decode("fused")
    res = {}
    dec = Decoder(m, "ar", runner=GraphRunner(m))
    res["warmup_seconds"] = dec.warm_up()
    V = m.spec.vocab_size
    prompt = [(977 * i + 13) % V for i in range(1000)]
    n_new = 64 if quick else 256
    first = dec.generate(prompt, n_new)
    second = dec.generate(prompt[::-1], n_new)
    res.update({"first_prefill_ms": first.prefill_seconds * 1e3, "second_prefill_ms": second.prefill_seconds * 1e3,
                "ar_decode_tokens_per_s": [first.decode_tokens_per_second, second.decode_tokens_per_second],
                "ar_step_timing": second.step_timing()})
    ar_ids = first.output_ids
    del dec
    torch.cuda.empty_cache()
    from specpilot.engine.drafters import NGramDrafter

    res["lossless"] = {}
    for mode in ("chain", "tree"):
        d = Decoder(m, mode, NGramDrafter(), nodes=32, depth=8, topk=4, runner=GraphRunner(m))
        d.warm_up()
        r = d.generate(prompt, n_new)
        i = next((i for i, (a, b) in enumerate(zip(r.output_ids, ar_ids)) if a != b), None)
        res["lossless"][mode] = {"equal_ar": r.output_ids == ar_ids, "steps": r.steps, "tau": r.tau,
                                 "first_mismatch": i}
        if i is not None:   # how close the two tokens were: the logits of both after the common prefix
            res["lossless"][mode]["at_mismatch"] = logit_gap(m, prompt + ar_ids[:i], ar_ids[i], r.output_ids[i])
        del d
        torch.cuda.empty_cache()
    tree = Decoder(m, "tree", FixedDrafter(V), nodes=32, depth=8, topk=4, runner=GraphRunner(m))
    tree.warm_up()
    r = tree.generate(prompt, 32 if quick else 96)
    res["tree_fixed_drafter"] = {"steps": r.steps, "tau": r.tau, "decode_tokens_per_s": r.decode_tokens_per_second,
                                 "timing": r.step_timing()}
    del tree
    torch.cuda.empty_cache()
    return res


def tree_memory(m):
    """Peak memory of a 33-row tree verify graph replay above the model's resident memory."""
    import torch

    from specpilot.engine.graphs import GraphRunner

    runner = GraphRunner(m)
    runner.get(33)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    from specpilot.engine.decode import Decoder
    from specpilot.kernels import tree as treelib

    toks = [[(i * 7 + j) % 1000 for j in range(4)] for i in range(8)]
    lp = [[-0.5 * (j + 1)] * 4 for j in range(8)]
    dec = Decoder(m, "tree", drafter=object(), nodes=32, depth=8, runner=runner)
    dec._graph_verify(7, treelib.build_best_first(toks, lp, None, 32), CONTEXT)
    torch.cuda.synchronize()
    snapshots_would_be = 33 * NV * DK * DV * 4 * 24
    return {"rows": 33, "peak_above_resident_bytes": torch.cuda.max_memory_allocated() - base,
            "graph_pool_note": "the verify graph's working memory is its private pool, allocated at capture",
            "per_node_snapshots_would_be_bytes": snapshots_would_be}


def verify_profile(m, T=33):
    """Where the time of a ``T``-row tree verify step (its CUDA graph, one replay) goes, beside the
    graph's median step time: the difference is the gaps between kernels."""
    from specpilot.engine.graphs import time_replays

    m.set_decode("fused")
    runner, gr = verify_graph(m, T)
    step = statistics.median(time_replays(gr, 20, 5))
    prof = kernel_profile(gr.replay, top=20)
    del runner, gr
    return {"rows": T, "step_ms": step, **prof}


def tiny_lossless():
    from specpilot.engine.api import load_engine

    prompt = list(b"abcabcabc hello hello abcabc")
    base = "engine:model=tiny-hybrid,dtype=float32,device=cuda,ctx=512"
    e = load_engine(base + ",mode=ar")
    ar = e.generate(prompt, 48).output_ids
    out = {"ar_decode": e.info["decode"], "ar_graphs": e.decoder.runner is not None}
    for mode in ("chain", "tree"):
        r = load_engine(base + f",mode={mode}").generate(prompt, 48)
        out[mode] = {"equal_ar": r.output_ids == ar, "steps": r.steps}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and tokens (a smoke run)")
    ap.add_argument("--skip-lossless", action="store_true",
                    help="skip the tiny-hybrid fp32 lossless section (about two minutes; the GPU tests cover it)")
    ap.add_argument("--fla-only", action="store_true", help=argparse.SUPPRESS)   # fla_baseline_process's child
    args = ap.parse_args()
    import torch

    if args.fla_only:
        print(json.dumps(fla_baseline(args.reps)))
        return 0

    torch.set_grad_enabled(False)
    errors: list[str] = []
    extra: dict = {"model": MODEL, "context": CONTEXT, "dtype": "bfloat16", "weights": "random, std 0.02",
                   "method": f"CUDA graph replays, CUDA events, median of {args.reps}"}
    extra["tiny_hybrid_fp32_lossless"] = "skipped" if args.skip_lossless else section("tiny lossless", tiny_lossless,
                                                                                        errors)
    extra["kernel_checks"] = section("kernel checks", kernel_checks, errors)
    gk = section("gdn kernel times", lambda: gdn_kernel_times(args.reps), errors)
    if gk:
        extra["gdn_kernels"], extra["ar_gdn_kernel"] = gk
    m = section("build", build, errors)
    rows: list[dict] = []
    if m is not None:
        extra["ar_consistency"] = section("ar consistency", lambda: ar_consistency(m), errors)
        rows += section("ar steps", lambda: ar_steps(m, args.reps), errors) or []
        rows += section("verify methods", lambda: verify_methods(m, args.reps), errors) or []
        rows += section("probe rows", lambda: probe_json(m, args.reps), errors) or []
        rows += section("batched steps", lambda: batched_steps(m, args.reps), errors) or []
        extra["tree_memory"] = section("tree memory", lambda: tree_memory(m), errors)
        extra["prefill_profile"] = section("prefill profile", lambda: prefill_profile(m), errors)
        extra["verify_profile"] = section("verify profile", lambda: verify_profile(m), errors)
        extra["loop"] = section("decode loop", lambda: decode_loop(m, args.quick), errors)
    fla = section("fla baseline", lambda: fla_baseline_process(args.reps), errors)
    if fla and extra.get("ar_gdn_kernel"):
        extra["ar_gdn_kernel"].update(fla)
    extra["errors"] = errors
    print_table([r for r in rows if r["what"] == "ar_step"], ["path", "step_ms", "floor_ms", "of_floor"])
    print_table([r for r in rows if r["what"] == "probe_rows"], ["rows", "step_ms", "c", "floor_c", "path"])
    print_table([r for r in rows if r["what"] == "verify_method"], ["rows", "path_step_ms", "wy_step_ms"])
    print_table([r for r in rows if r["what"] == "batched_step"], ["batch", "rows", "graph_ms", "eager_ms", "graph_c"])
    print_table(extra.get("gdn_kernels") or [], ["nodes", "path_us", "wy_us", "wy_over_path", "commit_us"])
    print(json.dumps({k: extra.get(k) for k in ("ar_gdn_kernel", "kernel_checks", "ar_consistency", "tree_memory",
                                                "prefill_profile", "verify_profile",
                                                "tiny_hybrid_fp32_lossless", "errors")}, indent=1, default=str)[:5000])
    loop = extra.get("loop") or {}
    print(json.dumps({k: loop.get(k) for k in ("warmup_seconds", "first_prefill_ms", "second_prefill_ms",
                                               "ar_decode_tokens_per_s", "lossless", "tree_fixed_drafter")},
                     indent=1, default=str)[:4000])
    write_results("hybrid_gpu", rows, extra)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
