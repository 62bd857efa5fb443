"""T_step(N): the time of one target forward over N rows at a given context (``probe rows``).

c(N) = T_step(N) / T_AR is the verification cost factor of the cost model (speedup over AR
= tau(N) / c(N)). T_AR is T_step(1) of the same engine spec: the AR step the engine runs for it
(the fused decode kernels where they apply, ``ar_path``), so c(N) is against the step a user's AR
decode actually takes. A spec whose AR step is not the fastest the model can take (``decode=layers``
where the fused kernels apply) gets a warning: its c(N) is flattered by a slow denominator.

With a Q view (``probe rows --qview w12|fp8``) every N of two rows or more is timed a second time
as TLV's Q pass over that view of the weights (``qpass_ms``, ``q_over_exact``), so the cost model
can take the Q pass's own time instead of the exact step's.

On a GPU each N is a captured CUDA graph (the engine's verify step: N rows at slots
context..context+N-1 attending to the context plus their own chain, LM head and argmax
included), timed with CUDA events, median of ``reps`` replays; each point names the path its
step ran (``fused``: the fused kernels, any rows; ``layers``: the layer modules). On the CPU
the same forward is timed with a wall clock (median); there, compute grows with N from the first
rows, the opposite of a GPU's flat, bandwidth-bound region.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from specpilot.errors import InputError
from specpilot.machine import cpu_name


@dataclass
class RowsResult:
    model: str
    gpu: str | None
    device: str
    dtype: str
    context: int
    ar_ms: float
    points: list[dict]
    reps: int
    method: str
    cpu: str | None = None
    ar_path: str = "layers"
    warnings: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"schema": "specpilot.rows/1", "model": self.model, "gpu": self.gpu, "device": self.device,
                "dtype": self.dtype, "context": self.context, "ar_path": self.ar_path, "ar_ms": self.ar_ms,
                "points": self.points, "reps": self.reps, "method": self.method, "cpu": self.cpu,
                "warnings": self.warnings, **self.extra}


def step_path(model, rows: int) -> str:
    """``invariant`` when a step of ``rows`` rows runs the row-invariant kernels (deterministic),
    ``fused`` when it runs the fused kernels, else ``layers``."""
    from specpilot.engine.fused_verify import takes, takes_invariant

    if takes_invariant(model, rows):
        return "invariant"
    return "fused" if model.fused_decode and (rows == 1 or takes(model, rows)) else "layers"


def slower_ar_warning(model) -> str | None:
    """Why T_AR is not the fastest AR step this model can take here (None when it is)."""
    from specpilot.engine.fused_decode import ineligible

    if model.device.type != "cuda" or model.fused_decode or ineligible(model) is not None:
        return None
    return ("T_AR is the layer modules' AR step, but this model also takes the fused decode kernels "
            "(decode=fused), a faster AR step: c(N) against the slower step understates what verification costs")


def faster_than_ar_warning(points: list[dict], head_rows: int | None = None) -> str | None:
    """A step of more rows timed faster than the one-row step (c below ``ceiling``'s 0.95): the
    timing is noise, and a cost model built on it reads high. ``head_rows``: the certified head's
    most rows a step; the points past it run another head, a real difference said apart."""
    from specpilot.probes.costmodel import C_NOISE

    low = [p for p in points if p["rows"] > 1 and p["c"] < C_NOISE and (head_rows is None or p["rows"] <= head_rows)]
    if not low:
        return None
    at = ", ".join(f"{p['rows']} rows ({p['c']:.3g})" for p in low)
    return (f"c(N) below {C_NOISE:g} at {at}: a step of more rows timed faster than the one-row step, which is "
            "noise (a busy machine, too few --reps); probe again before a cost model uses it")


def fill_random(tensors: list, gen, progress=None) -> None:
    """Fill each of ``tensors`` with random normal values from ``gen`` (a probe's KV cache), one
    tensor at a time; ``progress`` (``specpilot.output.progress``) reports them, since at long
    contexts the fill takes longer than the timed steps."""
    import torch

    it = tensors if progress is None else progress(tensors, total=len(tensors), desc="filling the KV cache",
                                                   unit="tensor")
    for t in it:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))


def step_input(model, T: int, context: int):
    """N = ``T`` rows at the slots after ``context`` committed tokens, each attending the context and
    its chain (causal among the rows), random tokens: a probe step's inputs."""
    import torch

    from specpilot.engine.step_input import StepInput

    dev = model.device
    S = model.max_seq
    slots = context + torch.arange(T, device=dev)
    mask = torch.zeros(T, S, dtype=torch.bool, device=dev)
    mask[:, :context] = True
    mask[:, context:context + T] = torch.tril(torch.ones(T, T, dtype=torch.bool, device=dev))
    tokens = torch.randint(0, model.spec.vocab_size, (T,), device=dev)
    return StepInput(tokens, slots.clone(), slots, mask, "chain" if model.spec.is_hybrid else "seq")


def measure_rows(model, rows: list[int], context: int, reps: int = 50, warmup: int = 5, progress=None,
                 qview=None) -> RowsResult:
    """Median step time per row count on an already-built model (cache of >= context + max(rows) slots);
    with ``qview`` (``engine.tlv.QView``) also the Q pass's at every count of two rows or more."""
    import torch

    if context < 1:
        raise InputError(f"--context must be >= 1, got {context}")
    if context + max(rows) > model.max_seq:
        raise InputError(f"context {context} + {max(rows)} rows exceed the cache ({model.max_seq} slots)")
    cuda = model.device.type == "cuda"
    gen = torch.Generator(device="cpu").manual_seed(0)
    fill_random([t for blk in model.layers if hasattr(blk.mixer, "k_cache")   # a realistic (non-zero) KV cache
                 for t in (blk.mixer.k_cache, blk.mixer.v_cache)], gen, progress)
    order = sorted(set(rows))
    if 1 not in order:
        order = [1] + order
    times, qtimes = {}, {}
    from specpilot.engine.graphs import graph_ready

    graphs = graph_ready(model)
    first_q = next((T for T in order if T > 1), None)
    it = order if progress is None else progress(order, total=len(order), desc="rows", unit="N")
    for T in it:
        # a process's first step pays for allocation and lazy set-up: never time it (nor the Q pass's first)
        warm = max(warmup, 1) if T == order[0] else warmup
        inp = step_input(model, T, context)
        times[T] = _time_step(model, inp, T, context, reps, warm, graphs, cuda)
        if qview is not None and T > 1:   # one row is the AR step, which a Q pass never is
            with qview.active():
                qtimes[T] = _time_step(model, inp, T, context, reps, max(warmup, 1) if T == first_q else warmup,
                                       graphs, cuda)
    ar = times[1]
    points = [{"rows": T, "step_ms": times[T], "c": times[T] / ar, "path": step_path(model, T),
               **({"qpass_ms": qtimes[T], "q_over_exact": qtimes[T] / times[T]} if T in qtimes else {})}
              for T in order if T in set(rows) or T == 1]
    head = model.certified_head
    warnings = [w for w in (slower_ar_warning(model),
                            faster_than_ar_warning(points, head.max_rows if head is not None else None)) if w]
    if head is not None and max(order) > head.max_rows:
        warnings.append(f"the certified head takes up to {head.max_rows} rows a step: the points above "
                        f"{head.max_rows} rows run the linear head, as the engine's steps of that size do (their c "
                        "is against a one-row step of the certified head)")
    gpu = torch.cuda.get_device_name(model.device) if cuda else None
    method = ("cuda graph, CUDA events, median" if graphs else
              "eager, CUDA events, median" if cuda else "eager, wall clock, median")
    return RowsResult(model.spec.name, gpu, str(model.device), str(model.dtype).replace("torch.", ""), context, ar,
                      points, reps, method, cpu=None if cuda else cpu_name(), ar_path=step_path(model, 1),
                      warnings=warnings,
                      extra={"torch": torch.__version__, "threads": torch.get_num_threads(), "warmup": warmup})


def _time_step(model, inp, T: int, context: int, reps: int, warm: int, graphs: bool, cuda: bool) -> float:
    """Median ms of the step ``inp`` of ``T`` rows: its CUDA graph's replays, else eager calls."""
    if graphs:
        from specpilot.engine.graphs import GraphRunner, time_replays

        runner = GraphRunner(model)
        g, sinp, _ = runner.get(T)   # captured here: inside a Q view's active(), its kernels
        sinp.tokens.copy_(inp.tokens)
        sinp.pos.copy_(inp.pos)
        sinp.slots.copy_(inp.slots)
        sinp.mask.copy_(inp.mask)
        return statistics.median(time_replays(g, reps, warm))
    kv = model.max_seq if cuda else min(model.max_seq, ((context + T + 63) // 64) * 64)
    inp.mask = inp.mask[:, :kv]   # the same kv for the exact and the Q pass's timing

    def once():
        model.greedy(inp, kv_len=kv)
        for gl in model.gdn_layers():
            gl._stash = None

    from specpilot.engine.graphs import time_calls

    return statistics.median(time_calls(once, reps, warm, cuda))


def q_view(model, kind: str, rows: int):
    """The Q pass's weights ``kind`` (w12 or fp8) for ``model``, as a TLV engine builds them, for
    steps of up to ``rows`` rows (an InputError where TLV could not run them)."""
    from specpilot.engine.spec import MAX_STEP_ROWS
    from specpilot.engine.tlv import QView, cuda_refusal

    if model.device.type == "cuda" and rows > MAX_STEP_ROWS and not model.spec.is_hybrid:   # before it is built
        raise InputError(f"--qview {kind}: TLV's Q pass runs in verify steps of up to {MAX_STEP_ROWS} rows on CUDA; "
                         f"give --rows up to {MAX_STEP_ROWS}")
    view = QView.for_model(model, kind)
    if model.device.type != "cuda":
        return view
    why = cuda_refusal(model, view, rows - 1)
    if why:
        raise InputError(f"--qview {kind}: {why}")
    return view


def peak_bytes(spec, max_seq: int, dtype, device: str, rows: int, batch: int = 1,
               torch_attention: bool = True) -> dict:
    """What a rows probe of ``spec`` (a ModelSpec) holds at its peak, by the cache's ``max_seq``
    positions, before anything is made: ``device`` (bytes on the device) and ``host`` (CPU bytes
    the build and the cache fill take beside them on a GPU machine; 0 on the CPU, whose peak is
    ``device``), and the parts (``kv``, ``rope``, ``transient``) the refusal names. The parts that
    grow with the context: the KV caches (the model's one-request cache, and ``batch`` slots of
    the batch decoder's, a hybrid's spare slot too), the RoPE tables (cos and sin, fp32) and the
    largest of what is made and dropped again: building the RoPE tables (float64 positions and
    angles), filling one layer's K or V with random fp32 values, or a step's mask and, with the
    torch attention, one layer's scores over ``rows`` rows (fp32 scores, the masked copy and the
    softmax). ``weights``: the model's parameters (:func:`~specpilot.engine.model.weight_bytes`), on
    the device; activations of a few rows are not counted."""
    import torch

    from specpilot.engine.model import weight_bytes

    elem = torch.empty((), dtype=dtype).element_size()
    slots = 1 + (batch + spec.is_hybrid if batch > 1 else 0)
    layer_pos = spec.num_kv_heads * spec.head_dim   # one layer's K (or V) per slot and position
    kv = 2 * spec.num_full_attention_layers * layer_pos * elem * slots
    rot = int(spec.head_dim * spec.partial_rotary_factor)
    rot -= rot % 2
    rope = 2 * rot * 4
    build = 8 + 16 * rot   # rope_tables: positions and angles in float64, the angles in fp32
    fill_slots = batch + spec.is_hybrid if batch > 1 else 1
    fill = layer_pos * fill_slots * (4 + (elem if elem != 4 else 0))   # randn fp32, then .to(dtype)
    step = rows * batch * (1 + (16 * spec.num_heads if torch_attention else 0))
    cuda = device.startswith("cuda")
    transient = max(step, 0 if cuda else max(build, fill))
    weights = weight_bytes(spec, dtype)
    return {"device": (kv + rope + transient) * max_seq + weights, "host": max(build, fill) * max_seq if cuda else 0,
            "kv": kv * max_seq, "rope": rope * max_seq, "transient": transient * max_seq, "weights": weights,
            "slots": slots}


def check_probe_fits(spec, max_seq: int, dtype, device: str, rows: int, batch: int = 1,
                     torch_attention: bool = True) -> None:
    """Refuse (EnvironmentMissing, exit 3) a rows probe whose peak (:func:`peak_bytes`) the free
    memory cannot hold, before anything is made (the CPU hands out pages lazily: the process would
    grow until the machine runs out, or be killed)."""
    from specpilot.engine.model import smaller_weights_hint
    from specpilot.errors import EnvironmentMissing
    from specpilot.machine import free_memory

    need = peak_bytes(spec, max_seq, dtype, device, rows, batch, torch_attention)
    for where, n in ((device, need["device"]), ("cpu", need["host"])):
        free = free_memory(where)
        if not n or free is None or n <= free:
            continue
        on_device = where == device
        caches = (f"{need['slots']} KV caches of {max_seq} slots" if need["slots"] > 1
                  else f"a KV cache of {max_seq} slots")
        parts = (f"{caches} {need['kv'] / 1e9:.3g} GB, RoPE tables {need['rope'] / 1e9:.3g} GB, the largest "
                 f"transient {need['transient'] / 1e9:.3g} GB"
                 + (f", weights {need['weights'] / 1e9:.3g} GB" if on_device else ""))
        hint = (smaller_weights_hint(dtype) if on_device and need["weights"] > free
                else "a shorter --context, fewer --rows or a smaller --batch")
        raise EnvironmentMissing(f"probe rows needs about {n / 1e9:.3g} GB on {where} at its peak for {spec.name} "
                                 f"({parts}); {where} has {free / 1e9:.3g} GB free ({hint})")


def default_device() -> str:
    """``cuda`` when a GPU is visible, else ``cpu`` (``probe rows`` without ``--device``)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def start(spec, max_seq: int, rows: int) -> None:
    """A rows probe's first steps, before its CPU thread banner and its model: refuse a peak the
    memory cannot hold (:func:`check_probe_fits`), then the ``loading model`` status line."""
    import logging

    import torch

    from specpilot.engine.api import resolve_model
    from specpilot.engine.attention import resolve
    from specpilot.engine.model import Transformer

    model_spec = resolve_model(spec.model, spec.random)[0]
    Transformer.check_supported(model_spec)
    check_probe_fits(model_spec, max_seq, getattr(torch, spec.torch_dtype_name), spec.device, rows, spec.batch,
                     torch_attention=resolve(spec.attn, spec.device) == "torch")
    logging.getLogger("specpilot.status").info(f"loading model {spec.model} (probe rows, {spec.device}) ...")


def probe_rows(spec, rows: list[int], context: int, reps: int = 50, warmup: int = 5, progress=None,
               qview: str | None = None) -> RowsResult:
    """:func:`measure_rows` on the target ``spec`` describes (``EngineSpec``: model, dtype, device,
    threads, w12, attn, head, decode, gdn), with a cache of context + rows + 64 slots; the result
    names the model and records the W12, attention, head, decode and GDN choices. ``qview``: also
    time the TLV Q pass over that view (:func:`q_view`)."""
    from specpilot.engine.api import cpu_threads, load_target
    from specpilot.machine import torch_threads

    max_seq = context + max(rows) + 64
    start(spec, max_seq, max(rows))
    threads = cpu_threads(spec) if spec.device == "cpu" else spec.threads   # as the engine runs
    with torch_threads(threads):
        target = load_target(spec, max_seq=max_seq)
        view = q_view(target.model, qview, max(rows)) if qview else None
        res = measure_rows(target.model, rows, context, reps=reps, warmup=warmup, progress=progress, qview=view)
    res.model = target.name
    res.extra.update({k: target.info[k] for k in ("w12", "attn", "head", "decode", "gdn", "deterministic")})
    if qview:
        res.extra["qview"] = qview
    return res
