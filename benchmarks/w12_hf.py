"""W12 in a Hugging Face model: greedy AR decode of Llama-3.1-8B, stock bf16 vs ``convert_model``.

    python benchmarks/w12_hf.py            # on the H200 -> results/w12_hf.json (about 2-3 minutes)
    python benchmarks/w12_hf.py --tiny     # a tiny Llama on any device (a dry run of the script)

1. Builds Llama-3.1-8B from the catalog config (``specpilot.models``: rope llama3, GQA 32/8,
   vocab 128256) in transformers with random bf16 weights (std 0.02, norms 1) on the GPU.
2. Copies it and converts the copy with ``specpilot.kernels.w12.module.convert_model`` (every
   projection of every layer, restored bit for bit at conversion; LM head and embeddings stay bf16).
3. Same random prompt (``--context`` tokens) into both, prefilled in chunks of 256 rows (the
   fused kernel's range; no dense fallback), static KV cache (``transformers.StaticCache``).
4. One decode step = model forward on one token + argmax, the argmax written back as the next
   input and the positions advanced *on the device*, captured as one CUDA graph per model
   (falls back to eager steps, labelled, if capture fails).
5. Check first: ``--check-steps`` greedy tokens of both models from their prompt, compared token
   for token (W12's weights are identical; its kernel sums in another fp32 order than cuBLAS, so
   a near-tie may flip: the first mismatch and the stock top-2 margin there are reported).
6. Timing: ``--steps`` graph replays back to back (a greedy loop with no host round trip), CUDA
   events around them, ms per token; ``--rounds`` rounds alternating stock and W12, median.
7. Verify steps (``--verify-rows``, default 8, 16 and 32): one forward of that many draft tokens
   at the positions after the prompt, as a CUDA graph per model and row count, timed the same way
   (ms per step); the rows' argmax agreement and the largest logit difference are reported.

Results rows carry ``variant``, ``step`` (``decode`` or ``verify``), ``rows``, ``ms_per_token`` (decode)
or ``ms_per_step`` (verify), and the stock baseline's numbers (``bf16_ms_per_token`` /
``bf16_ms_per_step``, ``speedup``). On the CPU (``--tiny``) nothing is a GPU measurement: the W12
path there restores the weights and calls ``F.linear`` (docs/w12.md), so it only checks the script.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from common import bootstrap  # noqa: E402

bootstrap()

import torch  # noqa: E402

from common import environment, parse_int_list, print_table, write_results  # noqa: E402

T0 = time.time()
PREFILL_CHUNK = 256  # rows per prefill forward: the fused W12 kernel's range (module.KERNEL_MAX_ROWS)

TINY = dict(model_type="llama", hidden_size=256, intermediate_size=704, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, rms_norm_eps=1e-5,
            rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False,
            rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                          "original_max_position_embeddings": 8192, "rope_type": "llama3"})


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------
def build(cfg_dict: dict, device: str, seed: int, std: float = 0.02):
    import transformers

    cfg_dict = {k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type")}
    cfg = transformers.LlamaConfig(**cfg_dict)
    try:
        cfg._attn_implementation = "sdpa"
    except Exception:
        pass
    with torch.device(device):
        try:
            model = transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
        except TypeError:  # older transformers name it torch_dtype
            model = transformers.LlamaForCausalLM._from_config(cfg, torch_dtype=torch.bfloat16)
    model = model.to(device=device, dtype=torch.bfloat16).eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
    return model


def linear_bytes(model) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head"))


class Decoder:
    """Static-cache greedy decoding of one HF causal LM: chunked prefill, then a one-token step
    that feeds its argmax back and advances the position on the device (graph-capturable)."""

    def __init__(self, model, max_len: int, device: str):
        import transformers

        self.model, self.device, self.max_len = model, device, max_len
        cfg = model.config
        try:
            self.cache = transformers.StaticCache(config=cfg, max_cache_len=max_len)
        except TypeError:  # older signature
            self.cache = transformers.StaticCache(config=cfg, max_batch_size=1, max_cache_len=max_len,
                                                  device=device, dtype=torch.bfloat16)
        params = inspect.signature(type(model.model).forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.use_cache_position = "cache_position" in params
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.cpos = torch.zeros(1, dtype=torch.long, device=device)
        self.logits = None
        self.graph = None
        self.method = "eager"
        self.capture_error = None

    def _forward(self, ids, pos):
        kw = {self.cache_kw: self.cache, "use_cache": True, "position_ids": pos}
        if self.use_cache_position:
            kw["cache_position"] = pos[0]
        return self.model(input_ids=ids, **kw).logits

    def _set_length(self, n: int):
        """Make the cache hold ``n`` tokens (newer transformers keep the length on the device)."""
        for layer in getattr(self.cache, "layers", []):
            cl = getattr(layer, "cumulative_length", None)
            if isinstance(cl, torch.Tensor):
                cl.fill_(n)

    @torch.no_grad()
    def prefill(self, ids: list[int]) -> int:
        t = torch.tensor(ids, device=self.device)[None]
        self._set_length(0)
        for a in range(0, len(ids), PREFILL_CHUNK):
            b = min(len(ids), a + PREFILL_CHUNK)
            logits = self._forward(t[:, a:b], torch.arange(a, b, device=self.device)[None])
        self.n_prompt = len(ids)
        return int(logits[0, -1].argmax())

    def _step(self):
        logits = self._forward(self.tok, self.pos)
        nxt = logits[:, -1].argmax(-1)
        self.tok.copy_(nxt.view(1, 1))
        self.pos.add_(1)
        return logits

    def reset(self, first_token: int):
        """Back to the state right after prefill, with ``first_token`` pending."""
        self.tok.fill_(first_token)
        self.pos.fill_(self.n_prompt)
        self._set_length(self.n_prompt)

    @torch.no_grad()
    def capture(self, first_token: int, graphs: bool):
        self.reset(first_token)
        for _ in range(3):  # warm-up (compiles Triton kernels, sizes workspaces) off the main stream
            self.logits = self._step()
        if graphs:
            self.graph, out, self.method, self.capture_error = capture_graph(self._step, lambda: self.reset(first_token))
            if self.graph is not None:
                self.logits = out
        self.reset(first_token)

    def run_step(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            self.logits = self._step()

    @torch.no_grad()
    def capture_verify(self, tokens: list[int], graphs: bool) -> "VerifyStep":
        """A verify step of ``len(tokens)`` rows: one forward of those tokens at the positions right
        after the prompt (their K/V written to the same cache slots each time), as a CUDA graph
        where ``graphs`` (eager, labelled, if capture fails)."""
        return VerifyStep(self, tokens, graphs)

    @torch.no_grad()
    def greedy(self, first_token: int, steps: int):
        """``steps`` tokens: the prefill's token, then steps-1 decode steps. Returns (tokens, top-2 margins)."""
        self.reset(first_token)
        toks, margins = [first_token], []
        for _ in range(steps - 1):
            self.run_step()
            top = self.logits[0, -1].float().topk(2).values
            margins.append(float(top[0] - top[1]))
            toks.append(int(self.tok[0, 0]))
        return toks, margins

    @torch.no_grad()
    def time_steps(self, first_token: int, steps: int) -> float:
        """ms per token over ``steps`` back-to-back decode steps (CUDA events; wall clock on the CPU)."""
        self.reset(first_token)
        return time_loop(self.run_step, steps, self.device.startswith("cuda"))


class VerifyStep:
    """One speculative verify step in a :class:`Decoder`'s model: ``n`` draft tokens in one forward
    (static cache, positions after the prompt; the cache length reset on the device first, so every
    replay is the same step)."""

    def __init__(self, dec: Decoder, tokens: list[int], graphs: bool):
        self.dec, self.n = dec, len(tokens)
        self.ids = torch.tensor(tokens, dtype=torch.long, device=dec.device)[None]
        self.pos = (dec.n_prompt + torch.arange(self.n, device=dec.device))[None]
        self.graph, self.method, self.capture_error = None, "eager", None
        for _ in range(2):   # warm-up: compiles the kernels for this row count, sizes workspaces
            self.logits = self._step()
        if graphs:
            self.graph, out, self.method, self.capture_error = capture_graph(self._step)
            if self.graph is not None:
                self.logits = out

    def _step(self):
        self.dec._set_length(self.dec.n_prompt)
        return self.dec._forward(self.ids, self.pos)

    @torch.no_grad()
    def run(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            self.logits = self._step()
        return self.logits

    @torch.no_grad()
    def time_ms(self, steps: int) -> float:
        """ms per verify step over ``steps`` back-to-back steps (CUDA events; wall clock on the CPU)."""
        return time_loop(self.run, steps, self.dec.device.startswith("cuda"))


def capture_graph(step, prepare=lambda: None):
    """``step()`` as a CUDA graph: run once on a side stream, then captured, ``prepare()`` before
    each. Returns ``(graph, its output, method, None)``, or ``(None, None, method, error)`` when
    capture fails (the caller keeps running ``step`` eagerly, and says so)."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            prepare()
            step()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        prepare()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = step()
        return g, out, "cuda graph", None
    except Exception as e:  # keep going eagerly, and say so
        torch.cuda.synchronize()
        return None, None, "eager (graph capture failed)", f"{type(e).__name__}: {e}"[:400]


def time_loop(fn, steps: int, cuda: bool) -> float:
    """ms per call of ``fn`` over ``steps`` calls back to back: CUDA events, or the wall clock."""
    if cuda:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(steps):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / steps
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t) * 1e3 / steps


def parse_verify_rows(text: str) -> list[int]:
    """``--verify-rows``: a comma list of row counts 2-64 (the fused kernels' range), or empty."""
    return parse_int_list(text, 2, 64, "w12_hf: --verify-rows") if text.strip() else []


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny Llama (any device; checks the script only)")
    ap.add_argument("--context", type=int, default=None, help="prompt tokens (default 1024; 64 with --tiny)")
    ap.add_argument("--check-steps", type=int, default=32)
    ap.add_argument("--steps", type=int, default=None, help="decode steps per timing round (default 128; 8 tiny)")
    ap.add_argument("--rounds", type=int, default=None, help="timing rounds per model (default 5; 2 tiny)")
    ap.add_argument("--no-graphs", action="store_true", help="eager decode steps (for comparison)")
    ap.add_argument("--verify-rows", default=None,
                    help="also time verify steps of these row counts (comma list, 2-64; default 8,16,32; "
                         "4 with --tiny; empty: none)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None,
                    help="also write the results JSON here (with --tiny the only place it goes, "
                         "besides $OUT: a dry run never replaces benchmarks/results/)")
    args = ap.parse_args()
    verify_rows = parse_verify_rows(args.verify_rows if args.verify_rows is not None
                                    else ("4" if args.tiny else "8,16,32"))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_grad_enabled(False)
    import transformers

    from specpilot.kernels.w12.module import KERNEL_MAX_ROWS, convert_model
    from specpilot.models import load_model_spec

    assert PREFILL_CHUNK <= KERNEL_MAX_ROWS
    env = environment()
    log(f"device {env.get('gpu')} torch {env.get('torch')} transformers {transformers.__version__}")
    if args.tiny:
        name, cfg = "tiny-llama", dict(TINY)
        context, steps, rounds = args.context or 64, args.steps or 8, args.rounds or 2
    else:
        spec = load_model_spec("llama-3.1-8b")
        name, cfg = spec.name, dict(spec.raw)
        context, steps, rounds = args.context or 1024, args.steps or 128, args.rounds or 5
    graphs = device.startswith("cuda") and not args.no_graphs
    check = max(2, args.check_steps)
    max_len = context + max([check, steps] + verify_rows) + 8

    stock = build(cfg, device, args.seed)
    lin_bytes = linear_bytes(stock)
    log(f"built {name}: {sum(p.numel() for p in stock.parameters()) / 1e9:.3f} B params, "
        f"{lin_bytes / 1e9:.2f} GB of projection weights (bf16)")
    w12 = copy.deepcopy(stock)
    t = time.time()
    rep = convert_model(w12)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    convert_s = time.time() - t
    log(f"convert_model: {len(rep.converted)} projections, {rep.bits_per_weight:.4f} bits/weight, "
        f"{rep.w12_bytes / 1e9:.2f} GB, {convert_s:.1f} s (skipped: {', '.join(rep.skipped)})")

    prompt = torch.randint(0, cfg["vocab_size"], (context,), generator=torch.Generator().manual_seed(1)).tolist()
    decs = {}
    firsts = {}
    for label, model in (("bf16", stock), ("w12", w12)):
        d = Decoder(model, max_len, device)
        firsts[label] = d.prefill(prompt)
        d.capture(firsts[label], graphs)
        decs[label] = d
        log(f"{label}: prefill + {d.method}" + (f" ({d.capture_error})" if d.capture_error else ""))

    # 1. correctness: greedy tokens of both models
    toks_s, margins = decs["bf16"].greedy(firsts["bf16"], check)
    toks_w, _ = decs["w12"].greedy(firsts["w12"], check)
    mism = next((i for i, (a, b) in enumerate(zip(toks_s, toks_w)) if a != b), None)
    identical = mism is None
    # the first decode step's logits of both (same input token when the prefill tokens agree)
    decs["bf16"].reset(firsts["bf16"])
    decs["bf16"].run_step()
    l_s = decs["bf16"].logits[0, -1].float().clone()
    decs["w12"].reset(firsts["w12"])
    decs["w12"].run_step()
    l_w = decs["w12"].logits[0, -1].float().clone()
    max_diff = float((l_s - l_w).abs().max())
    scale = float(l_s.abs().max())
    log(f"check: {check} greedy tokens identical: {identical}" +
        ("" if identical else f" (first mismatch at token {mism}; stock top-2 margin there "
                              f"{margins[mism - 1] if mism else float('nan'):.4g})") +
        f"; first-step max |logit diff| {max_diff:.4g} at logit scale {scale:.3g}")

    # 2. timing, rounds alternating
    samples = {"bf16": [], "w12": []}
    for _ in range(rounds):
        for label in ("bf16", "w12"):
            samples[label].append(decs[label].time_steps(firsts[label], steps))
    ms = {k: statistics.median(v) for k, v in samples.items()}
    w_bytes = {"bf16": lin_bytes, "w12": rep.w12_bytes}
    rows = []
    cuda = device.startswith("cuda")
    names = {"bf16": "stock bf16 (cuBLAS F.linear)" if cuda else "stock bf16 (F.linear)",
             "w12": "W12 convert_model (fused Triton kernel)" if cuda else "W12 convert_model (CPU: restored weights)"}
    for label, variant in names.items():
        rows.append({"variant": variant, "step": "decode", "rows": 1, "model": name, "context": context,
                     "steps_per_round": steps,
                     "rounds": rounds, "method": decs[label].method, "ms_per_token": ms[label],
                     "tokens_per_s": 1e3 / ms[label], "samples_ms": samples[label],
                     "bf16_ms_per_token": ms["bf16"], "speedup": ms["bf16"] / ms[label],
                     "projection_weight_GB": w_bytes[label] / 1e9, "capture_error": decs[label].capture_error})

    # 3. verify steps: n draft tokens in one forward, both models, rounds alternating
    vrows = []
    gen = torch.Generator().manual_seed(2)
    for n in verify_rows:
        draft = torch.randint(0, cfg["vocab_size"], (n,), generator=gen).tolist()
        vs = {label: decs[label].capture_verify(draft, graphs) for label in names}
        lv = {label: vs[label].run()[0].float().clone() for label in names}
        same = int((lv["bf16"].argmax(-1) == lv["w12"].argmax(-1)).sum())
        vdiff = float((lv["bf16"] - lv["w12"]).abs().max())
        vsamples = {label: [] for label in names}
        for _ in range(rounds):
            for label in names:
                vsamples[label].append(vs[label].time_ms(steps))
        vms = {k: statistics.median(v) for k, v in vsamples.items()}
        for label, variant in names.items():
            vrows.append({"variant": variant, "step": "verify", "rows": n, "model": name, "context": context,
                          "steps_per_round": steps, "rounds": rounds, "method": vs[label].method,
                          "ms_per_step": vms[label], "samples_ms": vsamples[label], "bf16_ms_per_step": vms["bf16"],
                          "speedup": vms["bf16"] / vms[label], "argmax_rows_equal": same,
                          "max_abs_logit_diff": vdiff, "capture_error": vs[label].capture_error})
        log(f"verify {n} rows: bf16 {vms['bf16']:.3f} ms, w12 {vms['w12']:.3f} ms ({vms['bf16'] / vms['w12']:.3f}x); "
            f"argmax equal on {same}/{n} rows, max |logit diff| {vdiff:.4g}")
        vs = lv = None
    rows += vrows
    extra = {"model": name, "transformers": transformers.__version__, "device": device, "dtype": "bfloat16",
             "batch": 1, "context": context, "weights": "random normal std 0.02 (norms 1), seed %d" % args.seed,
             "converted": len(rep.converted), "bits_per_weight": rep.bits_per_weight, "convert_seconds": convert_s,
             "check_steps": check, "tokens_identical": identical, "first_mismatch": mism,
             "stock_margin_at_mismatch": margins[mism - 1] if mism else None,
             "prefill_tokens_equal": firsts["bf16"] == firsts["w12"],
             "first_step_max_abs_logit_diff": max_diff, "first_step_logit_scale": scale,
             "tokens_bf16": toks_s, "tokens_w12": toks_w,
             "timing": f"{steps} decode steps back to back per round (argmax fed back on the device), "
                       f"{'CUDA events' if device.startswith('cuda') else 'wall clock'}, median of {rounds} "
                       f"rounds alternating the two models",
             "cpu_note": None if device.startswith("cuda") else
             "CPU dry run: W12Linear restores the weights and calls F.linear, nothing here measures W12"}
    if args.tiny:
        import json
        import os

        doc = {"benchmark": "w12_hf_tiny", **env, **extra, "rows": rows}
        for path in filter(None, [args.out, os.environ.get("OUT") and str(Path(os.environ["OUT"]) / "w12_hf_tiny.json")]):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(doc, indent=2) + "\n")
            log(f"wrote {path}")
    else:
        write_results("w12_hf", rows, extra)
        if args.out:
            import shutil

            shutil.copyfile(REPO / "benchmarks" / "results" / "w12_hf.json", args.out)
    print_table(rows[:2], ["variant", "method", "ms_per_token", "tokens_per_s", "speedup", "projection_weight_GB"])
    if vrows:
        print_table(vrows, ["variant", "rows", "method", "ms_per_step", "speedup", "argmax_rows_equal"])
    print(f"greedy tokens identical over {check} steps: {identical}; bits/weight {rep.bits_per_weight:.4f}")
    log("done")


if __name__ == "__main__":
    main()
