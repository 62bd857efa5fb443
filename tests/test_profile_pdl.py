"""`profile` on kernels that overlap the one before them on their stream (programmatic dependent
launch): each kernel counts from where the one before it ended, so the classes add up to the busy
time; concurrent streams keep their own time."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

from specpilot.probes.steps import exclusive_ns, union_ns
from test_profile_real_world import _json

FIXTURE = Path(__file__).parent / "fixtures" / "kineto_specpilot_h200_batch16_pdl.json.gz"
GEMM = "nvjet_sm90_tst_256x16_64x6_2x1_v_bz_TNT"


def test_exclusive_time_per_stream():
    # stream 0: A [0, 10), B [5, 20) launched early and waiting, C [20, 25); stream 1: D [3, 8); step 1: E
    step, stream = np.array([0, 0, 0, 0, 1]), np.array([0, 0, 0, 1, 0])
    s, e = np.array([0, 5, 20, 3, 100]), np.array([10, 20, 25, 8, 110])
    assert exclusive_ns(step, stream, s, e).tolist() == [10, 10, 5, 5, 10]
    assert exclusive_ns(step[:0], stream[:0], s[:0], e[:0]).tolist() == []
    rng = np.random.default_rng(0)
    for _ in range(100):   # per (step, stream): the union of the intervals, each event at most its duration
        n = int(rng.integers(1, 30))
        st, sm = rng.integers(0, 3, n), rng.integers(0, 2, n)
        a = rng.integers(0, 10 ** 12, n)
        b = a + rng.integers(0, 10 ** 6, n)
        ex = exclusive_ns(st, sm, a, b)
        assert (ex >= 0).all() and (ex <= b - a).all()
        for k in set(zip(st.tolist(), sm.tolist())):
            m = (st == k[0]) & (sm == k[1])
            assert ex[m].sum() == union_ns(a[m], b[m])


def _trace(path: Path) -> Path:
    """Two steps: a GEMM [0, 50) us, an attention kernel launched under PDL at 30 us ending at 60,
    on stream 7; an all-reduce [10, 40) on stream 9."""
    ev, corr = [], 0
    for i, t0 in enumerate((1000.0, 2000.0)):
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"decode_step_{i}", "pid": 1, "tid": 1,
                   "ts": t0 - 5, "dur": 80})
        for name, a, b, stream in ((GEMM, 0, 50, 7), ("_attn_split", 30, 60, 7),
                                   ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 10, 40, 9)):
            corr += 1
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                       "ts": t0 - 4 + corr * 0.01, "dur": 1, "args": {"correlation": corr}})
            ev.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": t0 + a, "dur": b - a,
                       "args": {"correlation": corr, "device": 0, "stream": stream}})
    with gzip.open(path, "wt") as fh:
        json.dump({"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H200", "numSms": 132}],
                   "traceEvents": ev}, fh)
    return path


def test_a_kernel_launched_early_counts_from_where_the_one_before_ended(run_cli, tmp_path):
    d = _json(run_cli, _trace(tmp_path / "pdl.json.gz"))
    c = d["classes"]
    assert abs(c["linear"]["ms"] - 0.050) < 1e-9
    assert abs(c["attention"]["ms"] - 0.010) < 1e-9 and abs(c["attention"]["duration_ms"] - 0.030) < 1e-9
    assert abs(c["communication"]["ms"] - 0.030) < 1e-9   # its own stream: all of it
    assert abs(d["kernel_busy_ms"] - 0.060) < 1e-9
    assert any("programmatic dependent launch" in n and "duration_ms" in n for n in d["notes"])


def test_the_embedded_engines_batched_step_adds_up_to_its_busy_time(run_cli):
    """A real trace: three replays of the batch decoder's CUDA graph of 16 requests x 1 row
    (Llama-3.1-8B shapes, random bf16, context 1024) on the H200, every kernel chained under PDL.
    Summed durations count each wait twice (9.4 ms against 4.87 ms busy)."""
    d = _json(run_cli, FIXTURE, "--model", "llama-3.1-8b", "--rows", "1", "--batch", "16", "--context", "1024")
    c = d["classes"]
    total = sum(v["ms"] for v in c.values())
    assert abs(total - d["kernel_busy_ms"]) < 0.01 * d["kernel_busy_ms"]
    assert sum(v["duration_ms"] or 0 for v in c.values()) > 1.8 * d["kernel_busy_ms"]
    assert 3.3 < c["linear"]["ms"] < 3.7 and c["linear"]["calls"] == 128 and 0.9 < c["linear"]["efficiency"] < 1.0
    assert c["lm_head"]["calls"] == 1 and 0.6 < c["attention"]["ms"] < 0.9 and c["norm"]["ms"] < 0.4
    assert not d["warnings"] and d["steps"] == 3
