"""``specpilot status``: what is active in an SGLang environment and whether it still matches."""

from __future__ import annotations

import json
import shlex

import click

from specpilot.output import Report, Section, emit, output_options


@click.command("status")
@click.option("--python", "python", default=None, metavar="PATH",
              help="Interpreter of the SGLang environment (default: this one).")
@output_options
def command(python, fmt, out):
    """Show the active bundles in the environment of --python and check they still match.

    Re-runs the static check of every hook target against the installed SGLang and compares the
    installed version, the target files and the bundle modules with what was recorded at apply.
    Exit 0 when nothing is active or everything matches, 1 when the activation no longer matches
    (apply again or revert).

    \b
    Example:
      specpilot status --python /opt/sglang/bin/python
    """
    from specpilot.bundles.activation import status

    res = status(python, out=out)
    act = res.activation
    data = {"schema": "specpilot.status/1", "activation_path": res.path, "active": act is not None,
            "matches": res.matches, "problems": res.problems,
            "sglang": {"version": res.env.sglang_version, "package": res.env.sglang_package},
            "specpilot_installed": res.env.specpilot_version, "activation": act,
            "checks": [c.__dict__ for c in res.checks], "launch": res.launch}
    if act is None:
        if res.env.sglang_package is None:
            sglang = "SGLang is not installed there"
        else:
            sglang = f"SGLang {res.env.sglang_version or '(unknown version)'} runs stock"
        lines = [f"no bundles active ({res.path} absent); {sglang}"]
        emit(Report(data=data, lines=lines), fmt, out, protect=[res.path])
        return 0
    sections = [Section("active", ["bundles", "applied", "SGLang then", "SGLang now", "matches"],
                        [[", ".join(act.get("closure", [])), act.get("applied_at"), act.get("sglang", {}).get("version"),
                          res.env.sglang_version, "yes" if res.matches else "NO"]]),
                Section("hook targets", ["target", "kind", "check"],
                        [[c.target, c.kind, "ok" if c.ok else "FAIL"] for c in res.checks])]
    if res.matches:
        lines = ["the activation matches the installed SGLang", "", "launch with:", f"  {res.launch}"]
    else:   # its launch command would start a server whose hooks may not hold: what to do instead
        where = f" --python {shlex.quote(python)}" if python else ""
        lines = [f"problem: {p}" for p in res.problems]
        # apply needs SGLang and SpecPilot in that environment: where either is gone, say so first
        gone = [name for name, v in (("SGLang", res.env.sglang_package), ("SpecPilot", res.env.specpilot_version))
                if v is None]
        first = f"install {' and '.join(gone)} there again, then " if gone else ""
        unchecked = unchecked_version(act, res.env.sglang_version)
        # apply run by this SpecPilot refuses an environment whose SpecPilot differs: that one's own runs as printed
        cmd, left_out = reapply_command(act, python, unchecked, own=res.env.executable if res.differs else None)
        failed = [c.target for c in res.checks if not c.ok]
        if failed:   # apply checks the same targets first: applying again would be refused
            lines += ["", f"do not launch with this activation; {len(failed)} hook target(s) no longer match this "
                          "SGLang, and apply checks them first, so applying again would be refused too (a SpecPilot "
                          "whose bundles fit this SGLang may apply them); remove it:", f"  specpilot revert{where}"]
        elif cmd is None:   # none of its bundles is in this SpecPilot's memory: nothing to apply again
            lines += ["", f"do not launch with this activation; this SpecPilot knows none of its bundles "
                          f"({', '.join(left_out)}); remove it:", f"  specpilot revert{where}"]
        else:
            lines += ["", f"do not launch with this activation; {first}apply it again to this environment:",
                      f"  {cmd}"]
            if left_out:
                lines.append(f"  (left out, as this SpecPilot's memory would refuse them: {', '.join(left_out)})")
            if unchecked and not (act.get("sglang") or {}).get("forced"):
                lines.append(f"  (--force: the bundles were not checked against SGLang {res.env.sglang_version}; "
                             "apply runs the static target check first)")
            lines += ["or remove it:", f"  specpilot revert{where}"]
    emit(Report(data=data, sections=sections, lines=lines, title="specpilot status"), fmt, out, protect=[res.path])
    return 0 if res.matches else 1


def _memory():
    from specpilot.bundles import memory as mem

    try:
        return mem.load_memory()
    except Exception:   # the suggestion is still useful without it
        return {}


def _experimental(act: dict, entries: dict) -> bool:
    """Whether applying ``act``'s bundles needs --experimental: recorded, or what the memory says now."""
    if isinstance(act.get("experimental"), bool):
        return act["experimental"]
    return any(entries[i].status == "experimental" for i in act.get("closure", []) if i in entries)


def unchecked_version(act: dict, version: str | None) -> bool:
    """Whether SGLang ``version`` (installed now) is one none of ``act``'s bundles was checked
    against, so that applying them again needs --force."""
    entries = _memory()
    checked = {v for i in act.get("closure", []) if i in entries for v in entries[i].sglang_checked}
    return version is not None and bool(checked) and version not in checked


def reapply_command(act: dict, python: str | None, unchecked: bool = False,
                    own: str | None = None) -> tuple[str | None, list[str]]:
    """The ``specpilot apply`` command that writes ``act`` again (``own``: the environment's interpreter,
    for its own ``OWN -m specpilot apply ...`` without --python): its bundles, --python, the drafter
    the launch was written for, the model, --experimental where a bundle is experimental, --force
    where it was forced or where the installed SGLang is one the bundles were not checked against
    (``unchecked``: :func:`unchecked_version`), and every setting that is not the variant's default;
    every word shell-quoted.
    With what it leaves out because apply would refuse it here (a bundle this SpecPilot's memory
    lacks, a setting none of the bundles has or a value its variant refuses); None for the command
    when no bundle is left (or the memory cannot be read)."""
    from specpilot.bundles.activation import launch_model

    from specpilot.bundles import memory as mem

    entries = _memory()
    bundles = list(dict.fromkeys(b for b in (act.get("bundles") or act.get("closure", [])) if isinstance(b, str)))
    left_out = [f"bundle {b}" for b in bundles if b not in entries]
    bundles = [b for b in bundles if b in entries]
    if not bundles:
        return None, left_out
    try:
        ids = mem.closure(entries, bundles)
    except Exception:   # a requirement this memory lacks: apply names it
        ids = bundles
    words = ([own, "-m"] if own else []) + ["specpilot", "apply", ",".join(bundles)]
    if python and not own:
        words += ["--python", python]
    drafter = act.get("drafter")
    if drafter and mem.composition_problems(entries, ids, drafter):   # apply would refuse the bundles on it
        left_out.append(f"--drafter {drafter}")
        drafter = None
    if drafter:
        words += ["--drafter", drafter]
    model = launch_model(act)
    if model and model != "MODEL":
        words += ["--model", model]
    if _experimental(act, entries):
        words.append("--experimental")
    if (act.get("sglang") or {}).get("forced") or unchecked:
        words.append("--force")
    variants = {v.name: v for i in act.get("closure", []) if i in entries for v in entries[i].variants}
    kept = {}
    for k, v in (act.get("settings") or {}).items():
        text = f"{k}={v if isinstance(v, str) else json.dumps(v)}"
        if k not in variants or variants[k].problem(v):
            left_out.append(f"setting {text}")
            continue
        if variants[k].default == v and type(variants[k].default) is type(v):   # apply sets the default itself
            continue
        kept[k] = text
    # values valid one by one that a bundle refuses together (its settings check): that bundle's left out
    values = {k: (act.get("settings") or {})[k] for k in kept}
    try:
        together = mem.settings_problems(entries, ids, values, drafter)
        owners = {p.split(":", 1)[0] for p in together}
        registry = mem.variant_registry(entries, ids) if together else {}
    except Exception:   # the settings check of a bundle this memory has changed: apply will say
        owners, registry = set(), {}
    for k, text in kept.items():
        if k in registry and registry[k][0] in owners:
            left_out.append(f"setting {text}")
        else:
            words += ["--set", text]
    return " ".join(shlex.quote(w) for w in words), left_out
