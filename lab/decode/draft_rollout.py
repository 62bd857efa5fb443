"""The self-drafter's rollout, eager against its CUDA graph (engine/draft_graph.py), on Llama-3.1-8B
shapes (random bf16, a 2-layer self-drafter, 8 positions x top-4, a 1000-token context), and a
short TLV run with the graph drafts (its cycle split: draft 1, Q pass, draft 2, exact pass).

    python lab/decode/draft_rollout.py          # on a GPU; writes $OUT/draft_rollout.json
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from pathlib import Path


def main() -> int:
    import torch

    from specpilot.engine.api import load_engine

    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    e = load_engine("engine:model=llama-3.1-8b,random=1,mode=tlv,drafter=self,draft_layers=2,nodes=32,depth=8,"
                    "topk=4,device=cuda,ctx=1200")
    load_s = time.perf_counter() - t0
    dec, dr = e.decoder, e.decoder.drafter
    V = e.model.spec.vocab_size
    rnd = random.Random(0)
    prompt = [rnd.randrange(V) for _ in range(1000)]
    pending = dec.prefill(prompt)
    ctx = prompt + [pending]
    n = len(prompt)

    def timed(reps=20):
        out = []
        for _ in range(reps):
            torch.cuda.synchronize()
            a = time.perf_counter()
            lat = dr.propose(ctx, n, 8, 4)
            out.append((time.perf_counter() - a) * 1e3)
        return statistics.median(out), lat

    graph_ms, g_lat = timed()
    graphs, dr.graphs = dr.graphs, None
    eager_ms, e_lat = timed()
    dr.graphs = graphs
    same = g_lat.tokens == e_lat.tokens
    tlv = dec.generate(prompt, 64)
    res = {"model": "llama-3.1-8b (random bf16)", "gpu": torch.cuda.get_device_name(), "load_s": load_s,
           "draft_layers": 2, "m": 8, "k": 4, "context": n,
           "propose_ms": {"graph": graph_ms, "eager": eager_ms, "speedup": eager_ms / graph_ms},
           "same_top_k_tokens": same, "tlv_cycle_ms": tlv.tlv.get("time_ms"), "tlv_cycle_total_ms": tlv.tlv.get("cycle_ms"),
           "tlv_decode_tokens_per_s": tlv.decode_tokens_per_second}
    print(json.dumps(res, indent=1))
    out = Path(os.environ.get("OUT", "lab/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "draft_rollout.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
