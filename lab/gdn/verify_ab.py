"""A/B of the GDN parts of a fused verify step at Qwen3.5-9B shapes (H200), in one process.

The engine's verify-step CUDA graph (``GraphRunner``, chain rows after a 1024-token context) for
``--rows``, interleaved rounds of each variant:

* ``now``: the engine as it is (GDN kernels with PDL, g/beta inside the WY kernel);
* ``no_pdl``: the GDN kernels of the step launched without PDL;
* ``decay_kernel``: g/beta from ``decay_rows`` (a kernel per layer) into ``wy_verify``.

    python lab/gdn/verify_ab.py [--rows 17,32,33,64] [--reps 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from lab.common import bootstrap  # noqa: E402

bootstrap()

from lab.common import parse_int_list, print_table, write_results  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="17,32,33,64")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rows = parse_int_list(args.rows, 1, 64, "verify_ab: --rows")

    import torch

    from hybrid_gpu import CONTEXT, build
    from specpilot.engine import model as M
    from specpilot.engine.graphs import GraphRunner, time_replays
    from specpilot.engine.rows import step_input
    from specpilot.kernels.gdn import rows as grows, wy

    torch.set_grad_enabled(False)
    m = build()
    m.set_decode("fused")
    mix, wy_ab = M.GatedDeltaNet.mix, wy.wy_verify_ab

    def no_pdl(self, proj, inp, pdl=False):
        return mix(self, proj, inp, False)

    def decay_kernel(q, k, v, ab, A_log, dt_bias, state, paths, out=None, nodes=None, config=None, pdl=False):
        g, beta = grows.decay_rows(ab, A_log, dt_bias)
        return wy.wy_verify(q, k, v, g, beta, state, paths, out=out, nodes=nodes, config=config, pdl=pdl)

    variants = {"now": (mix, wy_ab), "no_pdl": (no_pdl, wy_ab), "decay_kernel": (mix, decay_kernel)}
    samples: dict = {}
    for _ in range(args.rounds):
        for name, (mx, wa) in variants.items():
            M.GatedDeltaNet.mix, wy.wy_verify_ab = mx, wa
            for T in [1] + rows:
                inp = step_input(m, T, CONTEXT)
                runner = GraphRunner(m)
                gr, sinp, _ = runner.get(T)
                for a, b in ((sinp.tokens, inp.tokens), (sinp.pos, inp.pos), (sinp.slots, inp.slots), (sinp.mask, inp.mask)):
                    a.copy_(b)
                samples.setdefault((name, T), []).append(statistics.median(time_replays(gr, args.reps, 5)))
                del runner, gr
                torch.cuda.empty_cache()
    M.GatedDeltaNet.mix, wy.wy_verify_ab = mix, wy_ab
    out = []
    for (name, T), v in samples.items():
        ar = statistics.median(samples[(name, 1)])
        out.append({"variant": name, "rows": T, "step_ms": statistics.median(v), "c": statistics.median(v) / ar,
                    "rounds": [round(x, 4) for x in v]})
    print_table(out, ["variant", "rows", "step_ms", "c", "rounds"])
    write_results("gdn_verify_ab", out, {"context": CONTEXT})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
