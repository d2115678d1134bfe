"""The report's plot (PNG): goodput, GPU-hours and cost per run, validation loss per version."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainforge.ledger import names as n


def plot_report(report: dict[str, Any], path: Path) -> Path:
    """Draw ``report`` (trainforge.cli.report.collect_report) into the PNG file ``path``.

    Raises:
        ImportError: matplotlib (installed with mlflow) is missing; the message says so.
    """
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError(f"--plot {path}: drawing needs matplotlib (it comes with mlflow; "
                          f"pip install matplotlib)") from err

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    labels = [str(i + 1) for i in range(len(runs))]
    panels = [(n.GOODPUT, "goodput %"), (n.GPU_HOURS_ALLOCATED, "GPU-hours allocated"),
              (n.COST_ALLOCATED, "cost allocated")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for ax, (key, title) in zip(axes, panels):
        ax.bar(labels, [r["figures"].get(key, 0.0) for r in runs], color="#4c72b0")
        ax.set_title(title)
        ax.set_xlabel("run (oldest first)")
    versions = report["versions"]
    ax = axes[3]
    ax.plot([f"v{v['version']}" for v in versions],
            [v["validation"].get("val/val_loss", float("nan")) for v in versions], marker="o")
    ax.set_title("validation loss per registered version")
    fig.suptitle(f"trainforge report: {report['pipeline']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)
    return path
