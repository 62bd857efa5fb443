"""Plots (matplotlib, Agg backend: no display needed). Written atomically like every output."""

from __future__ import annotations

from specpilot.fileio import atomic_open

# one colour per kernel class, stable across plots
CLASS_COLORS = {
    "linear": "#4C72B0", "lm_head": "#8172B3", "attention": "#DD8452", "gdn": "#937860", "moe": "#DA8BC3",
    "norm": "#55A868", "elementwise": "#8C8C8C", "sampling": "#CCB974", "memcpy": "#64B5CD",
    "communication": "#C44E52", "drafter": "#2E8B57", "other": "#BBBBBB",
}


def plot_profile(profile, path: str, protect=()) -> None:
    """Two stacked bars per step: measured ms per class beside floor ms per class (+ the outside time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = list(profile.classes.values())
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    bars = {"measured": 0.0, "floor": 0.0}
    x = {"measured": 0, "floor": 1}
    extra = 2
    for c in classes:
        color = CLASS_COLORS.get(c.name, None)
        ax.bar(x["measured"], c.ms, bottom=bars["measured"], color=color, edgecolor="white", linewidth=0.5,
               label=c.name)
        bars["measured"] += c.ms
        if c.floor_ms:
            ax.bar(x["floor"], c.floor_ms, bottom=bars["floor"], color=color, edgecolor="white", linewidth=0.5,
                   hatch="//")
            bars["floor"] += c.floor_ms
    wall = profile.step_wall.median
    busy = profile.kernel_busy.median
    ax.bar(extra, wall, color="#EEEEEE", edgecolor="#666666", linewidth=0.8)
    ax.bar(extra, busy, color="#999999")
    ax.set_xticks([0, 1, 2], ["measured\n(kernel ms, by class)", "byte floor" if bars["floor"] else "byte floor\n(no --model)",
                              "step wall\n(busy | outside)"])
    ax.set_ylabel("ms per step (median)")
    title = f"{profile.model or 'profile'} on {(profile.gpu or {}).get('name', 'unknown GPU')}: {profile.steps} steps"
    ax.set_title(title, fontsize=10)
    ymax = max(bars["measured"], bars["floor"], wall) or 1.0
    for xi, v in ((0, bars["measured"]), (1, bars["floor"]), (2, wall)):
        if v:
            ax.text(xi, v + ymax * 0.01, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, ymax * 1.12)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    with atomic_open(path, "wb", protect=protect) as fh:
        fig.savefig(fh, format="png")
    plt.close(fig)
