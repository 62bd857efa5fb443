"""Continuous batching on the GPU (the issue's figures: the H200): AR throughput at 1/4/16/32
requests against the byte floor ``specpilot ceiling --batch B`` gives on that GPU, T_step for B
requests x N rows, and a lossless check.

    SPECPILOT_GIT_SHA=<hash> python3 benchmarks/batch_gpu.py [--batches 1,4,16,32] [--rows 1,4,16,32]
        [--loop-batches 1,4,9,16,32]

Llama-3.1-8B shapes with random bf16 weights, context 1024 per request (its own cache slot).

* ``step``: one batched step of B requests x N rows, replayed from its CUDA graph (the bucket
  graph the batch decoder replays), CUDA events, median of 30 -- the T_step of ``probe rows --batch B``.
* ``loop``: the batch decoder's own AR decode loop with B requests running in the smallest bucket
  of slots that holds them (9 requests: 16 slots, 7 free; host work, the
  step's host copy and sync included): tokens/s over 64 steps, ``overlap`` on (each step fed on the
  device while the host takes the previous step's tokens, the default) and off (every step's
  inputs from the host after the previous step's tokens), side by side.
* floors: ``ceiling``'s byte floor of one AR step of B requests at that context (the 0.90 x
  bandwidth / 0.60 x FLOP/s rule) on the GPU the run is on (``floors_gpu`` in the results),
  tokens/s at the floor = B / floor.
* admission: ``admit=off|waiting|all`` with 16 requests decoding and a 96-token prompt arriving
  every 4 scheduler iterations: output tokens/s and time to first token, after the decoder's
  load-time warm-up (``BatchDecoder.warm_up``), how many verify steps with a prompt chunk replayed
  a mixed bucket graph, how many ran eagerly (several prompts' rows in them) at what wall time each,
  and how many prefill passes of one prompt chunk replayed a captured mixed bucket.
* lossless: a 4-layer random Llama folder (bf16, CUDA): single-request AR outputs against batched
  AR and batched tree outputs (``run --batch 8``), token agreement, and ``specpilot audit`` of the
  batched outputs against single-request AR (exit 0 = pass).

Writes results/batch_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from common import bootstrap, floors_gpu, parse_int_list, print_table, write_results  # noqa: E402
from serve_bench import specpilot_cmd  # noqa: E402

bootstrap()

CONTEXT = 1024


def _floor(batch: int, rows: int) -> float:
    from specpilot.models import load_model_spec
    from specpilot.probes.floors import step_floor

    return step_floor(load_model_spec("llama-3.1-8b"), floors_gpu(), rows, batch=batch,
                      context=CONTEXT).total_floor_ms


def steps(batches, rows):
    import torch

    from specpilot.engine.api import load_target
    from specpilot.engine.batch.probe import measure_rows_batched
    from specpilot.engine.spec import EngineSpec

    spec = EngineSpec.parse(f"engine:model=llama-3.1-8b,random=1,device=cuda,ctx={CONTEXT + max(256, max(rows) + 64)}")
    target = load_target(spec)
    out = []
    for B in batches:
        res = measure_rows_batched(target.model, B, rows, CONTEXT, reps=30, warmup=5)
        for p in res.points:
            fl = _floor(B, p["rows"])
            out.append({"kind": "step", "batch": B, "rows": p["rows"], "step_ms": p["step_ms"], "c": p["c"],
                        "floor_ms": fl, "of_floor": fl / p["step_ms"],
                        "tokens_per_s": B * 1e3 / p["step_ms"] if p["rows"] == 1 else None,
                        "floor_tokens_per_s": B * 1e3 / fl if p["rows"] == 1 else None})
            print(f"step B={B} N={p['rows']}: {p['step_ms']:.3f} ms, floor {fl:.3f} ms ({fl / p['step_ms']:.1%})",
                  flush=True)
        torch.cuda.empty_cache()
    return target, out


def loop(target, batches, n_steps=64):
    import torch

    from specpilot.engine.batch.graphs import bucket
    from specpilot.engine.batch.requests import Request
    from specpilot.engine.batch.scheduler import BatchDecoder

    m = target.model
    out = []
    gen = torch.Generator().manual_seed(0)
    for B in batches:
        prompts = [torch.randint(0, m.spec.vocab_size, (CONTEXT,), generator=gen).tolist() for _ in range(B)]
        # B requests in the smallest bucket that holds them (its other slots free), as serve runs
        # them; a count between buckets also in a decoder of exactly B slots (`run --batch B`)
        runs = [(bucket(B, 256), True), (bucket(B, 256), False)] + ([(B, True)] if bucket(B, 256) != B else [])
        for slots, overlap in runs:
            dec = BatchDecoder(m, "ar", None, batch=slots, graphs=True, prefill_chunk=1024, overlap=overlap)
            for b, ids in enumerate(prompts):
                dec.submit(Request(ids, n_steps + 40, id=b))
            while any(r.prefilled < len(r.prompt_ids) or not r.full for r in dec.running) or dec.waiting:
                dec.step()
            for _ in range(8):    # capture the bucket, warm up
                dec.step()
            torch.cuda.synchronize()
            tokens, t0 = dec.stats.tokens, time.perf_counter()
            for _ in range(n_steps):
                dec.step()
            dec.drain()           # the step in flight: its tokens count, its time too
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            tokens = dec.stats.tokens - tokens
            fl = _floor(B, 1)
            tps = tokens / dt
            out.append({"kind": "loop", "batch": B, "slots": slots, "rows": 1, "overlap": overlap, "tokens": tokens,
                        "step_ms": dt / (tokens / B) * 1e3, "tokens_per_s": tps, "floor_ms": fl,
                        "floor_tokens_per_s": B * 1e3 / fl, "of_floor": tps / (B * 1e3 / fl)})
            print(f"loop B={B} slots={slots} overlap={overlap}: {tps:.1f} tokens/s "
                  f"({out[-1]['of_floor']:.1%} of the floor)", flush=True)
            del dec
            torch.cuda.empty_cache()
    return out


def admission(target, n_requests=48, batch=16, prompt_len=96, max_new=64) -> list[dict]:
    """Prompt admission off / waiting / all: ``batch`` requests decoding AR, a new prompt every 4
    scheduler iterations; output tokens/s and time to first token from submission."""
    import torch

    from specpilot.engine.batch.requests import Request
    from specpilot.engine.batch.scheduler import BatchDecoder

    m = target.model
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, m.spec.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(n_requests)]
    out, ref = [], None
    for admit in ("off", "waiting", "all"):
        dec = BatchDecoder(m, "ar", None, batch=batch, graphs=True, admit=admit, admit_rows=128)
        warm = dec.warm_up()          # what the engine runs at load: compile, capture
        reqs = [Request(p, max_new, id=i, arrival_step=0 if i < batch else 4 * (i - batch + 1))
                for i, p in enumerate(prompts)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = dec.generate_many(reqs)
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        outs = [r.output_ids for r in res]
        ref = ref or outs
        ttft = sorted(r.t_first - r.t_arrival for r in reqs)
        st = dec.stats
        out.append({"kind": "admit", "admit": admit, "batch": batch, "requests": n_requests, "seconds": secs,
                    "tokens_per_s": sum(len(o) for o in outs) / secs, "ttft_p50_ms": statistics.median(ttft) * 1e3,
                    "ttft_p90_ms": ttft[int(len(ttft) * 0.9)] * 1e3, "prefill_passes": st.prefill_passes,
                    "admitted_prompt_rows": st.admitted_prompt_rows, "verify_steps": st.verify_steps,
                    "eager_steps": st.eager_steps, "mixed_steps": st.mixed_steps,
                    "prefill_replays": st.prefill_replays,
                    "eager_step_ms": st.eager_seconds / st.eager_steps * 1e3 if st.eager_steps else None,
                    "same_outputs_as_off": outs == ref,
                    "warmup_s": warm})
        print(f"admit={admit}: {out[-1]['tokens_per_s']:.1f} tokens/s, TTFT p50 {out[-1]['ttft_p50_ms']:.1f} ms",
              flush=True)
        del dec
        torch.cuda.empty_cache()
    return out


def lossless(tmp: Path) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp / "llama-small"
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096,
                      tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(folder))
    gen = torch.Generator().manual_seed(1)
    prompts = tmp / "prompts.jsonl"
    with prompts.open("w") as f:
        for i in range(16):
            ids = torch.randint(0, 32000, (16 + 8 * (i % 4),), generator=gen).tolist()
            f.write(json.dumps({"schema": "specpilot.prompts/1", "id": f"p{i}", "prompt_ids": ids * 2}) + "\n")
    cli = specpilot_cmd()
    env = dict(os.environ)
    common = ["--model", str(folder), "--device", "cuda", "--prompts", str(prompts), "--max-new-tokens", "64"]
    runs = {"ar": ["--mode", "ar"], "batch_ar": ["--mode", "ar", "--batch", "8"],
            "batch_tree": ["--mode", "tree", "--drafter", "self", "--draft-layers", "1", "--nodes", "8",
                           "--batch", "8"]}
    outs = {}
    for name, args in runs.items():
        path = tmp / f"{name}.jsonl"
        subprocess.run(cli + ["run", *common, *args, "--outputs-out", str(path)], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        outs[name] = [json.loads(x)["output_ids"] for x in path.read_text().splitlines()]
    agree = {}
    for name in ("batch_ar", "batch_tree"):
        same = sum(a == b for a, b in zip(outs["ar"], outs[name]))
        tok = sum(sum(x == y for x, y in zip(a, b)) for a, b in zip(outs["ar"], outs[name]))
        agree[name] = {"identical_outputs": same, "of": len(outs["ar"]),
                       "token_agreement": tok / sum(len(a) for a in outs["ar"])}
    audit = subprocess.run(cli + ["audit", "check", str(tmp / "batch_ar.jsonl"), str(tmp / "batch_tree.jsonl"),
                                  "--against", str(tmp / "ar.jsonl"), "--scorer", str(folder), "--device", "cuda",
                                  "--delta", "0.25", "--format", "json"], env=env, capture_output=True, text=True)
    verdict = {"exit": audit.returncode}
    try:
        # file names relative to the run's temporary folder (no machine paths in the results)
        verdict["report"] = json.loads(audit.stdout.replace(str(tmp) + "/", ""))
    except json.JSONDecodeError:
        verdict["stderr"] = audit.stderr[-500:]
    print(f"lossless: {agree}; audit exit {audit.returncode}", flush=True)
    return {"agreement": agree, "audit": verdict}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--rows", default="1,4,16,32")
    ap.add_argument("--loop-batches", default="1,4,9,16,32",
                    help="requests in the decode-loop rows, each in the smallest bucket of slots that holds "
                         "them (9: 16 slots, 7 of them free)")
    ap.add_argument("--skip-lossless", action="store_true")
    args = ap.parse_args()
    batches = parse_int_list(args.batches, 1, 256, "batch_gpu: --batches")
    rows = parse_int_list(args.rows, 1, 256, "batch_gpu: --rows")
    loop_batches = parse_int_list(args.loop_batches, 1, 256, "batch_gpu: --loop-batches")
    target, rows_out = steps(batches, rows)
    rows_out += loop(target, loop_batches)
    rows_out += admission(target)
    extra = {"model": "llama-3.1-8b (random bf16)", "context": CONTEXT, "floors_gpu": floors_gpu().name}
    write_results("batch_gpu", rows_out, extra)
    del target
    if not args.skip_lossless:
        with tempfile.TemporaryDirectory() as d:
            extra["lossless"] = lossless(Path(d))
        write_results("batch_gpu", rows_out, extra)
    print_table(rows_out, ["kind", "batch", "rows", "overlap", "step_ms", "tokens_per_s", "floor_ms", "of_floor"])


if __name__ == "__main__":
    main()
