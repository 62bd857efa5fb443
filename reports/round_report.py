"""A round rendered for people: ``report.md`` (plots as PNG files beside it, in ``report/``) and
``report.html``, one self-contained page (CSS inline, plots embedded as base64 PNG).

Both come from one list of blocks built from the round's files (:func:`build`), so they say the
same thing: the deployment and what the round did with its budget; where a step's time goes
against the byte floors; tau(N), c(N) and the predicted speedup; the three factors; the candidates
and why the others cannot run here; each candidate's paired samples, interval and audit; the
memory changes; the files.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass
from pathlib import Path

from specpilot.auditors.round.plan import cut_for_time, unjudged_for_time
from specpilot.auditors.round.state import resume_command, stages_left
from specpilot.probes.costmodel import largest_factor_line

from . import round_plots as plots


@dataclass
class Block:
    kind: str                    # h1 | h2 | p | table | img | list
    text: str = ""
    headers: list | None = None
    rows: list | None = None
    image: bytes | None = None
    name: str = ""
    items: list | None = None


def _n(x, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def _command(state: dict) -> str:
    c = state.get("config") or {}
    parts = ["specpilot round", state.get("deployment") or "engine", f"--budget {_n(c.get('budget_min'))}",
             f"--out-dir {c.get('out_dir')}"]
    for key, flag in (("prompts", "--prompts"), ("n_prompts", "--n-prompts"), ("max_new_tokens", "--max-new-tokens"),
                      ("scorer", "--scorer"), ("memory_dir", "--memory-dir"), ("records_dir", "--records")):
        if c.get(key):
            parts.append(f"{flag} {c[key]}")
    if c.get("candidates"):
        parts.append("--candidates " + ",".join(c["candidates"]))
    for key, flag in (("control", "--control"), ("fresh", "--fresh")):
        if c.get(key):
            parts.append(flag)
    if c.get("remember") is False:
        parts.append("--no-remember")
    return " ".join(parts)


def _stage_state(name: str, v: dict) -> str:
    """What an unfinished stage's status means, with the time it ran."""
    secs = f"{_n(float(v.get('seconds') or 0.0), 3)} s"
    return {"interrupted": f"{name} was interrupted after {secs}",
            "failed": f"{name} stopped on an error after {secs}",
            "running": f"{name} was running when round.json was last written, {secs} in (the process was killed, "
                       "or is still running)",
            "not run": f"{name} was not run"}.get(v.get("status"), f"{name} has not finished")


def _judged(res, decs) -> str:
    """How many of the proposed candidates an unfinished round has judged."""
    if res.proposal is None or not res.proposal.candidates:
        return ""
    return f" ({len(decs)} of {len(res.proposal.candidates)} candidates judged)"


def build(res) -> list[Block]:
    """The report's blocks from a loaded round (:func:`specpilot.auditors.round.load_round`)."""
    st = res.state
    facts = st.get("facts") or {}
    decs = [d.to_json() for d in res.decisions]
    approved = [d for d in decs if d["verdict"] == "approved"]
    refused = [d for d in decs if d["verdict"] == "refused"]
    b: list[Block] = [Block("h1", f"SpecPilot round: {facts.get('model')} on {facts.get('gpu') or facts.get('cpu') or facts.get('device')}")]
    left = stages_left(st)
    verdicts = (f"approved: {', '.join(d['id'] for d in approved) or 'nothing'}; "
                f"refused: {', '.join(d['id'] for d in refused) or 'nothing'}")
    if left:   # an unfinished round's current system is not its final one, nor are its verdicts all
        folder = res.dir   # the folder rendered: a copied round is continued where it is, not where it was made
        how = "; ".join(_stage_state(s, (st.get("stages") or {})[s]) for s in left)
        summary = ("**The round stopped before it finished**: " + how + ". "
                   + (f"Why: {st['stopped']}. " if st.get("stopped") else "")
                   + f"Stages left: {', '.join(left)}; continue it with `{resume_command(st, folder)}`. "
                    f"So far {verdicts}{_judged(res, decs)}. The round started from `{st.get('start')}`; its current "
                    f"system so far is `{st.get('current')}` (no final system yet).")
    else:
        summary = (f"{verdicts[0].upper()}{verdicts[1:]}. The round started from `{st.get('start')}` and ends with "
                   f"`{st.get('final') or st.get('current')}`.")
    cut = cut_for_time(st)
    if cut:   # a finished round that ran short of time: what it did not measure, and what brings it back
        summary += (f" **Cut for time**: the measure stage skipped {'; '.join(cut)}; the round was judged without "
                    "it, and a new round with a larger `--budget` measures it.")
    if not left and unjudged_for_time(decs):
        summary += (f" **Out of budget**: the approve stage did not judge {', '.join(unjudged_for_time(decs))}; "
                    f"`specpilot round --resume {res.dir} --budget MINUTES` judges them.")
    b.append(Block("p", summary))
    resumed = "".join(f", resumed with `specpilot round --resume {res.dir}"
                      + (f" --budget {_n(r['budget_min'])}" if r.get("budget_min") is not None else "") + "`"
                      for r in st.get("resumes") or [])
    sessions = f" over its {1 + len(st['resumes'])} sessions" if st.get("resumes") else ""
    # a round killed before its end (or a platform without a load average) has none recorded there
    la_start, la_end = (st.get(k) if st.get(k) is not None else "not recorded"
                        for k in ("load_average_start", "load_average_end"))
    b.append(Block("p", f"Made by `{_command(st)}`{resumed} ({_n(st.get('spent_s', 0) / 60, 3)} of "
                        f"{_n(st.get('budget_s', 0) / 60, 3)} minutes{sessions}; load average "
                        f"{la_start} at the start, {la_end} at the end)."))
    # deployment
    b.append(Block("h2", "Deployment"))
    rows = [[k, _n(v)] for k, v in facts.items() if v not in (None, "")]
    rows += [["stock", f"`{st.get('stock')}`"], ["start", f"`{st.get('start')}`"],
             ["final", f"`{st.get('final') or st.get('current')}`" if not left
              else f"- (the round has not finished; current so far: `{st.get('current')}`)"]]
    vers = st.get("versions") or {}
    rows.append(["versions", ", ".join(f"{k} {v}" for k, v in vers.items() if v)])
    b.append(Block("table", headers=["fact", "value"], rows=rows))
    for n in st.get("notes") or []:
        b.append(Block("p", n))
    b.append(Block("table", headers=["stage", "status", "seconds", "notes", "skipped"],
                   rows=[[s, v["status"], _n(v.get("seconds"), 3), "; ".join(v.get("notes") or []) or "-",
                          "; ".join(v.get("skipped") or []) or "-"] for s, v in (st.get("stages") or {}).items()]))
    # stage 1
    m = res.measurement
    b.append(Block("h2", "1. Re-measure"))
    if m is None:
        b.append(Block("p", "Not measured."))
    else:
        cal = m.calibration or {}
        speed = (f"{_n(m.tokens_per_s, 4)} tokens/s in a calibration run ({cal.get('tokens')} tokens)"
                 if cal.get("tokens") else   # an SGLang deployment: no engine of its own to calibrate
                 "no calibration run (its decode speed is measured by the stock server at the start of stage 4)")
        at = f"at context {m.context}" if m.context is not None else "at a context its rows probe does not record"
        b.append(Block("p", f"Current system `{m.system}`: {speed}. T_AR = {_n(m.ar_ms, 4)} ms; T_step(N) {at} "
                            f"({m.rows_method or 'not measured'}):"))
        if m.step_ms:
            b.append(Block("table", headers=["rows", "T_step ms", "c = T_step / T_AR"],
                           rows=[[r, _n(v), _n(v / m.ar_ms if m.ar_ms else None)] for r, v in sorted(m.step_ms.items())]))
        if m.replay:
            lat = m.lattice or {}
            # the round's own recording knows its run shape; a deployment's lattice files say only their steps
            source = (f"Lattice recorded on {lat['prompts']} prompts x {lat['max_new_tokens']} new tokens"
                      if lat.get("prompts") is not None and lat.get("max_new_tokens") is not None
                      else f"Lattice from {', '.join(lat['files'])}" if lat.get("files") else "Lattice")
            b.append(Block("p", f"{source}: {m.replay['steps']} verify steps, m = {m.replay['positions']} positions x "
                                f"K = {m.replay['candidates']} candidates; replayed (tau = accepted + 1, 95% intervals "
                                "resample requests):"))
            b.append(Block("table", headers=["policy", "nodes", "tau", "95% CI"],
                           rows=[[p["policy"], _n(p["nodes"]), _n(p["tau"]),
                                  f"[{p['tau_ci'][0]:.3f}, {p['tau_ci'][1]:.3f}]" if p.get("tau_ci") else "-"]
                                 for p in m.replay["policies"]]))
        if m.profile:
            p = m.profile
            b.append(Block("p", f"Profile of {p.get('steps')} decode steps of the current system "
                                f"({(p.get('gpu') or {}).get('name')}): step wall {_n(p.get('step_wall_ms'))} ms, GPU busy "
                                f"{_n(p.get('kernel_busy_ms'))} ms, byte floor {_n(p.get('total_floor_ms'))} ms."))
            b.append(Block("img", name="step_breakdown", image=plots.step_breakdown(p),
                           text="step breakdown against the byte floors per class"))
            b.append(Block("table", headers=["class", "ms per step", "floor ms", "efficiency (floor / measured)"],
                           rows=[[k, _n(v.get("ms")), _n(v.get("floor_ms")), _pct(v.get("efficiency"))]
                                 for k, v in (p.get("classes") or {}).items() if v.get("ms") or v.get("floor_ms")]))
            for note in p.get("notes") or []:   # how the classes were counted (e.g. kernels overlapping under PDL)
                if isinstance(note, str):
                    b.append(Block("p", f"Note: {note}"))
        for s in m.skipped or []:
            b.append(Block("p", f"Skipped: {s}"))
    # stage 2
    mo = res.model
    b.append(Block("h2", "2. Model"))
    if mo is None:
        b.append(Block("p", "No model."))
    else:
        cm = mo.cost_model or {}
        cur = mo.current
        # the factor to attack in the words of specpilot ceiling (none offers a gain when each is 1)
        factor = largest_factor_line(mo.largest, mo.factors or {}, name=lambda f: f"**{f}**")
        b.append(Block("p", f"Current system: tau {_n(cur.get('tau'))}, c {_n(cur.get('c'))}, speedup over AR "
                            f"{_n(cur.get('speedup'))}"
                            + (f"; ceiling {_n(cm.get('ceiling'))}x over AR. " if cm.get("ceiling") else ". ")
                            + (factor or "Largest factor: unknown.")))
        b.append(Block("table", headers=["factor", "value", "speedup if removed", "source"],
                       rows=[[k, _n(v), _n((cm.get("speedup_if_removed") or {}).get(k)),
                              {"tree": mo.sources.get("tau_best"), "kernel": mo.sources.get("floor_ms"),
                               "outside": mo.sources.get("profile_ms")}.get(k) or "-"]
                             for k, v in (mo.factors or {}).items()]))
        b.append(Block("img", name="factors", image=plots.factors(mo.to_json()), text="the three factors"))
        if mo.by_nodes:
            b.append(Block("img", name="tau_c", image=plots.tau_c(mo.to_json(), mo.current),
                           text="tau(N), c(N) and the predicted speedup"))
            b.append(Block("table", headers=["family", "nodes N", "mean rows verified", "tau(N)", "c(N)", "predicted speedup"],
                           rows=[[r["family"], r["nodes"], _n(r["rows"], 3), _n(r["tau"]), _n(r["c"]), _n(r["speedup"])]
                                 for r in mo.by_nodes]))
        for n in mo.notes:
            b.append(Block("p", f"Note: {n}"))
    # stage 3
    pr = res.proposal
    b.append(Block("h2", "3. Propose"))
    if pr is None:
        b.append(Block("p", "No proposals."))
    else:
        b.append(Block("p", f"Order: {pr.order}."))
        b.append(Block("table", headers=["candidate", "memory entry", "attacks", "system", "retuned", "predicted gain"],
                       rows=[[c.id, c.memory or "-", c.attacks or "-", f"`{c.system}`", c.retuned or "-",
                              _n(c.predicted_gain)] for c in pr.candidates]))
        if pr.not_proposed:
            b.append(Block("p", "Not runnable here:"))
            b.append(Block("table", headers=["candidate", "memory entry", "reason"],
                           rows=[[x["id"], x.get("memory") or "-", x["reason"]] for x in pr.not_proposed]))
    # stage 4
    b.append(Block("h2", "4. Approve"))
    if "approve" in left and pr is not None and pr.candidates:
        judged = {d["id"] for d in decs}
        b.append(Block("p", f"The stage did not finish: {len(judged)} of {len(pr.candidates)} candidates judged so far"
                            + (" (below)" if decs else "") + "; not judged yet: "
                            + ", ".join(c.id for c in pr.candidates if c.id not in judged) + "."))
    if not decs:
        b.append(Block("p", "No candidate was judged."))
    else:
        rows = []
        for d in decs:
            t, a = d.get("timing") or {}, d.get("audit") or {}
            sysrow = next((s for s in a.get("systems", []) if s.get("role") == "system"), {})
            stock = next((s for s in a.get("systems", []) if s.get("role") == "stock"), {})
            rows.append([d["id"], d["verdict"].upper(), _n(t.get("gain")),
                         f"[{t['ci_low']:.4f}, {t['ci_high']:.4f}]" if t else "-",
                         f"{t['t_ci'][0]:.4f}" if t and t.get("t_ci") else "-",
                         _n(1 + t["threshold"]) if t else "-", _pct(t.get("noise")), _n(t.get("runs")),
                         _n(t.get("outputs_identical")),
                         (a.get("verdict") or "-").upper(),
                         f"{_pct(sysrow.get('mismatch_rate'))} vs {_pct(stock.get('mismatch_rate'))}" if a else "-",
                         _n(sysrow.get("events"))])
        # both lower bounds must clear the threshold: the table shows both, as the verdicts quote the lower
        b.append(Block("table", headers=["candidate", "verdict", "gain", "95% CI (bootstrap)", "t lower bound",
                                         "threshold", "noise", "pairs", "outputs identical", "audit",
                                         "mismatch vs stock", "events"], rows=rows))
        b.append(Block("list", items=[f"**{d['id']}**: {d['reason']}" for d in decs]))
        b.append(Block("img", name="candidates", image=plots.candidates(decs), text="paired samples per candidate"))
        b.append(Block("img", name="audit", image=plots.audit(decs), text="audit mismatch rates"))
    # stage 5
    b.append(Block("h2", "5. Remember"))
    changes = _read(res.dir / "remember" / "changes.json")
    if changes:
        b.append(Block("p", f"Deployment record `{changes['record']}`: current system "
                            f"`{changes['before']['current'] or '(none: first round)'}` -> `{changes['after']['current']}`, "
                            f"{changes['after']['rounds']} round(s) recorded."))
        rec = _read_yaml(res.dir / "remember" / "record.yaml")
        last = ((rec or {}).get("rounds") or [{}])[-1]
        for a in last.get("approved", []):
            b.append(Block("p", f"Approved **{a['id']}** (memory entry {a.get('memory') or 'none'}): gain "
                                f"{_n(a.get('gain'))}, unverified: " + "; ".join(a.get("unverified") or ["-"])))
    else:
        b.append(Block("p", "Nothing recorded: " + "; ".join((st.get("stages") or {}).get("remember", {}).get("skipped")
                                                             or ["the stage did not run"])))
    b.append(Block("h2", "Files"))
    files = sorted(str(p.relative_to(res.dir)) for p in res.dir.rglob("*")
                   if p.is_file() and not p.name.startswith(".") and not str(p.relative_to(res.dir)).startswith("report"))
    b.append(Block("list", items=[f"`{f}`" for f in files]))
    return b


def _read(path: Path):
    import json

    return json.loads(path.read_text()) if path.is_file() else None


def _read_yaml(path: Path):
    import yaml

    return yaml.safe_load(path.read_text()) if path.is_file() else None


def to_markdown(blocks: list[Block], image_dir: str = "report") -> tuple[str, dict[str, bytes]]:
    from tabulate import tabulate

    out, images = [], {}
    for bl in blocks:
        if bl.kind == "h1":
            out.append(f"# {bl.text}\n")
        elif bl.kind == "h2":
            out.append(f"## {bl.text}\n")
        elif bl.kind == "p":
            out.append(bl.text + "\n")
        elif bl.kind == "list":
            out.append("\n".join(f"- {x}" for x in bl.items) + "\n")
        elif bl.kind == "table":
            out.append(tabulate([[str(c).replace("|", "\\|") for c in r] for r in bl.rows], headers=bl.headers,
                                tablefmt="github", disable_numparse=True) + "\n")
        elif bl.kind == "img":
            images[f"{bl.name}.png"] = bl.image
            out.append(f"![{bl.text}]({image_dir}/{bl.name}.png)\n")
    return "\n".join(out), images


def _inline(text: str) -> str:
    """Escape, then `code` and **bold** as in the Markdown."""
    import re

    t = html.escape(text)
    # a command wraps between its words only: a browser would break "--records" after a hyphen
    t = re.sub(r"`([^`]+)`", lambda m: "<code>" + " ".join(f"<span>{w}</span>" for w in m.group(1).split(" "))
               + "</code>", t)
    return re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", t)


CSS = """body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1180px;margin:24px auto;
padding:0 16px;color:#222;line-height:1.45}h1{font-size:1.5em}h2{font-size:1.2em;border-bottom:1px solid #ddd;
padding-bottom:4px;margin-top:1.6em}table{border-collapse:collapse;margin:8px 0 14px;font-size:0.86em}
td,th{border:1px solid #ccc;padding:3px 7px;text-align:left;vertical-align:top}th{background:#f3f3f3}
code{background:#f4f4f4;padding:0 3px;font-size:0.92em}code span{white-space:nowrap}img{max-width:100%;display:block;margin:6px 0 14px}
li{margin:3px 0}"""


def to_html(blocks: list[Block], title: str) -> str:
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
           f"<style>{CSS}</style></head><body>"]
    for bl in blocks:
        if bl.kind in ("h1", "h2"):
            out.append(f"<{bl.kind}>{_inline(bl.text)}</{bl.kind}>")
        elif bl.kind == "p":
            out.append(f"<p>{_inline(bl.text)}</p>")
        elif bl.kind == "list":
            out.append("<ul>" + "".join(f"<li>{_inline(x)}</li>" for x in bl.items) + "</ul>")
        elif bl.kind == "table":
            head = "".join(f"<th>{_inline(str(h))}</th>" for h in bl.headers)
            body = "".join("<tr>" + "".join(f"<td>{_inline(str(c))}</td>" for c in r) + "</tr>" for r in bl.rows)
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif bl.kind == "img":
            data = base64.b64encode(bl.image).decode("ascii")
            out.append(f"<img alt='{html.escape(bl.text)}' src='data:image/png;base64,{data}'>")
    out.append("</body></html>")
    return "\n".join(out)


def write_report(round_dir: str | Path) -> tuple[Path, Path]:
    """Render the round in ``round_dir``: ``report.md`` (+ ``report/*.png``) and ``report.html``."""
    from specpilot.auditors.round import load_round
    from specpilot.fileio import atomic_open, write_text_atomic

    res = load_round(round_dir)
    d = Path(round_dir)
    if (d / "report").exists() and not (d / "report").is_dir():
        from specpilot.errors import InputError

        raise InputError(f"{d / 'report'}: not a folder; the report's plots go in it (move that file away, then run "
                         f"specpilot report {d})")
    blocks = build(res)
    md, images = to_markdown(blocks)
    (d / "report").mkdir(exist_ok=True)
    for name, data in images.items():
        with atomic_open(d / "report" / name, "wb", option="report file") as fh:   # no option chose them
            fh.write(data)
    write_text_atomic(d / "report.md", md, option="report file")
    write_text_atomic(d / "report.html", to_html(blocks, blocks[0].text), option="report file")
    return d / "report.md", d / "report.html"
