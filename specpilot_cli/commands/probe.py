"""``specpilot probe``: small measurements on this machine (``probe rows``: T_step versus rows)."""

from __future__ import annotations

import click

from specpilot.errors import EnvironmentMissing, InputError
from specpilot.output import Report, Section, emit, output_options, progress


@click.group("probe")
def command():
    """Measure facts the cost model needs on this machine.

    \b
      specpilot probe rows --model llama-3.1-8b --random-weights --rows 1,2,4,...,256 --device cuda
    """


@command.command("rows")
@click.option("--model", default="smollm2", show_default=True,
              help="smollm2, tiny, tiny-hybrid, a catalog name (with --random-weights) or a HF folder.")
@click.option("--random-weights", is_flag=True, help="Random weights (timing does not depend on values).")
@click.option("--rows", "rows_text", default="1,2,4,8,16,32,64", show_default=True,
              help="Row counts N; '1,2,4,...,256' continues a doubling series.")
@click.option("--context", type=int, default=1024, show_default=True, help="Committed tokens in the KV cache.")
@click.option("--device", default=None, help="cpu or cuda[:N] (default: cuda when available).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Default: bfloat16 on cuda, float32 on cpu.")
@click.option("--reps", type=int, default=50, show_default=True, help="Timed repetitions per N (median).")
@click.option("--warmup", type=int, default=5, show_default=True)
@click.option("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice).")
@click.option("--w12", is_flag=True, help="Projections as W12 (as run --w12; bfloat16 unless --dtype is given).")
@click.option("--attn", type=click.Choice(["auto", "torch", "fused"]), default="auto", show_default=True,
              help="Attention: torch reference or fused split-KV Triton kernel (cuda); auto = fused on cuda.")
@click.option("--head", type=click.Choice(["linear", "certified"]), default="linear", show_default=True,
              help="Greedy LM head (as run --head): certified = INT8 bounds + exact rescoring, up to 64 rows.")
@click.option("--decode", type=click.Choice(["auto", "layers", "fused"]), default="layers", show_default=True,
              help="One-row steps (N = 1) as run --decode: fused = the fused decode kernels (cuda, dense, no --w12); "
                   "the default measures the layer modules at every N.")
@output_options
def rows(model, random_weights, rows_text, context, device, dtype, reps, warmup, threads, w12, attn, head, decode,
         fmt, out):
    """T_step(N) for N verification rows and c(N) = T_step(N) / T_step(1) (JSON for ``ceiling --rows-probe``).

    On a GPU each N is a CUDA graph timed with CUDA events (median); on the CPU a wall clock.
    """
    from specpilot.options import parse_int_list

    row_list = parse_int_list(rows_text, "--rows", minimum=1)
    if reps < 1 or warmup < 0:
        raise InputError("--reps must be >= 1 and --warmup >= 0")
    if context < 1:
        raise InputError(f"--context must be >= 1, got {context}")
    import torch

    from specpilot.engine.api import DTYPES, build_model
    from specpilot.engine.rows import measure_rows

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EnvironmentMissing("--device cuda but no CUDA GPU is visible; use --device cpu")
    if not (device == "cpu" or device.startswith("cuda")):
        raise InputError(f"unknown --device {device!r}; use cpu or cuda[:N]")
    tdtype = getattr(torch, DTYPES[dtype] if dtype else ("bfloat16" if device.startswith("cuda") or w12 else "float32"))
    torch.set_grad_enabled(False)
    if threads is not None:
        if threads < 1:
            raise InputError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    m, _, name = build_model(model, random_weights, tdtype, device, context + max(row_list) + 64)
    attn = m.set_attention(attn)
    w12_info = None
    if w12:
        from specpilot.engine.w12 import convert_engine_model

        w12_info = convert_engine_model(m).to_json()
    head = m.set_head(head)
    if decode == "fused" and not device.startswith("cuda"):  # auto falls back to layers there
        raise InputError("--decode fused needs --device cuda (its kernels only run in Triton's interpreter on the CPU)")
    decode = m.set_decode(decode)
    res = measure_rows(m, row_list, context, reps=reps, warmup=warmup, progress=progress)
    res.model = name
    data = res.to_json()
    data["w12"] = w12_info
    data["attn"] = attn
    data["head"] = head
    data["decode"] = decode
    hw = res.gpu or f"CPU {res.cpu}"
    label = f", W12 {w12_info['path']}" if w12_info else ""
    emit(Report(data=data, sections=[Section(f"{name} {res.dtype}{label}, context {context}, {hw}",
                                             ["rows", "step ms", "c = T(N)/T(1)"],
                                             [[p["rows"], p["step_ms"], p["c"]] for p in res.points],
                                             note=f"{res.method} of {reps} steps")]), fmt, out)
    return 0
