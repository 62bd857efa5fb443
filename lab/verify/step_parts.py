"""What each part of a step costs inside the whole step: the step's CUDA graph timed as it is and
with one part taken out or swapped, so PDL overlap and launch gaps are counted where they fall
(per-kernel profiler durations overlap under programmatic dependent launch).

Variants (each captured afresh, interleaved over rounds, median of the replays):

* ``product``: the step as the engine runs it;
* ``no-merge``: the attention's split pass only (its merge kernel not launched; output garbage);
* ``no-attn``: no attention kernels at all (the o projection reads q; in batched AR steps whose
  attention does RoPE and the K/V write, those too);
* ``no-rows``: no small row kernels (RoPE/K/V write, residual + RMSNorm, silu*up) in multi-row steps;
  ``no-norm``, ``no-silu``, ``no-rope``: only that one of them left out;
* ``ring-trigger:<layers>:<0|1>``: the ``ring`` entries of the Llama layers named (as for
  ``skinny:``) with ``RingConfig.trigger`` set to 0 or 1;
* ``w12-pdl:<on|off>`` (with ``--w12``): every W12 tensor-core GEMM (``mma`` and ``warpk``)
  launched under PDL or plainly; ``w12-pdl-skip:<layers>``: the ``mma`` kernel of the Llama layers
  named launched plainly, the rest as the table says;
* ``no-ring``: the table's ``ring`` entries left out (those layers on the kernel they would take
  without them);
* ``ring:<layers>:<block_n>:<stages>:<kboxes>:<trigger>``: the Llama layers named (as for
  ``skinny:``) on the TMA-ring GEMM with that ``RingConfig`` at every row count it takes (1-64; one
  request's steps of up to 8 rows stay on the warp-K GEMM), the table elsewhere;
* ``skinny``: every dense projection of a multi-row step through the skinny GEMM
  (``kernels/verify/skinny.py``, about two programs per SM), cuBLAS nowhere;
* ``attn:<walk>:<target>:<stages>[:<merge>[:<block_n>]]``: the attention with another
  ``SplitConfig`` for every step (walk ``live`` or ``checked``, program target a number or ``table``
  for the measured entry, merge ``kernel`` or ``last``, ``table`` or left out: the measured entry's;
  cache slots per tile, ``table`` or left out: the entry's);
* ``attn-pf:<tiles>``: the attention asking L2 for up to ``tiles`` of each program's first K/V tiles
  before its PDL wait (``SplitConfig.prefetch``) in every step;
* ``attn-bm:<rows>``: the attention with at most ``rows`` query rows per program (a power of two);
* ``attn-tail:<0|1>``: the live walk with or without the checked walk above the rows' highest
  slot (``SplitConfig.tail``; with ``--cache`` above the context, the tiles it checks);
* ``attn-rope:<0|1>``: batched steps of one row per request with RoPE and the K/V write in the
  attention's split pass (``SplitConfig.rope``) or in a kernel of their own;
* ``warpk:<max rows>[@<layers>][:<bound>=<depth>...]``: every dense projection (or the Llama layers
  named, as for ``skinny:``) of a step of up to ``max rows`` rows through the bf16 warp-K GEMM
  (``kernels/verify/warpk.py``), the depth of the smallest row bound that covers the step (default:
  the product's) (``warpk-nopdl:``: the same, launched without PDL;
  ``warpk-late:``: the variant with x loaded late, ``lab/verify/warpk_variants.py``);
* ``warpk-fused:<max rows>``: dense steps of up to ``max rows`` rows (one request's or batched) with the row
  norms, residual adds and ``silu * up`` fused into the warp-K GEMMs (``lab/verify/warpk_fused.py``,
  seven kernels a layer instead of ten);
* ``skinny:<layers>:<mult>:<stages>``: the skinny GEMM for the Llama layers named (``qkv``, ``o``,
  ``gu``, ``down``, joined by ``+``) at every row count, ``mult`` programs per SM along K, the table
  elsewhere;
* ``mlp-ring``: each MLP whose gate/up and down GEMMs both take the ring (the table's rows) as one
  persistent kernel (``lab/verify/ring_mlp.py``: gate/up, ``silu * up`` and down with grid
  barriers between, the down weights streaming through them), the ring config of gate/up;
* ``<variant>&<variant>...``: several of the above at once (e.g. a ring config with an attention
  config).

Cases (``--cases``): one request of 1, 33 and 64 rows and a batched AR step of 16 requests by
default, Llama-3.1-8B shapes, random bf16, context 1024. Outputs of the taken-out variants are
meaningless; only time counts.

    python lab/verify/step_parts.py [--rounds 2] [--variants product,no-attn,...] [--cases 1x1,16x1,...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lab.common import bootstrap, print_table, write_results  # noqa: E402

VARIANTS = ("product", "no-merge", "no-attn", "no-rows", "no-norm", "no-silu", "no-rope", "no-ring", "skinny",
            "mlp-ring")
PREFIXES = ("attn:", "attn-pf:", "attn-bm:", "attn-rope:", "attn-tail:", "skinny:", "warpk:",   # parametrised
            "warpk-nopdl:", "warpk-late:", "warpk-fused:", "ring-trigger:", "ring:", "w12-pdl:", "w12-pdl-skip:")
LLAMA_LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gu": (28672, 4096), "down": (4096, 14336)}   # (n, k)


@contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *a, **k: None


def variant(name: str):
    from specpilot.kernels.attention import decode
    from specpilot.kernels.verify import blas, rows as R
    from specpilot.kernels.verify.skinny import BLOCK_N, BLOCK_K, SkinnyConfig

    stack = ExitStack()
    if "&" in name:   # several variants at once: each part's patch entered in turn
        for part in name.split("&"):
            stack.enter_context(variant(part))
        return stack
    if name.startswith("attn:"):
        from dataclasses import replace

        _, walk, target, stages, *more = name.split(":")
        merge, block_n = (more + ["table"] * 2)[:2]
        table = decode.split_config

        def cfg(*where):   # (device, batched, rows, head_dim, requests)
            c = table(*where)
            return replace(c, live=walk == "live", stages=int(stages),
                           target_programs=c.target_programs if target == "table" else int(target),
                           merge=c.merge if merge == "table" else merge,
                           block_n=c.block_n if block_n == "table" else int(block_n))
        stack.enter_context(patched(decode, "split_config", cfg))
    elif name.startswith(("attn-pf:", "attn-rope:", "attn-tail:")):   # one SplitConfig field over the table's
        from dataclasses import replace

        table = decode.split_config
        prefix, arg = name.split(":")
        # the L2 prefetch before the PDL wait (in tiles); RoPE in the split pass; the checked tail (0/1)
        field, value = {"attn-pf": ("prefetch", int(arg)), "attn-rope": ("rope", arg == "1"),
                        "attn-tail": ("tail", arg == "1")}[prefix]
        stack.enter_context(patched(decode, "split_config", lambda *a: replace(table(*a), **{field: value})))
    elif name.startswith("attn-bm:"):   # the attention's most query rows per program
        stack.enter_context(patched(decode, "MAX_BLOCK_M", int(name.split(":")[1])))
    elif name.startswith("skinny:"):
        import torch

        _, names, mult, stages = name.split(":")
        shapes = {LLAMA_LAYERS[n] for n in names.split("+")}
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        table = blas.skinny_config

        def cfg(device, n, k, rows):
            if (n, k) not in shapes:
                return table(device, n, k, rows)
            return SkinnyConfig(max(1, min(-(-k // BLOCK_K), round(float(mult) * sms / -(-n // BLOCK_N)))),
                                int(stages))
        stack.enter_context(patched(blas, "skinny_config", cfg))
    elif name.startswith("warpk-fused:"):
        from specpilot.engine import fused_verify
        from lab.verify import warpk_fused

        top = int(name.split(":")[1])
        product = fused_verify.hidden_rows

        def hidden_rows(model, x, inp, kv_len, layers=None, cache=None, invariant=False):
            if x.shape[0] <= top and warpk_fused.takes(model, inp, x, cache, invariant):
                return warpk_fused.hidden_rows(model, x, inp, kv_len, layers, cache)
            return product(model, x, inp, kv_len, layers, cache=cache, invariant=invariant)
        stack.enter_context(patched(fused_verify, "hidden_rows", hidden_rows))
    elif name.startswith(("warpk:", "warpk-nopdl:", "warpk-late:")):
        from specpilot.kernels.verify import warpk

        kind, top, *cfgs = name.split(":")
        top, _, only = top.partition("@")   # "@qkv+o": those Llama layers only
        layers = {LLAMA_LAYERS[n] for n in only.split("+")} if only else None
        if kind == "warpk-nopdl":   # plain launches for the warp-K GEMM only
            stack.enter_context(patched(warpk, "pdl_args", lambda on, x: {"PDL": False}))
        if kind == "warpk-late":    # x loaded right before each set's MMAs (lab/verify/warpk_variants.py)
            from lab.verify.warpk_variants import launch as late

            run = lambda h, w, depth: late(h, w, depth, x_late=True)  # noqa: E731
        else:
            run = warpk._launch
        picks = {}   # rows bound -> register sets per warp
        for c in cfgs or [f"32={warpk.DEPTH}"]:
            bound, depth = c.split("=")
            picks[int(bound)] = int(depth)
        plain = blas.linear

        def routed(h, w, batched=False):
            m = h.shape[0]
            if m <= int(top) and warpk.supported(h, w) and (layers is None or tuple(w.shape) in layers):
                return run(h, w, picks[min(b for b in picks if b >= m)])
            return plain(h, w, batched)
        stack.enter_context(patched(blas, "linear", routed))
    elif name.startswith("ring-trigger:"):   # the ring entries of the Llama layers named with trigger 0 or 1
        from dataclasses import replace

        _, names, on = name.split(":")
        shapes = {LLAMA_LAYERS[n] for n in names.split("+")}
        table = blas.ring_config

        def cfg(device, n, k, rows):
            c = table(device, n, k, rows)
            return replace(c, trigger=int(on)) if c is not None and (n, k) in shapes else c
        stack.enter_context(patched(blas, "ring_config", cfg))
    elif name.startswith("ring:"):   # the Llama layers named on the ring at every row count, one config
        from specpilot.kernels.verify import ring

        _, names, *fields = name.split(":")
        shapes = {LLAMA_LAYERS[n] for n in names.split("+")}
        forced = ring.RingConfig(block_n=int(fields[0]), stages=int(fields[1]), kboxes=int(fields[2]),
                                 trigger=int(fields[3]))
        ring.check(forced)
        table = blas.ring_config

        def cfg(device, n, k, rows):
            return forced if (n, k) in shapes and rows <= ring.MAX_ROWS else table(device, n, k, rows)
        stack.enter_context(patched(blas, "ring_config", cfg))
    elif name.startswith(("w12-pdl:", "w12-pdl-skip:")):
        from dataclasses import replace

        from specpilot.kernels.triton_env import pdl_args
        from specpilot.kernels.w12 import mma, warpk

        arg = name.split(":")[1]
        table = mma.default_config
        if name.startswith("w12-pdl:"):   # every W12 tensor-core GEMM with PDL on or off
            on = arg == "on"
            stack.enter_context(patched(warpk, "pdl_args", lambda enabled, x: pdl_args(on, x)))

            def cfg(m, n, k, *a, **kw):
                return replace(table(m, n, k, *a, **kw), pdl=on)
        else:                             # the mma kernel of the Llama layers named launched plainly
            shapes = {LLAMA_LAYERS[n] for n in arg.split("+")}

            def cfg(m, n, k, *a, **kw):
                c = table(m, n, k, *a, **kw)
                return replace(c, pdl=False) if (n, k) in shapes else c
        stack.enter_context(patched(mma, "default_config", cfg))
    elif name == "no-ring":
        stack.enter_context(patched(blas, "ring_config", lambda *a: None))
    elif name == "no-merge":
        stack.enter_context(patched(decode, "_attn_merge", _NoLaunch()))
    elif name == "no-attn":
        def skip(q, *a, **k):
            return q.reshape(q.shape[0], -1)
        stack.enter_context(patched(decode, "masked_gqa_attention", skip))
        stack.enter_context(patched(decode, "batched_gqa_attention", skip))

        def skip_rope(qkv, cos, sin, pos, slots, req, k, v, mask, scale, segs, nh, **kw):   # RoPE + K/V write too
            return qkv[:, : nh * k.shape[-1]]
        stack.enter_context(patched(decode, "rope_batched_gqa_attention", skip_rope))
    elif name in ("no-rows", "no-norm", "no-silu", "no-rope"):
        def rope_store(qkv, cos, sin, pos, slots, kc, vc, nh, nkv, req=None):
            return qkv[:, : nh * (qkv.shape[1] // (nh + 2 * nkv))]
        if name in ("no-rows", "no-rope"):
            stack.enter_context(patched(R, "rope_store_rows", rope_store))
        if name in ("no-rows", "no-norm"):
            stack.enter_context(patched(R, "add_rms_norm_rows", lambda x, d, w, eps, quant=False: (x, d)))
        if name in ("no-rows", "no-silu"):
            stack.enter_context(patched(R, "silu_mul_rows", lambda gu, inter: gu[:, :inter]))
    elif name == "mlp-ring":
        import torch

        from specpilot.engine import fused_verify
        from lab.verify.ring_mlp import mlp_ring

        routed = fused_verify.mlp

        def mlp(h, blk, linear, split=False):
            w13, w2 = getattr(blk.w13, "weight", None), getattr(blk.w2, "weight", None)   # none: W12 modules
            if (isinstance(h, torch.Tensor) and h.shape[0] > 8 and w13 is not None and w2 is not None
                    and getattr(blk.w13, "kp", None) is None and blas.route(h, w13, True) == "ring"
                    and blas.route(h, w2, True) == "ring"):
                return mlp_ring(h, w13, w2, blas.ring_config(h.device, *w13.shape, h.shape[0]))
            return routed(h, blk, linear, split)
        stack.enter_context(patched(fused_verify, "mlp", mlp))
    elif name == "skinny":
        import torch

        sms = torch.cuda.get_device_properties(0).multi_processor_count

        def cfg(device, n, k, rows):
            nb = -(-n // BLOCK_N)
            return SkinnyConfig(max(1, min(-(-k // BLOCK_K), round(2 * sms / nb))), 3)
        stack.enter_context(patched(blas, "skinny_config", cfg))
    return stack


def step_graph(model, B: int, N: int, ctx: int, caches: dict, gen):
    """(runner, graph) of one step of ``B`` requests x ``N`` rows over ``ctx`` committed slots with
    random K/V: one request's ``GraphRunner`` graph (``B == 1``, the model's own caches), else the
    batch decoder's bucket graph over a ``BatchCache`` (kept in ``caches`` for the next call of the
    same ``B``). The runner keeps the graph's buffers alive."""
    from specpilot.engine.batch.graphs import BatchGraphRunner
    from specpilot.engine.batch.probe import chain_rows
    from specpilot.engine.batch.step import assemble
    from specpilot.engine.graphs import GraphRunner
    from specpilot.engine.rows import step_input

    if B == 1:
        runner = GraphRunner(model)
        g, sinp, _ = runner.get(N)
        inp = step_input(model, N, ctx)
        for a in ("tokens", "pos", "slots", "mask"):
            getattr(sinp, a).copy_(getattr(inp, a))
        return runner, g
    if B not in caches:
        caches.clear()
        caches[B] = random_cache(model, B)
    inp, _, _ = assemble(chain_rows(B, N, ctx, model.spec.vocab_size, gen), caches[B].max_seq, model.device,
                         pad=(B, N))
    runner = BatchGraphRunner(model, caches[B])
    runner.run(inp, B, N)
    return runner, runner.graphs[(B, N)][0]


def random_cache(model, slots: int):
    """A batch cache of ``slots`` slots for ``model`` with random K/V in every attention layer."""
    from specpilot.engine.batch.cache import BatchCache

    cache = BatchCache(model, slots)
    for lc in cache.layers:
        for t in (lc.k, lc.v):
            if t is not None:
                t.normal_()
    return cache


def random_target(name: str, ctx: int, w12: bool = False, cache: int | None = None):
    """A random-weight target of ``name`` on CUDA with room for ``ctx`` committed slots (a cache of
    ``cache`` slots, default ``ctx + 128``; ``w12``: its projections in W12), its attention caches
    filled with random K/V."""
    from specpilot.engine.api import load_target
    from specpilot.engine.spec import EngineSpec

    model = load_target(EngineSpec.parse(f"engine:model={name},random=1,device=cuda,ctx={cache or ctx + 128}"
                                         + (",w12=1" if w12 else ""))).model
    for blk in model.layers:
        m = blk.mixer
        if hasattr(m, "k_cache"):
            m.k_cache.normal_()
            m.v_cache.normal_()
    return model


def time_cases(model, cases: list[str], contexts: dict, rounds: int, reps: int = 100,
               skip=lambda case, name: False) -> dict:
    """Median step milliseconds per (case ``BxN``, variant name) -> one value per round: every
    variant's context (``contexts[name]()``, a context manager) entered around each case's capture,
    the variants interleaved within a round; ``skip(case, name)`` leaves a pair out."""
    import torch

    from specpilot.engine.graphs import time_replays

    gen = torch.Generator(device="cpu").manual_seed(0)
    caches: dict = {}
    times: dict = {}
    for rnd in range(rounds):
        for name, ctx in contexts.items():
            for case in cases:
                if skip(case, name):
                    continue
                B, N = (int(x) for x in case.split("x"))
                with ctx():
                    runner, g = step_graph(model, B, N, 1024, caches, gen)
                    times.setdefault((case, name), []).append(statistics.median(time_replays(g, reps, 10)))
                    del runner, g
                torch.cuda.synchronize()
            print(f"round {rnd} {name} done", flush=True)
    return times


def summary(raw: dict, cases: list[str], variants: list[str]) -> list[dict]:
    """:func:`time_cases`' rounds as result rows: per case (``B x N``) and variant the median step
    ms, the rounds and the difference from the ``product`` variant's median."""
    rows = []
    for case in cases:
        label = case.replace("x", " x ")
        base = statistics.median(raw[(case, "product")]) if (case, "product") in raw else None
        for v in variants:
            if (case, v) not in raw:
                continue
            ms = statistics.median(raw[(case, v)])
            rows.append({"case": label, "variant": v, "step_ms": ms, "rounds_ms": raw[(case, v)],
                         "minus_product_ms": None if base is None else ms - base})
    return rows


def main() -> int:
    bootstrap()
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--w12", action="store_true", help="the target's projections in W12")
    ap.add_argument("--cases", default="1x1,1x33,1x64,16x1", help="BxN: B requests of N rows (B=1: one request)")
    ap.add_argument("--cache", type=int, default=None,
                    help="cache slots per request (default: the context, 1024, + 128); the steps attend 1024")
    args = ap.parse_args()
    variants = args.variants.split(",")
    bad = [p for v in variants for p in v.split("&") if p not in VARIANTS and not p.startswith(PREFIXES)]
    if bad:
        raise SystemExit(f"step_parts: unknown variant(s) {bad}; known: {VARIANTS} and {PREFIXES}...")
    import torch

    torch.set_grad_enabled(False)
    model = random_target(args.model, 1024, args.w12, args.cache)
    cases = args.cases.split(",")
    raw = time_cases(model, cases, {v: (lambda v=v: variant(v)) for v in variants}, args.rounds, args.reps,
                     skip=lambda case, v: v in ("no-rows", "skinny") and case == "1x1")
    rows = summary(raw, cases, variants)
    print_table(rows, ["case", "variant", "step_ms", "minus_product_ms"])
    write_results("step_parts", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
