"""``kvasir bench load|sweep|compare --plot DIR``: PNG pictures of a run (matplotlib, drawn off-screen).

- ``timeline.png``: one lane per stage, one box per batch, coloured by its prefill
  share, for a few seconds of each ring run (in-flight and drained side by side);
- ``stages.png``: each stage's busy / starved / blocked shares;
- ``latency.png``: cumulative distributions of TTFT, inter-token and end-to-end latency.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvasir.bench.metrics import RequestRecord
from kvasir.errors import KvasirError
from kvasir.wire.stats import BatchSpan


@dataclass
class RunPicture:
    """What one ring run leaves for the pictures."""

    name: str  # "ring", "drained", ...
    records: list[RequestRecord]
    stages: list[dict]  # stage_fractions() of the measured window
    timeline: list[list[BatchSpan]]  # per stage, from the stats query


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise KvasirError("--plot needs matplotlib: pip install 'kvasir[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def window(timeline: list[list[BatchSpan]], seconds: float) -> tuple[int, int]:
    """A ``seconds``-long window (ns) in the middle of the recorded spans."""
    spans = [span for lane in timeline for span in lane]
    if not spans:
        return 0, 0
    first, last = min(s.start_ns for s in spans), max(s.end_ns for s in spans)
    middle, half = (first + last) // 2, int(seconds * 1e9) // 2
    return max(first, middle - half), min(last, middle + half)


def plot_run(runs: list[RunPicture], folder: Path, seconds: float = 3.0) -> list[Path]:
    """Draw the three pictures for ``runs`` into ``folder``; returns the files written."""
    plt = _pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    written = [
        _timeline(plt, runs, folder / "timeline.png", seconds),
        _stages(plt, runs, folder / "stages.png"),
        _latency(plt, runs, folder / "latency.png"),
    ]
    return written


def _timeline(plt, runs: list[RunPicture], path: Path, seconds: float) -> Path:
    from matplotlib import colormaps

    cmap = colormaps["coolwarm"]
    fig, axes = plt.subplots(
        len(runs), 1, figsize=(11, 1.2 + 0.9 * max(len(r.timeline) for r in runs) * len(runs)), squeeze=False
    )
    for ax, run in zip(axes[:, 0], runs):
        begin, end = window(run.timeline, seconds)
        for lane, spans in enumerate(run.timeline):
            for span in spans:
                if span.end_ns < begin or span.start_ns > end:
                    continue
                share = span.prefill_tokens / max(span.prefill_tokens + span.decode_tokens, 1)
                ax.broken_barh(
                    [((span.start_ns - begin) / 1e9, (span.end_ns - span.start_ns) / 1e9)],
                    (lane - 0.4, 0.8),
                    facecolors=cmap(share),
                    edgecolors="black",
                    linewidth=0.3,
                )
        ax.set_yticks(range(len(run.timeline)), [f"stage {i}" for i in range(len(run.timeline))])
        ax.set_ylim(len(run.timeline) - 0.5, -0.5)
        ax.set_xlim(0, max((end - begin) / 1e9, 1e-3))
        ax.set_title(f"{run.name}: one box per batch (blue decode, red prefill)", fontsize=10)
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _stages(plt, runs: list[RunPicture], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(9, 3.5))
    labels, busy, starved, blocked = [], [], [], []
    for run in runs:
        for stage in run.stages:
            labels.append(f"{run.name}\nstage {stage['index']}")
            busy.append(stage["busy"])
            starved.append(stage["starved"])
            blocked.append(stage["blocked"])
    x = range(len(labels))
    ax.bar(x, busy, color="tab:green", label="busy")
    ax.bar(x, starved, bottom=busy, color="tab:orange", label="starved")
    ax.bar(x, blocked, bottom=[a + b for a, b in zip(busy, starved)], color="tab:red", label="blocked")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("share of wall time")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _latency(plt, runs: list[RunPicture], path: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    measures = (
        ("time to first token", lambda r: [r.first_token_s]),
        ("inter-token latency", lambda r: r.itl_s),
        ("end-to-end latency", lambda r: [r.e2e_s]),
    )
    for ax, (title, values_of) in zip(axes, measures):
        for run in runs:
            values = sorted(v * 1e3 for r in run.records if r.ok for v in values_of(r))
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=run.name)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of requests / gaps")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
