"""Shared helpers for device benchmarks: environment facts, GPU timing, results files.

Timing follows ../shared/GPU.md: CUDA events, warm-up, CUDA graphs where launch overhead is not
what is measured, L2 flushed by *reading* a 256 MB buffer, median of many repetitions.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


ROOTS = [("specpilot", "specpilot_cli"), ("specpilot.probes", "probes"), ("specpilot.kernels", "kernels"),
         ("specpilot.auditors", "auditors"), ("specpilot.reports", "reports"), ("specpilot.engine", "engine"),
         ("specpilot.bundles", "bundles")]


def bootstrap() -> None:
    """Import ``specpilot`` from the working tree when it is not installed (the lent GPU).

    Maps the design card's folders under the one import root, as setup.py does.
    """
    try:
        import specpilot.probes  # noqa: F401

        return
    except ImportError:
        pass
    import importlib.util

    for name, folder in ROOTS:
        spec = importlib.util.spec_from_file_location(name, REPO / folder / "__init__.py",
                                                      submodule_search_locations=[str(REPO / folder)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)


def environment() -> dict:
    from specpilot.machine import run_facts

    return run_facts(REPO)


def floors_gpu():
    """The catalog entry (``specpilot.gpus``) of the GPU this run is on, whose bandwidth and FLOP/s
    the byte floors take: a floor of another GPU would misstate every ``of_floor``."""
    import torch

    from specpilot.gpus import match_gpu_name

    name = torch.cuda.get_device_name(0)
    spec = match_gpu_name(name)
    if spec is None:
        raise SystemExit(f"no catalog entry for {name!r}: the byte floors need its bandwidth and FLOP/s")
    return spec


def write_results(name: str, rows: list[dict], extra: dict | None = None, out_dir: str | None = None,
                  results_dir: Path = RESULTS) -> Path:
    """Write ``{benchmark, git_sha, date, gpu, driver, torch, triton, rows}`` to ``results_dir``
    (``benchmarks/results``: ``name`` is the script's stem, one current file per subject) and to
    ``out_dir`` or ``$OUT``."""
    doc = {"benchmark": name, **environment(), **(extra or {}), "rows": rows}
    paths = []
    for d in filter(None, [out_dir or os.environ.get("OUT"), str(results_dir)]):
        p = Path(d) / f"{name}.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(doc, indent=2) + "\n")
        paths.append(p)
    return paths[0]


class L2Flusher:
    """Flush L2 by reading a large buffer (writing leaves dirty lines that slow the next kernel)."""

    def __init__(self, nbytes: int = 256 << 20):
        import torch

        self.buf = torch.randn(nbytes // 4, device="cuda", dtype=torch.float32)
        self.sink = torch.empty((1,), device="cuda", dtype=torch.float32)

    def __call__(self):
        import torch

        # a reduction reads every byte and writes one value (no dirty lines left in L2);
        # dim/keepdim keep ``out=`` valid on torch 2.11 as well as 2.13
        torch.sum(self.buf, dim=0, keepdim=True, out=self.sink)


def time_cuda_graph(fn, *, reps: int = 50, warmup: int = 5, flush: L2Flusher | None = None) -> float:
    """Median microseconds of ``fn`` replayed from a CUDA graph, L2 flushed before each replay."""
    return capture_and_time(fn, reps=reps, warmup=warmup, flush=flush)[0]


def parse_int_list(text: str, lo: int, hi: int, what: str) -> list[int]:
    """A comma list of integers in [lo, hi]; otherwise one line on stderr (``what`` names the
    script and option, e.g. ``"read_floor: --rows"``) and exit 2."""
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        vals = []
    if not vals or any(not lo <= v <= hi for v in vals):
        print(f"{what} wants a comma list of integers {lo}-{hi}, got {text!r}", file=sys.stderr)
        raise SystemExit(2)
    return vals


def time_interleaved(fns, *, rounds: int = 3, reps: int = 50, flush: L2Flusher | None = None) -> list[float]:
    """Median microseconds of each of ``fns`` over ``rounds`` rounds, each round timing every fn in
    turn (:func:`time_cuda_graph`), so a drift of the GPU's clocks falls on all of them alike."""
    times = [[] for _ in fns]
    for _ in range(rounds):
        for t, fn in zip(times, fns):
            t.append(time_cuda_graph(fn, reps=reps, flush=flush))
    return [statistics.median(t) for t in times]


def capture_and_time(fn, *, reps: int = 50, warmup: int = 5, flush: L2Flusher | None = None):
    """Capture ``fn`` in a CUDA graph (after eager warm-up on a side stream) and time replays.

    Returns (median microseconds, the graph), so a caller can also check the graph's output.
    """
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if flush is not None:
            flush()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times), g


def print_table(rows: list[dict], cols: list[str]) -> None:
    from tabulate import tabulate

    print(tabulate([[r.get(c) for c in cols] for r in rows], headers=cols, floatfmt=".3g"))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def section(name: str, fn, errors: list[str]):
    """``fn()``, timed and logged; an exception goes into ``errors`` (with its traceback printed)
    and gives None, so one failing part of a device call keeps the rest of the run."""
    t = time.perf_counter()
    try:
        out = fn()
        log(f"{name}: {time.perf_counter() - t:.1f} s")
        return out
    except Exception as e:
        errors.append(f"{name}: {type(e).__name__}: {e}")
        traceback.print_exc()
        return None


def kernel_profile(fn, top=14):
    """CUDA kernels of one call of ``fn`` by name (PyTorch profiler): total, count, the top ones."""
    import torch
    from torch.profiler import ProfilerActivity, profile as tprofile

    with tprofile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name[:90], [0, 0.0])
            k[0] += 1
            k[1] += getattr(e, "device_time_total", 0) or e.cuda_time_total
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    return {"kernel_ms": sum(v[1] for v in kernels.values()) / 1e3, "kernels": sum(v[0] for v in kernels.values()),
            "top": [{"name": n, "calls": c, "ms": us / 1e3} for n, (c, us) in ranked[:top]]}


def prefill_profile(m):
    """Where a warm 1000-token prefill of engine model ``m`` goes: its wall time (the second
    prefill of the prompt) and CUDA kernels by name."""
    import torch

    from specpilot.engine.decode import Decoder

    dec = Decoder(m, "ar")
    prompt = [(31 * i + 5) % m.spec.vocab_size for i in range(1000)]
    dec.prefill(prompt)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dec.prefill(prompt)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    return {"wall_ms": wall, **kernel_profile(lambda: dec.prefill(prompt))}
