"""The plots of a round report (matplotlib, Agg backend), each returned as PNG bytes.

* :func:`step_breakdown`: per kernel class, the measured ms per step beside its byte floor, and
  the step wall time split into GPU busy and outside time (from the round's profile);
* :func:`tau_c`: tau(N) of chains and best-first trees, c(N), and the predicted speedup
  tau(N) / c(N) per node budget, with the current system marked;
* :func:`factors`: the ceiling's three factors (unknown ones shown as such);
* :func:`candidates`: each candidate's paired speed ratios, the gain with its 95% bootstrap and
  t intervals and the threshold the lower of their lower bounds had to clear;
* :func:`audit`: mismatch rates with their prompt-resampled 95% intervals, events annotated.
"""

from __future__ import annotations

import io

from .plots import CLASS_COLORS

APPROVED, REFUSED, SKIPPED = "#2E8B57", "#C44E52", "#8C8C8C"


def _fig(w: float, h: float):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, plt.subplots(figsize=(w, h), dpi=110)


def _png(plt, fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def step_breakdown(profile: dict) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 4.2), dpi=110, gridspec_kw={"width_ratios": [2.2, 1]})
    classes = [(k, v) for k, v in (profile.get("classes") or {}).items() if (v.get("ms") or v.get("floor_ms"))]
    names = [k for k, _ in classes]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [v.get("ms") or 0 for _, v in classes], width=0.4,
           color=[CLASS_COLORS.get(k, "#999999") for k in names], label="measured")
    ax.bar([i + 0.2 for i in x], [v.get("floor_ms") or 0 for _, v in classes], width=0.4, color="white",
           edgecolor=[CLASS_COLORS.get(k, "#999999") for k in names], hatch="//", label="byte floor")
    ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms per step (median)")
    kf = profile.get("kernel_factor")
    ax.set_title("kernel time per class vs its byte floor" + (f" (kernel factor {kf:.2f}x)" if kf else ""), fontsize=9)
    ax.legend(fontsize=7, frameon=False)
    wall, busy = profile.get("step_wall_ms") or 0, profile.get("kernel_busy_ms") or 0
    ax2.bar(0, busy, color="#777777", label="GPU busy")
    ax2.bar(0, max(wall - busy, 0), bottom=busy, color="#E6E6E6", edgecolor="#777777", label="outside")
    floor = profile.get("total_floor_ms")
    if floor:
        ax2.axhline(floor, color="#C44E52", ls="--", lw=1, label=f"floor {floor:.3g} ms")
    ax2.set_xticks([0], ["step wall"])
    of = profile.get("outside_factor")
    ax2.set_title(f"{wall:.3g} ms per step" + (f" (outside {of:.2f}x)" if of else ""), fontsize=9)
    # below the axes: the bar fills the axes' width, so a legend inside it covers the bar's top
    ax2.legend(fontsize=7, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=1)
    return _png(plt, fig)


def tau_c(model: dict, current: dict | None) -> bytes:
    plt, (fig, ax) = _fig(8.5, 5.0)
    rows = model.get("by_nodes") or []
    # series that coincide (a drafter with one candidate per position makes the chain the tree;
    # random weights put tau, c and the speedup all at 1) must not hide one another: the chain is
    # drawn wide with large rings beneath the tree's thin lines and small squares, each speedup
    # with hollow markers of its own shape around the tau markers, c(N) with large crosses on top
    chain = {"color": "#DD8452", "mfc": "none", "mew": 1.6, "alpha": 0.75, "zorder": 2}
    tree = {"color": "#4C72B0", "zorder": 3}
    styles = {"chain": ({**chain, "marker": "o", "ms": 9, "lw": 3.5, "ls": "-"},
                        {**chain, "marker": "D", "ms": 10, "lw": 3.5, "ls": (0, (1.5, 1))}),
              "best-first": ({**tree, "marker": "s", "ms": 4, "lw": 1, "ls": "-"},
                             {**tree, "marker": "s", "ms": 7, "mfc": "none", "mew": 1.2, "lw": 1.5, "ls": "--"})}
    ax2 = ax.twinx()
    for fam, (tau_style, speedup_style) in styles.items():
        pts = sorted((r["nodes"], r) for r in rows if r["family"] == fam)
        if not pts:
            continue
        n = [p[0] for p in pts]
        ax.plot(n, [p[1]["tau"] for p in pts], label=f"tau(N), {fam}", **tau_style)
        ax2.plot(n, [p[1]["speedup"] for p in pts], label=f"predicted speedup tau/c, {fam}", **speedup_style)
    # TLV's tau is per exact pass (its own scale): only its predicted speedup joins the plot
    tlv = sorted((r["nodes"], r["speedup"]) for r in rows if r["family"] == "tlv")
    if tlv:
        ax2.plot([p[0] for p in tlv], [p[1] for p in tlv], color="#8172B3", marker="*", ls="none", ms=9,
                 label="predicted speedup, tlv (per exact pass over its cycle)")
    cpts = sorted({(r["nodes"], r["c"]) for r in rows if r["family"] == "best-first"} or
                  {(r["nodes"], r["c"]) for r in rows})
    if cpts:
        ax2.plot([p[0] for p in cpts], [p[1] for p in cpts], color="#555555", marker="x", lw=1, ms=7, mew=1.5,
                 zorder=4, label="c(N): mean T_step of the rows verified / T_AR")
    if current and current.get("speedup"):
        ax2.axhline(current["speedup"], color="#2E8B57", lw=1, ls=":",
                    label=f"current system ({current['policy']}): {current['speedup']:.3g}x")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft nodes N (budget; the rows a step verifies: up to N + 1)")
    ax.set_ylabel("tau (tokens per verify pass)")
    ax2.set_ylabel("c(N) and predicted speedup over AR")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    ax.set_title("tau(N) from the replayed lattice, c(N) from the rows probe", fontsize=9)
    return _png(plt, fig)


def factors(model: dict) -> bytes:
    plt, (fig, ax) = _fig(5.5, 3.2)
    f = model.get("factors") or {}
    names = ["tree", "kernel", "outside"]
    vals = [f.get(n) for n in names]
    largest = model.get("largest")
    if largest and not (f.get(largest) or 0) > 1:   # as specpilot ceiling: a largest factor of 1 offers nothing
        largest = None
    for i, (n, v) in enumerate(zip(names, vals)):
        if v is None:
            ax.bar(i, 1.0, color="white", edgecolor="#999999", hatch="..")
            ax.text(i, 1.02, "unknown", ha="center", va="bottom", fontsize=8, color="#666666")
        else:
            ax.bar(i, v, color="#C44E52" if n == largest else "#4C72B0")
            ax.text(i, v * 1.01, f"{v:.3g}x", ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="#333333", lw=0.8)
    ax.set_xticks(range(3), names)
    ax.set_ylabel("factor (1 = nothing to gain)")
    top = max([v for v in vals if v] + [1.1])
    ax.set_ylim(0, top * 1.18)
    ax.set_title("the ceiling's three factors" + (f"; largest: {largest}" if largest else "; none offers a gain"
                                                  if any(v is not None for v in vals) else ""), fontsize=9)
    return _png(plt, fig)


def candidates(decisions: list[dict]) -> bytes:
    timed = [d for d in decisions if d.get("timing")]
    plt, (fig, ax) = _fig(8.5, 1.1 + 0.7 * max(len(timed), 1))
    for i, d in enumerate(timed):
        t = d["timing"]
        y = len(timed) - 1 - i
        ratios = [s["ratio"] for s in t.get("samples", [])]
        color = {"approved": APPROVED, "refused": REFUSED}.get(d["verdict"], SKIPPED)
        ax.scatter(ratios, [y + 0.18] * len(ratios), s=10, color=color, alpha=0.5, zorder=2)
        lo, hi = t["ci_low"], t["ci_high"]
        ax.errorbar([t["gain"]], [y], xerr=[[t["gain"] - lo], [hi - t["gain"]]], fmt="o", color=color, capsize=4,
                    zorder=3)
        if t.get("t_ci"):   # the verdict takes the lower of the two lower bounds: both are drawn
            tlo, thi = t["t_ci"]
            ax.errorbar([t["gain"]], [y - 0.18], xerr=[[max(t["gain"] - tlo, 0)], [max(thi - t["gain"], 0)]],
                        fmt="none", color=color, capsize=3, lw=0.9, alpha=0.8, zorder=3)
        ax.plot([1 + t["threshold"]] * 2, [y - 0.3, y + 0.3], color="#333333", lw=1.2, ls="--", zorder=1)
    ax.axvline(1.0, color="#999999", lw=0.8)
    ax.set_yticks(range(len(timed)), [f"{d['id']} ({d['verdict']})" for d in reversed(timed)], fontsize=8)
    ax.set_xlabel("speed ratio candidate / current (dots: paired samples; bar: gain and 95% bootstrap interval;\n"
                  "thin bar below: t-interval; the verdict takes the lower of their lower bounds; dashes: threshold)",
                  fontsize=8)
    ax.set_title("paired runs (ABBA) per candidate", fontsize=9)
    if not timed:
        ax.text(0.5, 0.5, "no candidate was timed", ha="center", transform=ax.transAxes)
    return _png(plt, fig)


def audit(decisions: list[dict]) -> bytes:
    rows = []
    seen_refs = set()
    for d in decisions:
        a = d.get("audit")
        if not a:
            continue
        for s in a.get("systems", []):
            if s["role"] in ("stock", "ar"):
                if s["role"] in seen_refs:
                    continue
                seen_refs.add(s["role"])
                label = s["role"]
            else:
                label = d["id"]
            rows.append((label, s["role"], s["mismatch_rate"], s["mismatch_ci"], s["events"], s.get("verdict")))
    plt, (fig, ax) = _fig(8.0, 0.9 + 0.45 * max(len(rows), 1))
    for i, (label, role, rate, ci, events, verdict) in enumerate(rows):
        y = len(rows) - 1 - i
        color = "#777777" if role != "system" else (APPROVED if verdict == "pass" else REFUSED)
        ax.barh(y, 100 * rate, color=color, height=0.6)
        ax.errorbar([100 * rate], [y], xerr=[[100 * (rate - ci[0])], [100 * (ci[1] - rate)]], fmt="none",
                    ecolor="#333333", capsize=3)
        # a few points past the interval's cap whatever the axis' scale
        ax.annotate(f"{100 * rate:.2f}%, {events} events", (100 * max(ci[1], rate), y), xytext=(5, 0),
                    textcoords="offset points", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [r[0] for r in reversed(rows)], fontsize=8)
    ax.set_xlabel("token-forcing mismatch rate, % (95% interval resampling prompts)", fontsize=8)
    ax.set_xlim(0, max([100 * r[3][1] for r in rows] + [1.0]) * 1.6)
    ax.set_title("audit against stock: mismatch rates and events (margin >= 2 delta)", fontsize=9)
    if not rows:
        ax.text(0.5, 0.5, "no audit ran", ha="center", transform=ax.transAxes)
    return _png(plt, fig)
