"""Plots (matplotlib, Agg backend: no display needed). Written atomically like every output."""

from __future__ import annotations

from specpilot.fileio import atomic_open

# one colour per kernel class, stable across plots
CLASS_COLORS = {
    "linear": "#4C72B0", "lm_head": "#8172B3", "attention": "#DD8452", "gdn": "#937860", "moe": "#DA8BC3",
    "norm": "#55A868", "elementwise": "#8C8C8C", "sampling": "#CCB974", "memcpy": "#64B5CD",
    "communication": "#C44E52", "drafter": "#2F2F2F", "other": "#BBBBBB",
}


PLOT_FORMATS = ("png", "svg", "pdf")


def plot_format(path: str) -> str | None:
    """The image format a plot file's name asks for (no suffix: PNG); None for another suffix."""
    from pathlib import Path

    suffix = Path(path).suffix.lower().lstrip(".")
    return "png" if not suffix else suffix if suffix in PLOT_FORMATS else None


def plot_profile(profile, path: str, protect=(), option: str = "--plot") -> None:
    """Left: measured kernel ms per class stacked beside the byte floor per class (hatched).
    Right: the step wall time split into GPU busy and outside time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 4.8), dpi=120, gridspec_kw={"width_ratios": [2, 1]})
    tops = [0.0, 0.0]
    for c in profile.classes.values():
        if not (c.ms or c.floor_ms):
            continue
        color = CLASS_COLORS.get(c.name)
        ax.bar(0, c.ms, bottom=tops[0], color=color, edgecolor="white", linewidth=0.5, label=c.name)
        tops[0] += c.ms
        if c.floor_ms:
            ax.bar(1, c.floor_ms, bottom=tops[1], color=color, edgecolor="white", linewidth=0.5, hatch="//")
            tops[1] += c.floor_ms
    ax.set_xticks([0, 1], ["measured kernel time", "byte floor" if tops[1] else "byte floor (give --model)"])
    ax.set_ylabel("ms per step (median over steps)")
    ymax = max(tops) or 1.0
    for xi, v in enumerate(tops):
        if v:
            ax.text(xi, v + ymax * 0.01, f"{v:.3g} ms", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, ymax * 1.12)
    if profile.kernel_factor:
        ax.set_title(f"kernel factor (busy / floor) {profile.kernel_factor:.2f}x", fontsize=9)
    # beside the bars, not over them: a stacked bar fills its column up to the ms label
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7, frameon=False)

    wall, busy = profile.step_wall.median, profile.kernel_busy.median
    ax2.bar(0, busy, color="#777777", label="GPU busy")
    ax2.bar(0, max(wall - busy, 0.0), bottom=busy, color="#E6E6E6", edgecolor="#777777", label="outside")
    ax2.set_xticks([0], ["step wall"])
    ax2.text(0, wall * 1.01, f"{wall:.3g} ms", ha="center", va="bottom", fontsize=8)
    ax2.set_ylim(0, (wall or 1.0) * 1.12)
    if profile.outside_factor:
        ax2.set_title(f"outside factor (wall / busy) {profile.outside_factor:.2f}x", fontsize=9)
    ax2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), fontsize=7, frameon=False)
    gpu = (profile.gpu or {}).get("name", "unknown GPU")
    fig.suptitle(f"{profile.model or 'profile'} on {gpu}: {profile.steps} step{'' if profile.steps == 1 else 's'}",
                 fontsize=10)
    fig.tight_layout()
    with atomic_open(path, "wb", protect=protect, option=option) as fh:
        fig.savefig(fh, format=plot_format(path) or "png")
    plt.close(fig)
