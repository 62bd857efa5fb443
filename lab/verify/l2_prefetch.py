"""cuBLAS GEMMs of a verify step with their weights' first bytes asked of L2 while the kernel
before them runs: cuBLAS takes no part in programmatic dependent launch, so each projection
starts reading its weights only after the previous kernel and its own launch. Here a small
kernel, PDL-launched right before each cuBLAS GEMM, issues one bulk L2 prefetch per weight row
(the row's first ``MB / N`` bytes, or the first ``MB`` of the matrix in ``rows`` mode) and then
waits for the previous kernel, so the GEMM (which waits for it) still sees every input written.

Variants (``lab/verify/step_parts.py``'s timing loop, whole steps, Llama-3.1-8B shapes):
``product``, ``l2pf:<MB>`` (each row's first columns) and ``l2pf-rows:<MB>`` (whole rows from the
top); outputs of each variant's graph checked equal to the product's.

    python lab/verify/l2_prefetch.py [--cases 1x33,1x64] [--variants product,l2pf:8,l2pf:16]
"""

from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lab.common import bootstrap, print_table, write_results  # noqa: E402

ROWS_PER_PROGRAM = 128


def _kernel():
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from specpilot.kernels.triton_env import tl, triton

    @triton.jit
    def prefetch_rows(base, N, row_bytes, stride_bytes, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            gdc_launch_dependents()
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        addr = base + rows.to(tl.int64) * stride_bytes
        size = tl.where(rows < N, row_bytes, 0).to(tl.uint32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0;\n\t@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\t"
            "mov.u32 $0, 0; }", "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
        if PDL:
            gdc_wait()
    return prefetch_rows


_K = None


def prefetch(w, nbytes: int, mode: str) -> None:
    """Ask L2 for ``nbytes`` of ``w`` [N, K] (bf16, contiguous): each row's first ``nbytes / N``
    bytes (``cols``) or the first ``nbytes`` of the matrix as whole rows (``rows``)."""
    global _K
    if _K is None:
        _K = _kernel()
    n, k = w.shape
    row = k * w.element_size()
    if mode == "cols":
        per, rows = min(row, max(16, nbytes // n // 16 * 16)), n
    else:
        per, rows = row, min(n, max(1, nbytes // row))
    grid = (-(-rows // ROWS_PER_PROGRAM),)
    _K[grid](w.data_ptr(), rows, per, row, BLOCK=ROWS_PER_PROGRAM, PDL=True, launch_pdl=True, num_warps=4)


def variant(name: str):
    from lab.verify.step_parts import patched
    from specpilot.kernels.verify import blas

    stack = ExitStack()
    if name == "product":
        return stack
    kind, mb = name.split(":")
    mode = "rows" if kind == "l2pf-rows" else "cols"
    plain = blas.linear

    def routed(h, w, batched=False):
        if h.is_cuda and blas.route(h, w, batched) == "blas":
            prefetch(w, int(float(mb) * 1e6), mode)
        return plain(h, w, batched)
    stack.enter_context(patched(blas, "linear", routed))
    return stack


def main() -> int:
    bootstrap()
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x33,1x64")
    ap.add_argument("--variants", default="product,l2pf:4,l2pf:8,l2pf:16,l2pf:24,l2pf-rows:8")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import torch

    from lab.verify.step_parts import random_target, step_graph, summary, time_cases

    torch.set_grad_enabled(False)
    model = random_target("llama-3.1-8b", 1024)
    variants = args.variants.split(",")
    # the same step's argmax under every variant (a GEMM reading an input before it is written would differ)
    for case in args.cases.split(","):
        B, N = (int(x) for x in case.split("x"))
        outs = {}
        for v in variants:
            with variant(v):
                torch.manual_seed(0)   # step_input draws the step's tokens from torch's generator
                gen = torch.Generator(device="cpu").manual_seed(0)
                runner, g = step_graph(model, B, N, 1024, {}, gen)
                g.replay()
                _, _, out = runner.get(N)
                outs[v] = out.clone()
                del runner, g
        print(case, {v: bool(torch.equal(outs[v], outs["product"])) for v in variants}, flush=True)
    cases = args.cases.split(",")
    rows = summary(time_cases(model, cases, {v: (lambda v=v: variant(v)) for v in variants}, args.rounds),
                   cases, variants)
    print_table(rows, ["case", "variant", "step_ms", "minus_product_ms"])
    write_results("l2_prefetch", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
