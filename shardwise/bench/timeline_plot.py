"""Draw a pipeline timeline the way the papers do: one row per rank, F/B/W boxes with the micro-batch inside.

Works on any list of ``Event`` (simulated here; measured ones from an executor have the same shape).
matplotlib is optional: without it ``plot_timeline`` raises ``ImportError`` saying how to install it.
"""

from __future__ import annotations

from typing import Sequence

from ..parallel.pipeline.simulate import Event

__all__ = ["plot_timeline", "MATPLOTLIB_HINT"]

MATPLOTLIB_HINT = ("drawing a timeline needs matplotlib, which is not installed: pip install matplotlib "
                   "(or pip install 'shardwise[plot]')")

# face colours per kind, one shade per model chunk (later chunks darker) so interleaving is visible
_COLOURS = {
    "F": ("#9fc5e8", "#3d85c6", "#1c4587", "#0b2447"),
    "B": ("#b6d7a8", "#6aa84f", "#38761d", "#1e4010"),
    "W": ("#ffe599", "#f1c232", "#bf9000", "#7f6000"),
}


def plot_timeline(events: Sequence[Event], *, p: int, path: str, title: str = "", chunks: int = 1,
                  split_backward: bool = True) -> None:
    """Write a PNG of ``events`` (rank 0 on top) to ``path``; white gaps are the bubbles."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch, Rectangle
    except ImportError as exc:
        raise ImportError(MATPLOTLIB_HINT) from exc
    makespan = max((e.end for e in events), default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(min(4 + 0.09 * len(events) / max(p, 1) * 4, 22), 0.55 * p + 1.4))
    for e in events:
        kind = e.action.kind
        chunk = e.action.stage // p
        colour = _COLOURS[kind][min(chunk, len(_COLOURS[kind]) - 1)]
        row = p - 1 - e.rank
        ax.add_patch(Rectangle((e.start, row + 0.05), e.end - e.start, 0.9, facecolor=colour,
                               edgecolor="black", linewidth=0.6))
        text_colour = "white" if chunk >= 2 else "black"
        width_frac = (e.end - e.start) / makespan
        ax.text(e.start + (e.end - e.start) / 2, row + 0.5, str(e.action.microbatch), ha="center", va="center",
                fontsize=max(5, min(9, 600 * width_frac)), color=text_colour)
    ax.set_xlim(0, makespan)
    ax.set_ylim(0, p)
    ax.set_yticks([p - 1 - r + 0.5 for r in range(p)], [f"rank {r}" for r in range(p)])
    ax.set_xlabel("time")
    ax.set_title(title, fontsize=10)
    b_label = "B (input gradient)" if split_backward else "B (full backward)"
    handles = [Patch(facecolor=_COLOURS["F"][0], edgecolor="black", label="F (forward)"),
               Patch(facecolor=_COLOURS["B"][0], edgecolor="black", label=b_label)]
    if split_backward:
        handles.append(Patch(facecolor=_COLOURS["W"][0], edgecolor="black", label="W (weight gradient)"))
    if chunks > 1:
        handles.append(Patch(facecolor="white", edgecolor="white", label="darker = later chunk"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35 if p < 4 else -0.2),
              ncol=len(handles), fontsize=8, frameon=False)
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
