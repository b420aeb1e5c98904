"""curves.png of a run: reward, accuracy, length, entropy, grad norm, mismatch and lr against the data clock."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

PANELS = [
    ("reward/mean", "reward (mean)"),
    ("accuracy", "train accuracy"),
    ("response/length_mean", "response length"),
    ("entropy", "entropy"),
    ("grad_norm", "grad norm"),
    ("mismatch/k3", "mismatch k3 (sampler vs trainer)"),
    ("lr", "learning rate"),
    ("kl_seq", "KL_seq(q||p) estimate"),
]


def plot_curves(records: list[dict[str, Any]], path: Path, *, evals: list[dict[str, Any]] | None = None,
                title: str = "") -> Path | None:
    """Draw one panel per metric in PANELS that the records hold; held-out eval accuracy is overlaid on
    the accuracy panel. Returns the path, or None when there is nothing to draw."""
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r.get("rollouts", r.get("step", i)) for i, r in enumerate(records)]
    panels = [(k, label) for k, label in PANELS if any(isinstance(r.get(k), (int, float)) for r in records)]
    cols = 4
    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, (key, label) in zip(axes.flat, panels):
        pts = [(xi, r[key]) for xi, r in zip(x, records) if isinstance(r.get(key), (int, float))
               and math.isfinite(r[key])]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2)
        if key == "accuracy" and evals:
            for mode, marker in (("greedy", "o"), ("sampled", "s")):
                ev = [(e["rollouts"], e[mode]["accuracy"]) for e in evals if mode in e]
                if ev:
                    ax.plot([p[0] for p in ev], [p[1] for p in ev], marker=marker, ls="--", label=f"held-out {mode}")
            ax.legend(fontsize=7)
        if key in ("lr", "grad_norm", "mismatch/k3", "kl_seq") and pts and all(p[1] > 0 for p in pts):
            ax.set_yscale("log")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("rollouts consumed", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
