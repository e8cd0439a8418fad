"""`--plot FILE` of `pagedllm bench serve` and `bench latency`: one PNG with TTFT and TPOT
percentiles (P50 / P90 / P99, ms) and output tokens/s against the load (concurrency or batch
size), one point per run. matplotlib with the Agg backend (no display needed)."""

from __future__ import annotations

PERCENTILES = (50, 90, 99)


def plot_load(rows: list[dict], x_key: str, x_label: str, throughput_key: str, path: str, title: str) -> None:
    """rows: one per load level, with `x_key`, p{50,90,99}_{ttft,tpot}_ms and `throughput_key`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: r[x_key])
    xs = [r[x_key] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), dpi=90)
    for ax, metric, name in ((axes[0], "ttft", "TTFT (ms)"), (axes[1], "tpot", "TPOT (ms)")):
        for q, style in zip(PERCENTILES, ("o-", "s--", "^:")):
            ax.plot(xs, [r[f"p{q}_{metric}_ms"] for r in rows], style, label=f"P{q}")
        ax.set_ylabel(name)
        ax.legend(fontsize=8)
    axes[2].plot(xs, [r[throughput_key] for r in rows], "o-", color="tab:green")
    axes[2].set_ylabel("output tokens/s")
    for ax in axes:
        ax.set_xlabel(x_label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
