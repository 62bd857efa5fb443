"""``specpilot replay``: exact tau replay of draft-tree policies over a recorded lattice."""

from __future__ import annotations

import click

from specpilot.options import seed_option, NonEmptyPath
from specpilot.output import Report, Section, count, emit, output_options


@click.command("replay")
@click.argument("lattice", type=NonEmptyPath(dir_okay=False))
@click.option("--policy", "policies", multiple=True, metavar="P",
              help="chain | chain:N | best-first:N | marginal:N | shared:N | adaptive:N | eagle2:TOPK,DEPTH,N | "
                   "sequoia:N | oracle:K | tlv:N (a lattice from run --mode tlv --nodes N); shared:N and adaptive:N "
                   "replay run --batch with block=fixed and the default block=adaptive; repeatable, or several in "
                   "one (best-first:32,marginal:32). Default: chain, best-first:32, oracle:K, and tlv:N on a "
                   "lattice from run --mode tlv --nodes N.")
@click.option("--nodes", default=None, metavar="N,N,...",
              help="Also give tau(N) curves at these node budgets for every policy with a budget "
                   "(e.g. 8,16,32,63, or a series as --rows takes: 8,16,24,...,64; read by 'specpilot ceiling "
                   "--replay').")
@click.option("--calibrate", "calibration", type=NonEmptyPath(dir_okay=False), default=None,
              help="Lattice to measure sequoia's acceptance by rank on (default: LATTICE itself); only with a "
                   "sequoia:N policy.")
@click.option("--bootstrap", "n_boot", type=click.IntRange(100, 100000), default=1000, show_default=True,
              help="Bootstrap resamples (over requests) for the 95% tau interval.")
@seed_option("the bootstrap intervals")
@output_options
def command(lattice, policies, nodes, calibration, n_boot, seed, fmt, out):
    """Replay draft-tree policies over LATTICE (specpilot.lattice/1 JSONL) and report tau.

    Greedy verification is exact, so the tokens a tree would have accepted follow from what the
    drafter proposed and what the target committed: no GPU needed. tau = accepted + 1, averaged
    over steps; the 95% interval resamples requests (steps of one request are correlated).

    \b
    Example:
      specpilot replay run.lattice.jsonl --policy chain --policy best-first:32 \\
          --policy eagle2:4,8,32 --policy sequoia:32 --policy oracle:16 --nodes 8,16,32,63
    """
    from specpilot.auditors.policies import parse_policy, split_policies
    from specpilot.auditors.replay import (default_policies, mix_warnings, parse_nodes, read_lattice, replay,
                                           tlv_hint, total_work, transitions_share)
    from specpilot.errors import InputError
    from specpilot.output import progress

    node_list = parse_nodes(nodes)
    if any(not text.strip() for text in policies):
        raise InputError("--policy: empty; give a policy, e.g. --policy best-first:32")
    pols_spec = [p for text in policies for p in split_policies(text)]
    parsed = [parse_policy(p) for p in pols_spec]  # fail fast on a typo, before reading the file
    parsed = list({p.spec: p for p in parsed}.values())   # a policy given twice replays once
    if calibration and not any(p.family == "sequoia" for p in parsed):   # the defaults have no sequoia
        raise InputError("--calibrate is read by sequoia:N only; add --policy sequoia:N or leave it out")
    lat = read_lattice(lattice)
    try:
        calib = read_lattice(calibration) if calibration else None
    except InputError as e:   # name the option: two lattices are read
        raise InputError(f"--calibrate {e}") from None
    if not parsed:
        parsed = [parse_policy(p) for p in default_policies(lat)]
        hint = tlv_hint(lat)
        if hint:
            click.echo(f"specpilot: warning: {hint}", err=True)
    for line in mix_warnings(lat, parsed):
        click.echo(f"specpilot: warning: {line}", err=True)
    bar = progress(total=total_work(lat, parsed, node_list), desc="replay", unit="step")
    try:
        result = replay(lat, parsed, node_list, n_boot=n_boot, seed=seed, calibration=calib,
                        tick=lambda: bar.update(1))
    finally:
        bar.close()
    notes = [f"{p.spec} is cut to the lattice's {count(result.m, 'draft position')} (nodes {result.m})"
             for p in parsed if p.family == "chain" and p.nodes is not None and p.nodes > result.m]
    notes += [f"{p.spec} is cut to the lattice's {count(result.m, 'draft position')} (depth {result.m})"
              for p in parsed if p.family == "eagle2" and p.depth > result.m]
    notes += [f"{p.spec} is cut to the lattice's {count(result.k, 'candidate')} per position (K {result.k})"
              for p in parsed if p.family == "oracle" and p.k > result.k]
    if node_list and any(p.family == "chain" for p in parsed) and "chain" not in result.curves:
        notes.append(f"chain: no tau(N) curve: every --nodes budget is above the lattice's {result.m} draft positions")
    if node_list and all(p.curve_key is None for p in parsed):
        notes.append(f"--nodes: no tau(N) curve: {', '.join(sorted({p.family for p in parsed}))} replays at its own "
                     "budget only (add a tree policy, e.g. --policy best-first:32, for a curve)")
    emit(_report(result, notes, transitions_share(lat)), fmt, out, protect=[lattice] + ([calibration] if calibration else []))
    return 0


def _report(result, notes=(), share: tuple[int, int] | None = None) -> Report:
    have, deep = share or (0, 0)
    scores = ("marginal" if not result.transitions else
              f"parent-conditioned scores in {have} of {deep} rows of 2+ positions, marginal in the others"
              if 0 < have < deep else "parent-conditioned")
    rows = [[p.policy, p.nodes if p.nodes is not None else "-", f"{p.built:.1f}" if p.built is not None else "-",
             p.tau, f"[{p.tau_ci[0]:.3f}, {p.tau_ci[1]:.3f}]"] for p in result.policies]
    sections = [Section(f"tau per policy ({count(result.steps, 'step')}, {count(result.requests, 'request')}, "
                        f"m={count(result.m, 'position')} x K={count(result.k, 'candidate')}, "
                        f"{scores}{'' if scores.endswith('others') else ' scores'})",
                        ["policy", "nodes", "built (mean)", "tau", "95% CI (requests resampled)"], rows)]
    if result.curves:
        ns = sorted({int(n) for c in result.curves.values() for n in c})
        crow = [[k] + [c.get(str(n)) for n in ns] for k, c in result.curves.items()]
        sections.append(Section("tau(N) curves", ["policy"] + [f"N={n}" for n in ns], crow))
    lines = list(notes)
    if result.rank_accept is not None and len(result.rank_accept):   # a lattice without drafts measures none
        top = ", ".join(f"{x:.3f}" for x in result.rank_accept[:8])
        lines.append(f"sequoia acceptance by rank (measured): {top}{' ...' if len(result.rank_accept) > 8 else ''}")
    return Report(data=result.to_json(), sections=sections, lines=lines)
