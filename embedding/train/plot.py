"""Loss and held-out AUC against steps, from a metrics log, as a PNG (matplotlib).

matplotlib is optional: without it :func:`plot_metrics` raises
:class:`PlotUnavailable` whose message says how to get it; the metrics log
holds every number the plot would show.
"""
from __future__ import annotations

from pathlib import Path

from embedding.train.metrics import read_metrics

__all__ = ["plot_metrics", "PlotUnavailable", "pyplot"]


class PlotUnavailable(RuntimeError):
    """No plot can be drawn here (matplotlib is missing, or the log holds nothing to draw)."""


def pyplot(where: str = "the numbers are in the metrics log"):
    """matplotlib's pyplot on the Agg backend; :class:`PlotUnavailable` without matplotlib
    (``where`` tells the user where the numbers are instead)."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(f"matplotlib is not installed (pip install matplotlib); "
                              f"{where}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_metrics(metrics_path, out_path) -> Path:
    """Draw loss (left axis) and AUC (right axis) against steps; returns ``out_path``."""
    records = read_metrics(metrics_path)
    train = [r for r in records if r.get("event") == "train"]
    evals = [r for r in records if r.get("event") == "eval"]
    if not train and not evals:
        raise PlotUnavailable(f"{metrics_path} holds no training or evaluation records")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    try:
        if train:
            ax.plot([r["step"] for r in train], [r["loss"] for r in train], color="tab:blue",
                    lw=1, label="loss")
            if all("loss_avg" in r for r in train):
                ax.plot([r["step"] for r in train], [r["loss_avg"] for r in train],
                        color="tab:blue", lw=2, alpha=0.5, label="loss (mean since last)")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (log-loss)", color="tab:blue")
        handles, labels = ax.get_legend_handles_labels()
        if evals:
            ax2 = ax.twinx()
            ax2.plot([r["step"] for r in evals], [r["auc"] for r in evals], "o-",
                     color="tab:red", label="held-out AUC")
            ax2.set_ylabel("held-out AUC", color="tab:red")
            start = next((r for r in records if r.get("event") == "start"
                          and r.get("planted_auc") is not None), None)
            if start is not None:
                ax2.axhline(start["planted_auc"], color="tab:red", ls="--", lw=1,
                            label="planted model AUC")
            h2, l2 = ax2.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        ax.grid(alpha=0.3)
        fig.tight_layout(rect=(0, 0.08, 1, 1))
        fig.legend(handles, labels, loc="lower center", ncol=len(handles), frameon=False)
        out = Path(out_path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out)
        return out
    finally:
        plt.close(fig)
