"""``specpilot w12``: pack checkpoints into lossless 12-bit W12, verify them bit for bit, report sizes."""

from __future__ import annotations

import click

from specpilot import signals
from specpilot.errors import EnvironmentMissing, InputError
# (no torch: a missing, malformed or never packed checkpoint is refused before the W12 library loads)
from specpilot.kernels.w12.files import W12FormatError, check_checkpoint
from specpilot.options import NonEmptyPath
from specpilot.output import Report, Section, count, emit, output_options, progress


def _lib():
    try:
        from specpilot.kernels.w12 import checkpoint
    except ImportError as e:  # torch / safetensors missing
        raise EnvironmentMissing(f"W12 needs torch and safetensors ({e}); pip install torch safetensors") from None
    return checkpoint


def _user_errors(fn):
    """Turn the library's file errors into one-line exit-2 errors."""
    import functools

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except (FileNotFoundError, FileExistsError, NotADirectoryError, W12FormatError) as e:
            raise InputError(str(e).replace("[Errno 2] ", "")) from None
    return wrapper


@click.group("w12")
def command():
    """W12: lossless 12-bit bf16 weights (paper 4.1).

    \b
      specpilot w12 pack model/ -o model-w12/        convert the linear weights
      specpilot w12 verify model-w12/ --against model/   restore and compare bit for bit
      specpilot w12 stats model-w12/                 bits/weight and escape rate

    IN is a .safetensors file, a sharded folder (model.safetensors.index.json) or a folder of
    .safetensors files. Only bf16 2-D weights are converted (W12 is exact for bf16); embeddings,
    norms and lm_head are kept unless --include names them (a tensor an --include matches is
    converted unless an --exclude you give drops it).
    """


def _tensor_rows(tensors):
    return [[t.name, "x".join(map(str, t.shape)), round(t.bits_per_weight, 4), t.escapes,
             float(f"{t.escape_rate:.3e}")] for t in tensors]


def _device(device: str) -> str:
    """auto, cpu, cuda or cuda:N; a malformed one is bad input (exit 2) before CUDA is asked about."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and device != "cpu") \
            or (dev.type == "cuda" and device not in ("cuda", f"cuda:{dev.index}")):
        raise InputError(f"--device {device}: expected auto, cpu or cuda[:N]")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EnvironmentMissing(f"--device {device}: no CUDA device here; use --device cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise EnvironmentMissing(f"--device {device}: no such CUDA device here ({torch.cuda.device_count()} found)")
    return device


@command.command("pack")
@click.argument("src", metavar="IN", type=NonEmptyPath())
@click.option("-o", "--output", "dst", required=True, type=NonEmptyPath(), help="Output file or folder (atomic).")
@click.option("--include", multiple=True, metavar="GLOB",
              help="Tensor names to convert (repeatable; default: *proj.weight, *fc1/fc2.weight, ...); a tensor "
                   "it matches is converted even if the default excludes would keep it.")
@click.option("--exclude", multiple=True, metavar="GLOB",
              help="Tensor names to keep as they are (repeatable; applies to --include's matches too; default, "
                   "with the default includes only: *embed*, lm_head.weight, *norm*).")
@click.option("--device", default="auto", show_default=True,
              help="Where to encode: cuda, cuda:N, cpu, or auto (cuda when there is one).")
@click.option("--force", is_flag=True,
              help="Replace an existing output file (without it an existing OUT is refused; a folder OUT must "
                   "be absent or empty, and --force with it is refused).")
@output_options
@_user_errors
def pack_cmd(src, dst, include, exclude, device, force, fmt, out):
    """Convert the linear weights of IN to W12 and write OUT (a file for a file, a folder for a folder).

    \b
    Example:
      specpilot w12 pack model.safetensors -o model.w12.safetensors
    """
    import os
    from pathlib import Path

    folder = check_checkpoint(src).is_folder   # an index .json is its folder's checkpoint
    if not folder:
        from specpilot.fileio import check_output_path

        check_output_path(dst, "--output", protect=[src])  # before the long conversion
    elif force:
        raise InputError(f"--force: a folder IN packs into a folder --output {dst}, which is never replaced (it must "
                         "be absent or empty); leave --force out")
    if out and Path(out).resolve() == Path(dst).resolve():
        raise InputError(f"--out {out}: the same file as --output; the report needs another name (or leave --out "
                         "out)")
    if folder:
        from specpilot.fileio import refuse_inside

        refuse_inside(out, dst, "the output folder", "which holds the packed checkpoint only")
    if out:   # before the long conversion, not after it
        from specpilot.fileio import check_output_path

        check_output_path(out, "--out", protect=[src])
    if not folder and Path(dst).suffix != ".safetensors":   # what verify and stats recognise
        raise InputError(f"--output {dst}: name a .safetensors file (a single-file checkpoint packs into one)")
    if folder and Path(dst).suffix == ".safetensors":
        raise InputError(f"--output {dst}: {src} is a folder checkpoint (a folder or its index), packed into a "
                         "folder; name a folder, not a .safetensors file")
    if not folder and os.path.lexists(dst) and not force:
        raise InputError(f"--output {dst}: the file exists; pass --force to replace it")
    device = _device(device)
    ck = _lib()
    committed: list = []
    try:
        res = ck.pack(src, dst, tuple(include) or None, tuple(exclude) or None, device=device, progress=lambda **kw: progress(unit="tensor", **kw),
                      on_commit=committed.append)
    except signals.Interrupted:
        if not committed:
            raise
        res = committed[0]   # the signal came after OUT was renamed into place: the pack is complete
    for w in res.warnings:
        click.echo(f"specpilot: warning: {w}", err=True)
    why = ([f"{len(res.skipped_not_bf16)} not bf16"] if res.skipped_not_bf16 else []) \
        + ([f"{len(res.skipped_empty)} empty"] if res.skipped_empty else []) \
        + ([f"{len(res.skipped_not_2d)} not 2-D"] if res.skipped_not_2d else [])
    data = {"schema": "specpilot.w12-pack/1", "input": src, "output": dst,
            "bits_per_weight": res.bits_per_weight, "escape_rate": res.escape_rate,
            "converted": len(res.converted), "already_w12": len(res.already), "kept": len(res.kept),
            "skipped_not_bf16": res.skipped_not_bf16, "skipped_empty": res.skipped_empty,
            "skipped_not_2d": res.skipped_not_2d, "warnings": res.warnings,
            "tensors": [t.__dict__ for t in res.converted]}
    rep = Report(data, [Section("converted tensors", ["tensor", "shape", "bits/weight", "escapes", "escape rate"],
                                _tensor_rows(res.converted))],
                 [f"wrote {dst}: {len(res.converted)} tensors converted"
                  + (f", {len(res.already)} already W12 (carried over as packed)" if res.already else "")
                  + f", {len(res.kept)} kept" + (f" ({', '.join(why)})" if why else "")
                  + f"; {res.bits_per_weight:.4f} bits/weight, escape rate {res.escape_rate:.3e}"]
                 + [f"not converted ({why}): {', '.join(names[:5])}" + (" ..." if len(names) > 5 else "")
                    for why, names in (("not bf16", res.skipped_not_bf16), ("empty", res.skipped_empty),
                                       ("not 2-D", res.skipped_not_2d)) if names],
                 title="W12 pack")
    try:
        emit(rep, fmt, out, protect=[src, dst])
    except signals.Interrupted as e:   # OUT is complete: a signal now does not make the pack a failure
        click.echo(f"specpilot: {e}; {dst} is complete, its report was not written", err=True)
    return 0


@command.command("verify")
@click.argument("packed", metavar="OUT", type=NonEmptyPath())
@click.option("--against", "against", type=NonEmptyPath(), default=None,
              help="The original checkpoint, compared bit for bit; without it each restored tensor is checked "
                   "against the sha256 pack recorded of the original, and CRCs and structure.")
@click.option("--device", default="auto", show_default=True, help="Where to restore: cuda, cpu or auto.")
@output_options
@_user_errors
def verify_cmd(packed, against, device, fmt, out):
    """Restore every W12 tensor of OUT and compare it bit for bit with --against IN.

    Without --against each restored tensor is checked against the sha256 of the original bf16
    bytes that pack recorded (and every stored part against its CRC-32). Exit 0 when every tensor
    (and every kept tensor) is identical, 1 on any difference or corrupted record, naming the
    tensor.
    """
    check_checkpoint(packed, packed=True)
    if against:
        check_checkpoint(against, original="--against")
    ck = _lib()
    res = ck.verify(packed, against, progress=lambda **kw: progress(unit="tensor", **kw), device=_device(device))
    data = {"schema": "specpilot.w12-verify/1", "packed": packed, "against": against, "ok": res.ok,
            "converted": res.converted, "kept": res.kept, "checked": len(res.checked),
            "kept_checked": res.kept_checked, "sha256_checked": res.digests, "missing": res.missing,
            "mismatches": [{"tensor": n, "what": w} for n, w in res.mismatched]}

    def of(n, total):   # "2", or "1 of 2" when some failed
        return f"{n}" if n == total else f"{n} of {total}"

    if against:
        summary = (f"{of(len(res.checked), res.converted)} converted tensors restored and identical to {against}, "
                   f"{of(res.kept_checked, res.kept)} kept tensors identical"
                   + (f"; {count(len(res.missing), 'tensor')} of {against} missing" if res.missing else ""))
    else:
        how = ("CRC, structure and the original's sha256" if res.digests == len(res.checked)
               else "CRC and structure only: packed without the original's sha256" if not res.digests
               else f"CRC and structure; {res.digests} of them against the original's sha256 too")
        summary = (f"{of(len(res.checked), res.converted)} converted tensors restored ({how}), "
                   f"{res.kept} kept tensors not compared")
    lines = [f"{'OK' if res.ok else 'FAILED'}: {summary}"]
    sections = []
    if res.mismatched:
        sections.append(Section("differences", ["tensor", "what"], [[n, w] for n, w in res.mismatched]))
    emit(Report(data, sections, lines, title="W12 verify"), fmt, out, protect=[packed] + ([against] if against else []))
    if not res.ok:
        n, w = res.mismatched[0]
        click.echo(f"specpilot: w12 verify failed: {n}: {w}"
                   + (f" (and {len(res.mismatched) - 1} more)" if len(res.mismatched) > 1 else ""), err=True)
        return 1
    return 0


@command.command("stats")
@click.argument("path", metavar="FILE", type=NonEmptyPath())
@output_options
@_user_errors
def stats_cmd(path, fmt, out):
    """Bits per weight (escapes and per-channel metadata included) and escape rate, per tensor and overall."""
    check_checkpoint(path, packed=True)
    ck = _lib()
    st = ck.stats(path)
    data = {"schema": "specpilot.w12-stats/1", "path": path, "bits_per_weight": st.bits_per_weight,
            "escape_rate": st.escape_rate, "weights": st.weights, "w12_bytes": st.stored_bytes,
            "bf16_bytes": 2 * st.weights, "other_bytes": st.other_bytes,
            "tensors": [t.__dict__ for t in st.tensors]}
    rows = _tensor_rows(st.tensors)
    rows.append(["(all W12 tensors)", f"{st.weights} weights", round(st.bits_per_weight, 4),
                 sum(t.escapes for t in st.tensors), float(f"{st.escape_rate:.3e}")])
    lines = [f"{st.bits_per_weight:.4f} bits/weight over {len(st.tensors)} tensors "
             f"({sizes(st.stored_bytes, 2 * st.weights)} bf16); "
             f"escape rate {st.escape_rate:.3e}"]
    emit(Report(data, [Section(None, ["tensor", "shape", "bits/weight", "escapes", "escape rate"], rows)], lines,
                title="W12 stats"), fmt, out, protect=[path])
    return 0


def sizes(stored: int, bf16: int) -> str:
    """"A vs B" for two byte counts in one unit, the larger's (bytes below 1 KiB, KiB below 1 MiB,
    else MiB), three significant digits or one decimal: a small file is not "0.1 MiB vs 0.1 MiB"."""
    if bf16 < 2**10:
        return f"{stored} bytes vs {bf16} bytes"
    div, unit = (2**10, "KiB") if bf16 < 2**20 else (2**20, "MiB")

    def one(n: int) -> str:
        v = n / div
        return f"{v:.1f}" if v >= 100 else f"{v:.3g}"

    return f"{one(stored)} {unit} vs {one(bf16)} {unit}"
