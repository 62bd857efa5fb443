"""``specpilot memory``: the memory of verified mechanisms (list, show, verify)."""

from __future__ import annotations

from pathlib import Path

import click

from specpilot.errors import InputError
from specpilot.options import NonEmptyPath
from specpilot.output import Report, Section, emit, output_options

_memdir = click.option("--memory-dir", "memory_dir", type=NonEmptyPath(file_okay=False), default=None,
                       help="Read entries from this folder instead of the packaged memory.")


@click.group("memory")
def command():
    """The memory of verified mechanisms: one YAML entry per mechanism (paper 3.5).

    \b
    Examples:
      specpilot memory list
      specpilot memory show tree
      specpilot memory verify            # the survival rule, exit 1 if an entry drifted
    """


def _load(memory_dir, verb: str):
    """The memory's entries; a folder without any is bad input where an entry is looked for or
    verified (verifying nothing must not read as a pass; `list` says the folder is empty)."""
    from specpilot.bundles import memory as mem

    entries = mem.load_memory(memory_dir)
    if not entries:
        raise InputError(f"{memory_dir or mem.MEMORY_DIR}: no entries (*.yaml) to {verb}")
    return entries


def _inputs(memory_dir, out, *more) -> list[str]:
    """The memory folder (and ``more``) an --out must not overwrite; checked now, before any work."""
    from specpilot.bundles import memory as mem

    inputs = [str(memory_dir or mem.MEMORY_DIR)] + [str(m) for m in more if m]
    if out:
        from specpilot.fileio import check_output_path, refuse_inside

        refuse_inside(out, inputs[0], "the memory folder", "which holds its entries only")   # a new file too
        check_output_path(out, "--out", protect=inputs)
    return inputs


def _first_words(text: str, width: int = 64) -> str:
    text = text.split(": ")[0] if len(text.split(": ")[0]) < width else text
    return text if len(text) <= width else text[: text.rfind(" ", 0, width - 4)] + " ..."


@command.command("list")
@_memdir
@output_options
def list_(memory_dir, fmt, out):
    """List the entries: id, status, requirements, hooks, SGLang versions checked."""
    from specpilot.bundles import memory as mem

    inputs = _inputs(memory_dir, out)
    entries = mem.load_memory(memory_dir)
    rows = [[e.id, e.status, ", ".join(e.requires) or "-", len(e.hooks), ", ".join(e.sglang_checked) or "-",
             _first_words(e.summary)] for e in entries.values()]
    data = {"schema": "specpilot.memory-list/1",
            "entries": [{"id": e.id, "status": e.status, "requires": e.requires, "hooks": len(e.hooks),
                         "sglang_checked": e.sglang_checked, "summary": e.summary} for e in entries.values()]}
    lines = [] if entries else [f"no entries (*.yaml) in {memory_dir or 'the packaged memory'}"]
    emit(Report(data=data, sections=[Section(None, ["id", "status", "requires", "hooks", "sglang", "summary"], rows)],
                lines=lines), fmt, out, protect=inputs)
    return 0


@command.command("show")
@click.argument("entry_id", metavar="ID")
@_memdir
@output_options
def show(entry_id, memory_dir, fmt, out):
    """Show one entry in full: code, hooks, variants, contracts, evidence, limits, unverified."""
    from specpilot.bundles import memory as mem

    inputs = _inputs(memory_dir, out)
    entries = _load(memory_dir, "show")
    e = mem.get_entry(entries, entry_id)
    sections = [
        Section("hooks", ["type", "target", "handler"], [[h.type, h.target, h.handler] for h in e.hooks]),
        Section("variants", ["name", "default", "range/choices", "drafters", "meaning"],
                [[v.name, v.default, v.range or v.choices or "-", ", ".join(v.drafters) or "any", v.doc]
                 for v in e.variants], wrap=[None, None, None, None, 60]),
        Section("evidence", ["kind", "what", "where"],
                [[ev.get("kind"), " ".join(str(ev.get("what", "")).split()), ev.get("deployment") or ev.get("hardware")]
                 for ev in e.evidence], wrap=[None, 80, 40]),
    ]
    lines = [f"status: {e.status}; requires: {', '.join(e.requires) or 'nothing'}; "
             f"SGLang checked: {', '.join(e.sglang_checked) or 'none'}",
             f"modules: {', '.join(e.modules) or '-'}; uses: {', '.join(e.uses) or '-'}"
             + (f"; setup: {e.setup}" if e.setup else "")]
    lines += [f"off beside {o.bundle}" + (f" with {', '.join(o.drafters)}" if o.drafters else "")
              + (f": {o.why}" if o.why else "") for o in e.off_with]
    for title, items in (("contracts", e.contracts), ("limits", e.limits), ("unverified", e.unverified)):
        lines += ["", f"{title}:"] + [f"  - {x}" for x in items]
    data = {"schema": "specpilot.memory-entry/1", **{k: v for k, v in e.raw.items() if k != "schema"}}
    emit(Report(data=data, sections=sections, lines=lines, title=f"{e.id}: {e.summary}", wrap=120), fmt, out,
         protect=inputs)
    return 0


@command.command("verify")
@click.argument("ids", nargs=-1, metavar="[ID]...")
@click.option("--results", "results_dir", type=NonEmptyPath(file_okay=False), default=None,
              help="Benchmark results folder the evidence is generated from (default: benchmarks/results "
                   "of the checkout SpecPilot runs from).")
@click.option("--python", "python", default=None, metavar="PATH",
              help="Also check every entry's hook targets statically against the SGLang of this interpreter.")
@click.option("--record", is_flag=True,
              help="Maintainers: rewrite each entry's recorded system and evidence to the current ones, only "
                   "when every entry verifies as it would be recorded (else nothing is written, exit 1).")
@_memdir
@output_options
def verify(ids, python, record, results_dir, memory_dir, fmt, out):
    """Apply each entry with its requirements to stock and check it reproduces its recorded system,
    and that its evidence is what the benchmark results files say.

    The recorded system is the hook set and the sha256 of every module the entry and its
    requirements add. An entry whose code changed since it was verified fails (exit 1), so does
    one whose measured evidence is stale (its text no longer matches its results file) or quotes
    figures without a results file; a requirement cycle or a missing requirement is an error
    (exit 2). With --python, every entry's hook targets are also checked (statically) against
    that environment's SGLang. --record computes each entry's new recorded system and evidence,
    verifies the entries as they would read, and writes them only when every one passes; otherwise
    it writes nothing and exits 1 with what failed.
    """
    from specpilot.bundles import evidence as ev
    from specpilot.bundles import memory as mem
    from specpilot.fileio import write_text_atomic

    twice = next((i for n, i in enumerate(ids) if i in ids[:n]), None)
    if twice is not None:   # it would be verified, and recorded, twice
        raise InputError(f"{twice!r} is named twice in {' '.join(ids)!r}")
    results = Path(results_dir) if results_dir else ev.default_results_dir()
    if results_dir and not results.is_dir():
        raise InputError(f"--results {results_dir}: no such folder")
    inputs = _inputs(memory_dir, out, results, python)   # --python: the interpreter it runs is read too
    env = _target(python, out) if python is not None else None
    entries = _load(memory_dir, "verify")
    texts = []
    if record:   # every entry's new text first, checked and verified as it would read before any file is written
        new = dict(entries)
        for i in ids or sorted(entries):
            e = mem.get_entry(entries, i)
            text = mem.record_system(e, entries)
            text = ev.record(e, results, text) if results is not None else text
            texts.append((e.path, text))
            new[e.id] = mem.parse_entry_text(text, e.path)   # as load_memory would read the file
        mem.check_relations(new)
        entries = new
    rows, system_ok, evidence = _verify_rows(entries, ids, results, env)
    ok = all(r.ok for r in rows)
    lines = [f"{r.id}: {p}" for r in rows for p in r.problems]
    if record and ok:
        for path, text in texts:
            write_text_atomic(path, text)
        lines.append(f"recorded {len(texts)} entr{'y' if len(texts) == 1 else 'ies'}")
    elif record:
        lines.append("nothing recorded: an entry fails verification as it would be recorded; every entry file "
                     "is as it was")
    data = {"schema": "specpilot.memory-verify/1", "ok": ok, "recorded": bool(record and ok),
            "evidence_checked_against": str(results) if results is not None else None,
            "entries": [{**r.__dict__, "system": "reproduced" if system_ok[r.id] else "not reproduced",
                         "evidence": evidence[r.id].status} for r in rows]}
    # what failed is said in the lines below the table (code drift, stale or missing evidence, SGLang)
    table = [[r.id, " + ".join(r.closure), r.hooks, "reproduced" if system_ok[r.id] else "NOT REPRODUCED",
              evidence[r.id].status if evidence[r.id].ok else evidence[r.id].status.upper()] for r in rows]
    if results is None:
        lines.append("evidence not checked against results files: no benchmarks/results here (give --results DIR)")
    emit(Report(data=data, sections=[Section(None, ["id", "applied with requirements", "hooks", "system", "evidence"], table)],
                lines=lines), fmt, out, protect=inputs)
    return 0 if ok else 1


def _target(python: str, out: str | None):
    """The environment of ``--python`` with SGLang in it; an ``--out`` that is a file of it (its site-packages,
    SGLang's package or metadata, the activation file) is refused first, as apply, status and revert do."""
    from specpilot.bundles.activation import activation_path, refuse_report_on_target, require_sglang
    from specpilot.bundles.sglang_env import probe

    env = probe(python)
    refuse_report_on_target(out, activation_path(env.purelib), env)
    require_sglang(env)
    return env


def _verify_rows(entries, ids, results, env):
    """(rows, system reproduced per id, evidence check per id) of ``entries``' survival rule, their
    evidence against ``results`` and, with ``env`` (a :func:`_target`), their hook targets against its SGLang."""
    from specpilot.bundles import evidence as ev
    from specpilot.bundles import memory as mem

    rows = mem.verify(entries, ids or None)
    # the system (hooks, module hashes, SGLang's targets) and the evidence (results files) are
    # judged apart: evidence missing from a results folder is not code that drifted
    system_ok = {r.id: r.ok for r in rows}
    evidence = {r.id: ev.check(entries[r.id], results) for r in rows}
    for r in rows:
        if not evidence[r.id].ok:
            r.problems += evidence[r.id].problems
            r.ok = False
    if env is not None:
        from specpilot.bundles.inspect_sglang import check_targets

        for r in rows:
            if entries[r.id].status == "library":
                continue
            hooks = mem.hooks_of(entries, r.closure)
            symbols = [s for i in r.closure for s in entries[i].symbols]
            for c in check_targets(env.sglang_root, hooks, symbols):
                if not c.ok:
                    r.problems.append(f"SGLang {env.sglang_version}: {c.target}: {c.problem}")
                    r.ok = system_ok[r.id] = False
    return rows, system_ok, evidence
