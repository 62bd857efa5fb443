"""Every algorithm cuBLASLt's heuristic offers for a verify step's GEMMs, against the one torch's
``F.linear`` runs (cuBLASLt's first choice, or cuBLAS), each layer alone.

torch calls cuBLASLt with the heuristic's first algorithm; the heuristic returns more (other tiles,
stage counts, split-K, swizzles). This asks it for up to ``--algos`` of them per Llama-3.1-8B layer
and row count (``y = x @ w.T``, bf16 in and out, fp32 accumulate: the layout torch uses, TN) and
times each from a CUDA graph, L2 flushed by reading, interleaved rounds, with torch's cuBLAS and
cuBLASLt calls beside them; each algorithm's output is checked against the fp32 product. cuBLASLt
is called through ctypes on the library torch loaded.

    python lab/verify/blaslt_algos.py [--rows 16,32,64] [--algos 16]

Writes lab/results/blaslt_algos.json.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lab.common import L2Flusher, bootstrap, parse_int_list, print_table, time_interleaved, write_results  # noqa: E402
from lab.verify.blas_backend import blas_call  # noqa: E402
from lab.verify.step_parts import LLAMA_LAYERS as LAYERS  # noqa: E402

COMPUTE_32F, R_32F, R_16BF = 68, 0, 14           # cublasComputeType_t, cudaDataType_t
OP_N, OP_T = 0, 1                                # cublasOperation_t
DESC_TRANSA, DESC_TRANSB = 3, 4                  # cublasLtMatmulDescAttributes_t
PREF_MAX_WORKSPACE = 1                           # cublasLtMatmulPreferenceAttributes_t
CONFIG = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6}
WORKSPACE = 32 << 20


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _library():
    """The cuBLASLt torch loaded (a GEMM first, so that it is mapped)."""
    import torch

    torch.nn.functional.linear(torch.ones(16, 16, device="cuda", dtype=torch.bfloat16),
                               torch.ones(16, 16, device="cuda", dtype=torch.bfloat16))
    with open("/proc/self/maps") as f:
        paths = sorted({line.split()[-1] for line in f if "libcublasLt.so" in line})
    if not paths:
        raise SystemExit("blaslt_algos: no libcublasLt mapped in this process")
    return ctypes.CDLL(paths[0])


class Lt:
    def __init__(self):
        self.lib = _library()
        self.handle = ctypes.c_void_p()
        self._ok(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "create")

    def _ok(self, status, what):
        if status != 0:
            raise RuntimeError(f"cuBLASLt {what}: status {status}")

    def _layout(self, rows, cols, ld):
        lay = ctypes.c_void_p()
        self._ok(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), R_16BF, ctypes.c_uint64(rows),
                                                     ctypes.c_uint64(cols), ctypes.c_int64(ld)), "layout")
        return lay

    def plan(self, m: int, n: int, k: int, count: int):
        """(op desc, layouts A, B, D, heuristic results) for ``y[m, n] = x[m, k] @ w[n, k].T``: in
        column-major terms ``D[n, m] = op_T(A = w)[n, k] @ B = x[k, m]``."""
        desc = ctypes.c_void_p()
        self._ok(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), COMPUTE_32F, R_32F), "desc")
        for attr, op in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            v = ctypes.c_int32(op)
            self._ok(self.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(v), ctypes.sizeof(v)), "trans")
        a, b, d = self._layout(k, n, k), self._layout(k, m, k), self._layout(n, m, n)
        pref = ctypes.c_void_p()
        self._ok(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        ws = ctypes.c_uint64(WORKSPACE)
        self._ok(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(ws),
                                                               ctypes.sizeof(ws)), "pref ws")
        res = (Heuristic * count)()
        got = ctypes.c_int()
        self._ok(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, d, d, pref, count, res,
                                                         ctypes.byref(got)), "heuristic")
        return desc, a, b, d, [res[i] for i in range(got.value) if res[i].state == 0]

    def config(self, algo: Algo) -> dict:
        out = {}
        for name, attr in CONFIG.items():
            v, written = ctypes.c_int32(), ctypes.c_size_t()
            if self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v),
                                                             ctypes.sizeof(v), ctypes.byref(written)) == 0:
                out[name] = v.value
        return out

    def call(self, plan, h: Heuristic, x, w, y, workspace):
        """``y = x @ w.T`` with algorithm ``h``, on torch's current stream (capturable)."""
        import torch

        desc, a, b, d, _ = plan
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        algo = h.algo

        def fn():
            status = self.lib.cublasLtMatmul(
                self.handle, desc, ctypes.byref(alpha), ctypes.c_void_p(w.data_ptr()), a,
                ctypes.c_void_p(x.data_ptr()), b, ctypes.byref(beta), ctypes.c_void_p(y.data_ptr()), d,
                ctypes.c_void_p(y.data_ptr()), d, ctypes.byref(algo), ctypes.c_void_p(workspace.data_ptr()),
                ctypes.c_size_t(WORKSPACE), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
            self._ok(status, "matmul")
            return y
        return fn


def main() -> int:
    bootstrap()
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,32,64")
    ap.add_argument("--algos", type=int, default=16)
    ap.add_argument("--layers", default=",".join(LAYERS))
    args = ap.parse_args()
    rows_list = parse_int_list(args.rows, 1, 256, "blaslt_algos: --rows")
    import torch

    torch.set_grad_enabled(False)
    lt = Lt()
    flush = L2Flusher()
    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
    out = []
    for name in args.layers.split(","):
        n, k = LAYERS[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = torch.nn.functional.linear(x.float(), w.float())
            plan = lt.plan(m, n, k, args.algos)
            fns, labels = [blas_call(x, w, "cublas"), blas_call(x, w, "cublaslt")], ["torch cublas", "torch cublaslt"]
            for i, h in enumerate(plan[4]):
                y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                f = lt.call(plan, h, x, w, y, workspace)
                f()
                torch.cuda.synchronize()
                err = (y.float() - ref).abs().max().item()
                if not err <= 0.02 * ref.abs().max().item():
                    print(f"{name} m={m} algo {i}: max error {err:.3g}: skipped", flush=True)
                    continue
                fns.append(f)
                labels.append(f"algo {i} " + " ".join(f"{a}={v}" for a, v in lt.config(h.algo).items())
                              + f" ws={h.workspace >> 10}K waves={h.waves:.2f}")
            us = time_interleaved(fns, flush=flush)
            base = min(us[:2])
            for label, t in zip(labels, us):
                out.append({"layer": name, "rows": m, "what": label, "us": t, "of_torch_best": base / t})
            best = min(range(len(us)), key=us.__getitem__)
            print(f"{name} m={m}: torch {us[0]:.1f} / {us[1]:.1f} us, best {labels[best]}: {us[best]:.1f} us "
                  f"({base / us[best]:.3f}x), {len(us) - 2} algos", flush=True)
        del w
    print_table([r for r in out if r["of_torch_best"] >= 1.0], ["layer", "rows", "what", "us", "of_torch_best"])
    write_results("blaslt_algos", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
