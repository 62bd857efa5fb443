"""``specpilot run``: generate with the embedded engine (AR, chain, best-first tree or TLV)."""

from __future__ import annotations

from pathlib import Path

import click

from specpilot.engine.clocks import clock_line
from specpilot.engine_options import engine_options, spec_from_cli
from specpilot.errors import InputError
from specpilot.options import NonEmptyPath
from specpilot.output import Report, Section, count, emit, output_options, progress


def read_prompts(path: str) -> list[dict]:
    """Prompts from a file (``specpilot.prompts/1`` or outputs JSONL, or plain text lines)."""
    from specpilot.auditors.outputs import read_prompt_rows

    return [{"id": r.id, "ids": r.prompt_ids} if r.prompt_ids is not None else {"id": r.id, "text": r.text}
            for r in read_prompt_rows(path)]


def _w12_label(w12: dict | None) -> str:
    if not w12:
        return ""
    return f", W12 {w12['path']}: {w12['tensors']} projections, {w12['bits_per_weight']:.3f} bits/weight"


def _gdn_label(gdn: str | None) -> str:
    return f", GDN {gdn}" if gdn else ""


def _batch_label(spec, batch: dict | None) -> str:
    """The title's batch: the slots the batch decoder had (no more than the prompts) and the
    ``--batch`` asked for where that was more."""
    if spec.batch == 1:
        return ""
    used = batch["batch"] if batch else spec.batch
    return f", batch {used}" + (f" of --batch {spec.batch}: {count(used, 'prompt')}" if used != spec.batch else "")


def _title(model_name: str, spec, info: dict, batch: dict | None = None) -> str:
    """The run table's title: model, mode and what changes the arithmetic or the schedule."""
    return (f"{model_name} {spec.mode} ({info['dtype']}, {spec.device}{_w12_label(info.get('w12'))}"
            f"{_gdn_label(info.get('gdn'))}{', deterministic steps' if info.get('deterministic') else ''}"
            f"{', Q pass ' + str(info.get('qview')) if spec.mode == 'tlv' else ''}"
            f"{_batch_label(spec, batch)})")


def _tlv_summary(results: list[dict], tau: float, qview: str | None, batch: dict | None = None) -> dict | None:
    """TLV's cycles over every request: the Q pass's weights, tau per exact pass, the Q pass's top-1
    agreement with the exact pass, mean |C| and the mean cycle's time split."""
    # a request the prefill ended (EOS) ran no cycle: any request's, or the batch's, count
    if not any("tlv" in r for r in results) and not (batch and batch.get("tlv")):
        return None
    from specpilot.engine.tlv import run_totals

    return {"qview": qview, "tau_per_exact_pass": tau, **run_totals(results, batch)}


def _tlv_note(t: dict) -> str:
    agree = "n/a" if t["q_top1_agreement"] is None else f"{100 * t['q_top1_agreement']:.1f}%"
    ms = t["time_ms"]
    return (f"\nTLV: tau {t['tau_per_exact_pass']:.3f} per exact pass, Q-pass top-1 agreement {agree} "
            f"({t['q_agree']}/{t['q_compared']}), mean |C| {t['mean_commit_chain']:.2f}; "
            f"{'batched step' if 'steps' in t else 'cycle'} {t['cycle_ms']:.3f} ms "
            f"= draft 1 {ms['draft1']:.3f} + Q pass {ms['qpass']:.3f} + draft 2 {ms['draft2']:.3f} + exact pass "
            f"{ms['exact']:.3f} + append {ms['append']:.3f} ms")


def _batch_note(b: dict, mode: str) -> str:
    """A batched run's steps: how many requests each step carried, its wall time, the prompt rows,
    and the batching rules that apply to ``mode`` (the JSON's ``batch`` has every total)."""
    steps = b["verify_steps"]
    what = "decode step" if mode == "ar" else "verify step"   # an AR step verifies nothing
    line = f"\nbatch {b['batch']}: {count(steps, what)}"
    if steps:
        # scheduler iterations run steps or prefill passes; the latter's wall time is counted apart
        wall = (b["step_seconds"] - b["prefill_seconds"]) * 1e3 / steps
        overlap = f", {b['overlapped_steps']} overlapped" if b.get("overlapped_steps") else ""
        line += (f" of {b['request_steps'] / steps:.1f} requests on average, {wall:.3f} ms each "
                 f"(wall clock{overlap})")
    rules = (f"budget {b['budget']}, block {b['block']}, " if mode in ("chain", "tree") else "") + f"admit {b['admit']}"
    return (f"{line}; {count(b['prefill_passes'], 'prefill pass', 'prefill passes')}, "
            f"{count(b['admitted_prompt_rows'], 'prompt row')} in {what}s; {rules}")


def _note(tokens: int, steps: int, summary: dict, info: dict, timing: dict | None, clocks: dict | None = None,
          batch: dict | None = None, mode: str = "ar") -> str:
    note = (f"total: {count(tokens, 'token')}, {count(steps, 'pass', 'passes')}, tau {summary['tau']:.3f}, "
            f"{summary['tokens_per_s']:.1f} "
            f"tokens/s; load {info['load_seconds']:.1f} s, warm-up {info['warmup_seconds']:.1f} s (before the "
            "requests)")
    if batch:
        note += _batch_note(batch, mode)
    if timing and "gpu_ms" in timing:
        note += (f"\nper step: GPU {timing['gpu_ms']:.3f} ms (CUDA events), loop {timing['wall_ms']:.3f} ms, "
                 f"outside {timing['outside_ms']:.3f} ms")
    elif timing and "verify_ms" in timing:
        q = f" + Q pass {timing['qpass_ms']:.3f}" if timing.get("qpass_ms") else ""
        note += (f"\nper step: loop {timing['wall_ms']:.3f} ms = drafting {timing['draft_ms']:.3f}{q} + verify "
                 f"{timing['verify_ms']:.3f} + rest {timing['rest_ms']:.3f} ms (wall clock)")
    line = clock_line(clocks)
    return note + (f"\n{line}" if line else "")


@click.command("run")
@engine_options()
@click.option("--prompt", "prompt_text", default=None, help="One prompt (text).")
@click.option("--prompts", "prompts_file", type=NonEmptyPath(dir_okay=False), default=None,
              help="Prompts file: specpilot.prompts/1 JSONL (prompt_ids or text; an outputs file works too), or plain text, one prompt per line.")
@click.option("--prompt-ids", default=None, help="One prompt as comma-separated token ids.")
@click.option("--chat/--raw", "chat", default=None,
              help="Wrap text prompts in the model's chat template (default when it has one) or not.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True,
              help="New tokens per prompt at most (a request also stops at its end-of-sequence token).")
@click.option("--outputs-out", type=NonEmptyPath(dir_okay=False), default=None,
              help="Write the outputs JSONL (audit input): one line per prompt.")
@click.option("--lattice-out", type=NonEmptyPath(dir_okay=False), default=None,
              help="Write every step's draft lattice (replay input), target filled from committed tokens.")
@output_options
def command(prompt_text, prompts_file, prompt_ids, chat, max_new_tokens, outputs_out, lattice_out, fmt, out, **kw):
    """Generate greedily with the embedded engine and report tau and tokens/s.

    \b
    Examples:
      specpilot run --model smollm2 --mode tree --nodes 32 --prompt "Count to ten."
      specpilot run --model smollm2 --mode ar --prompts prompts.jsonl --outputs-out ar.jsonl
      specpilot run --model tiny --mode tree --prompt "abcabcabc" --lattice-out lat.jsonl --format json
      specpilot run --model smollm2 --mode tlv --nodes 32 --prompt "Count to ten." --lattice-out tlv.jsonl

    chain, tree and tlv outputs equal ar outputs (greedy, lossless); tau is tokens per verification
    pass (tlv: per exact pass; the note adds the Q pass's agreement, |C| and the cycle's time split).
    On CUDA the note also gives the SM clock and power over the run (NVML) and says when the GPU
    lowered its clock (power or thermal limit), which makes a long run slower than a short probe.
    """
    spec = spec_from_cli(kw)
    given = [x is not None for x in (prompt_text, prompts_file, prompt_ids)]
    if sum(given) != 1:
        raise InputError("give exactly one of --prompt TEXT, --prompts FILE or --prompt-ids IDS")
    if max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if prompts_file:
        prompts = read_prompts(prompts_file)
    elif prompt_ids is not None:
        if not prompt_ids.strip():
            raise InputError("--prompt-ids is empty")
        try:
            ids = [int(x) for x in prompt_ids.split(",")]
        except ValueError:
            raise InputError(f"--prompt-ids must be comma-separated integers, got {prompt_ids!r}") from None
        prompts = [{"id": 0, "ids": ids}]
    else:
        if not prompt_text:
            raise InputError("--prompt is empty")
        from specpilot.fileio import unicode_text

        prompts = [{"id": 0, "text": unicode_text(prompt_text, "--prompt")}]
    if chat and all(p.get("ids") is not None for p in prompts):
        raise InputError("--chat wraps text prompts in the model's chat template, and these prompts are token ids; "
                         "leave --chat out")
    inputs = [p for p in (prompts_file,) if p] + spec.inputs()   # the model's own files too
    outs = [Path(x).resolve() for x in (outputs_out, lattice_out, out) if x]
    if len(set(outs)) != len(outs):
        raise InputError("--outputs-out, --lattice-out and --out must be different files")
    from specpilot.fileio import check_output_path, write_jsonl_atomic

    for path, option in ((outputs_out, "--outputs-out"), (lattice_out, "--lattice-out"), (out, "--out")):
        if path:   # before the model loads and generates
            check_output_path(path, option, protect=inputs)

    from specpilot.engine.api import has_tokenizer, load_engine

    text = next((p for p in prompts if p.get("ids") is None), None)
    if text is not None and not has_tokenizer(spec.model, spec.random):   # said before the model loads
        where = f"{prompts_file}: prompt {text['id']!r}" if prompts_file else "--prompt"
        raise InputError(f"{where} is text, and model {spec.model} has no tokenizer; give its token ids "
                         f"({'prompt_ids' if prompts_file else '--prompt-ids'}) instead")
    engine = load_engine(spec)
    run = engine.run(prompts, max_new_tokens, chat=chat, record_lattice=bool(lattice_out), progress=progress)
    results, lattice_rows, used_chat = run.results, run.lattice_rows, run.chat

    if outputs_out:
        write_jsonl_atomic(outputs_out, ({"schema": "specpilot.outputs/1", "id": r["id"], "prompt_ids": r["prompt_ids"],
                                          "output_ids": r["output_ids"]} for r in results), protect=inputs,
                           option="--outputs-out")
        click.echo(f"wrote {outputs_out}", err=True)
    if lattice_out:
        write_jsonl_atomic(lattice_out, lattice_rows, protect=inputs, option="--lattice-out")
        click.echo(f"wrote {lattice_out}", err=True)

    tokens = sum(r["tokens"] for r in results)
    steps = sum(r["steps"] for r in results)
    # a batched run's requests overlap: its time is the run's wall time
    seconds = run.batch["seconds"] if run.batch else sum(r["seconds"] for r in results)
    delivered = sum(r["tokens"] - 1 for r in results)  # tokens from verification passes (not prefill)
    summary = {"requests": len(results), "tokens": tokens, "steps": steps,
               "tau": delivered / steps if steps else 1.0, "seconds": seconds,
               "tokens_per_s": tokens / seconds if seconds > 0 else 0.0}
    data = {"schema": "specpilot.run/1", "engine": str(spec), "model": engine.model_name, "mode": spec.mode,
            "drafter": spec.drafter if spec.mode != "ar" else None,
            "nodes": spec.nodes if spec.mode in ("tree", "tlv") else None,
            "dtype": engine.info["dtype"], "device": spec.device, "chat": used_chat, "max_new_tokens": max_new_tokens,
            "w12": engine.info.get("w12"), "attn": engine.info.get("attn"), "head": engine.info.get("head"),
            "decode": engine.info.get("decode"), "gdn": engine.info.get("gdn"),
            "deterministic": engine.info.get("deterministic"), "load_seconds": engine.info["load_seconds"],
            "warmup_seconds": engine.info["warmup_seconds"], **summary, "step_timing": run.step_timing(),
            "gpu_clocks": run.gpu_clocks, "results": results}
    if run.batch:
        data["batch"] = run.batch
    tlv = _tlv_summary(results, summary["tau"], engine.info.get("qview"), run.batch)
    if tlv:
        data["tlv"] = tlv
    if len(results) == 1:
        data.update({k: results[0][k] for k in ("prompt_ids", "output_ids", "text")})
    rows = [[r["id"], r["tokens"], r["steps"], r["tau"], r["tokens_per_s"], r["decode_tokens_per_s"], r["stop"]]
            for r in results]
    lines = []
    if engine.tokenizer is not None:
        for r in results:
            lines.append(f"--- {r['id']} ---" if len(results) > 1 else "")
            lines.append(r["text"])
    report = Report(data=data, title=None, lines=[x for x in lines if x != ""] if len(results) == 1 else lines,
                    sections=[Section(_title(engine.model_name, spec, engine.info, run.batch),
                                      ["id", "tokens", "steps", "tau", "tokens/s", "decode tok/s", "stop"], rows,
                                      note=_note(tokens, steps, summary, engine.info, run.step_timing(),
                                                 run.gpu_clocks, run.batch, spec.mode)
                                      + (_tlv_note(tlv) if tlv else ""))])
    emit(report, fmt, out, protect=inputs)
    return 0
