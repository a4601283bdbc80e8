"""Loss curves of one or several runs into a PNG, in the style of the paper's Figures (MLM loss
against steps, one line per run; validation solid, training faint).

    shatter-plot-metrics RUN [RUN ...] --output curves.png [--labels a,b] [--train/--no-train]
                                 [--cost cost.png]

Reads each RUN/metrics.jsonl (docs/training.md, Run directory). A run without a metrics file, or with no
line to plot, is an error naming it. `--cost` also draws what each run cost: tokens/s per GPU
and MFU against steps (MFU only where the run knew its device's peak, train/cost.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from shatter.extras import require
from shatter.options import command


def read_metrics(run: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(training (step, loss), validation (step, loss)) of one run, in step order; torn lines skipped."""
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        raise click.ClickException(f"{path}: no metrics.jsonl (is {run} a run directory?)")
    train, val = [], []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("loss") is None:
            continue
        (val if record.get("split") == "validation" else train).append(
            (record["step"], record["loss"])
        )
    if not train and not val:
        raise click.ClickException(f"{path}: no loss lines to plot")
    return sorted(train), sorted(val)


def objective_of(run: Path) -> str:
    """The objective a run's loss lines are over: "mlm" (also runs older than the field) or "plm"."""
    path = run / "metrics.jsonl" if run.is_dir() else run
    seen = set()
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            seen.add(json.loads(line).get("objective") or "mlm")
        except json.JSONDecodeError:
            continue
    return "plm" if seen == {"plm"} else "mlm"


def plot(
    runs: list[Path], labels: list[str], output: Path, show_train: bool, title: str | None
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    objectives = {objective_of(run) for run in runs}
    if len(objectives) > 1:
        raise click.ClickException(
            "these runs mix objectives (mlm and plm): a PLM loss is over other predictions than "
            "an MLM loss; plot the xlnet runs separately"
        )
    fig, ax = plt.subplots(
        figsize=(6.3, 2.8), dpi=150
    )  # the paper's figure viewport, 6.3in x 2.8in
    for i, (run, label) in enumerate(zip(runs, labels)):
        train, val = read_metrics(run)
        color = f"C{i}"
        if show_train and train:
            ax.plot(*zip(*train), color=color, alpha=0.3, linewidth=0.8)
        if val:
            ax.plot(
                *zip(*val),
                color=color,
                linewidth=1.6,
                marker="o" if len(val) < 30 else None,
                markersize=3,
                label=label,
            )
        else:
            ax.plot(*zip(*train), color=color, linewidth=1.2, label=f"{label} (train)")
    ax.set_xlabel("steps")
    ax.set_ylabel(f"{objectives.pop().upper()} loss")
    ax.grid(True, alpha=0.3)
    ax.legend(frameon=False, fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output)
    plt.close(fig)
    return output


def read_cost(run: Path) -> list[dict]:
    """Training lines of one run that carry a throughput, in step order."""
    path = run / "metrics.jsonl" if run.is_dir() else run
    lines = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "split" not in record and record.get("tokens_per_s") is not None:
            lines.append(record)
    if not lines:
        raise click.ClickException(f"{path}: no tokens_per_s lines to plot")
    return sorted(lines, key=lambda r: r["step"])


def plot_cost(runs: list[Path], labels: list[str], output: Path) -> Path:
    """Tokens/s per GPU (left) and MFU (right) against steps, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate, mfu) = plt.subplots(1, 2, figsize=(6.3, 2.8), dpi=150)
    for i, (run, label) in enumerate(zip(runs, labels)):
        lines = read_cost(run)
        steps = [r["step"] for r in lines]
        per_gpu = [r.get("tokens_per_s_per_gpu", r["tokens_per_s"]) for r in lines]
        rate.plot(steps, per_gpu, color=f"C{i}", linewidth=1.2, label=label)
        known = [(r["step"], 100 * r["mfu"]) for r in lines if r.get("mfu") is not None]
        if known:
            mfu.plot(*zip(*known), color=f"C{i}", linewidth=1.2, label=label)
    rate.set_ylabel("tokens/s per GPU")
    mfu.set_ylabel("MFU (%)")
    if not mfu.lines:
        why = "no MFU: the device's peak is unknown\n(a CPU, or a GPU not in the table;\nset run.peak_tflops)"
        mfu.text(0.5, 0.5, why, ha="center", va="center", fontsize=7, transform=mfu.transAxes)
    for ax in (rate, mfu):
        ax.set_xlabel("steps")
        ax.grid(True, alpha=0.3)
    rate.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output)
    plt.close(fig)
    return output


def run_names(runs: list[Path]) -> list[str]:
    """A distinct legend label per run: the shortest tail of each path that tells them apart
    (`a/run` and `b/run` are `a/run` and `b/run`, not `run` twice)."""
    parts = [r.resolve().parts for r in runs]
    for depth in range(1, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(r) for r in runs]  # the same directory given twice


@command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--output", "-o", required=True, type=click.Path(path_type=Path), help="PNG to write."
)
@click.option("--labels", help="Comma-separated legend labels (default: run directory names).")
@click.option(
    "--train/--no-train", "show_train", default=True, help="Also draw the training loss, faint."
)
@click.option("--title", help="Figure title.")
@click.option(
    "--cost", type=click.Path(path_type=Path), help="Also draw tokens/s per GPU and MFU here."
)
def main(runs, output, labels, show_train, title, cost):
    """Draw the MLM loss curves of RUNS into a PNG."""
    require("matplotlib", extra="demo", purpose="plot_metrics")
    names = labels.split(",") if labels else run_names([Path(r) for r in runs])
    if len(names) != len(runs):
        raise click.ClickException(f"{len(names)} labels for {len(runs)} runs")
    click.echo(plot(list(runs), names, output, show_train, title))
    if cost:
        click.echo(plot_cost(list(runs), names, cost))


if __name__ == "__main__":
    main()
