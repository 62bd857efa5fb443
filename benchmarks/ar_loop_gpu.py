"""The AR decode loop against its own graph step: Llama-3.1-8B shapes, bf16 and W12, each with the
linear and the certified LM head, on the H200.

Random weights (std 0.02), batch 1, a 1000-token prompt, 256 greedy tokens through
``Decoder.generate`` (what ``specpilot run --mode ar`` calls) after the engine's load-time
warm-up; beside it the AR step's CUDA graph replayed back to back (CUDA events, median) in the
same run, and where a repeated 1000-token prefill's time goes (CUDA kernels by name), through the
fused rows path the decoder runs and, as the baseline, through the layer modules. The loop
queues graph replays ahead of the host (``Decoder._ar_pipelined``), so its per-token time should be
the graph step's.

    python benchmarks/ar_loop_gpu.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bootstrap  # noqa: E402

bootstrap()

from common import prefill_profile, print_table, write_results  # noqa: E402

CONTEXT = 1024


def measure(m, weights, head="linear"):
    import torch

    from specpilot.engine.decode import Decoder
    from specpilot.engine.graphs import GraphRunner, time_replays

    m.set_decode("fused")
    m.set_head(head)
    dec = Decoder(m, "ar", runner=GraphRunner(m))
    warm = dec.warm_up()
    V = m.spec.vocab_size
    prompt = [(977 * i + 13) % V for i in range(1000)]
    runs = [dec.generate(prompt, 256), dec.generate(prompt[::-1], 256)]
    g, _ = dec.runner.ar_graph(CONTEXT, 7)
    step = statistics.median(time_replays(g, 100, 5))
    del dec, g
    torch.cuda.empty_cache()
    prof = prefill_profile(m)
    m.set_decode("layers")   # the baseline: the prompt through the layer modules, same process
    base = prefill_profile(m)
    m.set_decode("fused")
    m.set_head("linear")
    tps = [r.decode_tokens_per_second for r in runs]
    return {"weights": weights, "head": head, "warmup_seconds": warm, "loop_tokens_per_s": tps, "graph_step_ms": step,
            "graph_tokens_per_s": 1e3 / step, "loop_over_graph": max(tps) * step / 1e3,
            "first_prefill_ms": runs[0].prefill_seconds * 1e3, "repeat_prefill_ms": prof["wall_ms"],
            "repeat_prefill_layers_ms": base["wall_ms"], "loop_gpu_ms_per_step": runs[1].step_timing()["gpu_ms"],
            "prefill_profile": prof, "prefill_layers_profile": base}


def main() -> int:
    import torch

    from specpilot.engine.model import Transformer
    from specpilot.engine.w12_loader import convert_engine_model
    from specpilot.models import load_model_spec

    torch.set_grad_enabled(False)
    m = Transformer(load_model_spec("llama-3.1-8b"), max_seq=CONTEXT + 512, dtype=torch.bfloat16,
                    device="cuda").init_random_fast(0).eval()
    m.set_attention("fused")
    rows = [measure(m, "bf16"), measure(m, "bf16", "certified")]
    convert_engine_model(m)
    rows += [measure(m, "w12"), measure(m, "w12", "certified")]
    print_table(rows, ["weights", "head", "loop_tokens_per_s", "graph_tokens_per_s", "loop_over_graph", "first_prefill_ms",
                       "repeat_prefill_ms", "repeat_prefill_layers_ms"])
    for r in rows:
        for key in ("prefill_profile", "prefill_layers_profile"):
            p = r[key]
            print(r["weights"], r["head"], key, f"kernels {p['kernel_ms']:.1f} ms in {p['kernels']} launches:",
                  "; ".join(f"{t['name'][:60]} x{t['calls']} {t['ms']:.2f}" for t in p["top"][:8]))
    write_results("ar_loop_gpu", rows, {"model": "llama-3.1-8b", "context": CONTEXT, "prompt_tokens": 1000,
                                        "new_tokens": 256, "method": "Decoder.generate after warm-up; graph step: "
                                        "CUDA graph replays back to back, CUDA events, median of 100"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
