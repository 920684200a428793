"""PNG figures from the paper-reproduction JSON (one call: :func:`plot_all`)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SYSTEMS = ("paged", "contiguous-oracle", "contiguous-pow2", "contiguous-max", "static")
LABELS = {"paged": "pagedjax (paged)", "contiguous-oracle": "Orca (Oracle)",
          "contiguous-pow2": "Orca (Pow2)", "contiguous-max": "Orca (Max)", "static": "Static (FT-like)"}
WORKLOADS = ("sharegpt", "alpaca")
MEM = ("token_states", "reserved", "internal", "external")


def _fig12(result: dict, out: Path, prefix: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, w in zip(axes, WORKLOADS):
        sw = {**result[f"fig12_{w}"], "real": result.get(f"real_{w}", {}),
              "title": f"{w}-like (lines: replay clock; stars: real execution)"}
        _panel(ax, sw)
    fig.tight_layout()
    fig.savefig(out / f"{prefix}fig12_normalized_latency.png", dpi=110)
    plt.close(fig)


def _bars(result: dict, key: str, field: str, ylabel: str, fname: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, w in zip(axes, WORKLOADS):
        d = result[f"{key}_{w}"]
        vals = [d["per_system"][s][field] for s in SYSTEMS]
        ax.bar(range(len(SYSTEMS)), vals)
        ax.set_xticks(range(len(SYSTEMS)), [LABELS[s] for s in SYSTEMS], rotation=20, fontsize=7)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{w}-like @ {d['rate']:.2f} req/s (replay)")
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=7)
    fig.tight_layout()
    fig.savefig(fname, dpi=110)
    plt.close(fig)


def _fig2(result: dict, out: Path, prefix: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, w in zip(axes, WORKLOADS):
        d = result[f"fig2_{w}"]["per_system"]
        bottom = [0.0] * len(SYSTEMS)
        for cat in MEM:
            vals = [100 * d[s]["memory_fractions"][cat] for s in SYSTEMS]
            ax.bar(range(len(SYSTEMS)), vals, bottom=bottom, label=cat)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for i, s in enumerate(SYSTEMS):
            ax.text(i, 2, f"{100 * d[s]['memory_fractions']['token_states']:.1f}%", ha="center", fontsize=7)
        ax.set_xticks(range(len(SYSTEMS)), [LABELS[s] for s in SYSTEMS], rotation=20, fontsize=7)
        ax.set_ylabel("KV cache usage (%)")
        ax.set_title(f"{w}-like, overloaded (replay)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{prefix}fig2_memory_waste.png", dpi=110)
    plt.close(fig)


def _fig18b(result: dict, out: Path, prefix: str) -> None:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for w in WORKLOADS:
        d = result[f"fig18b_{w}"]["per_block_size"]
        bss = sorted(d, key=int)
        ax.plot([int(b) for b in bss], [d[b]["normalized_latency_s_per_token"] for b in bss], marker="o",
                label=f"{w}-like")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title("Block size (replay, paged)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{prefix}fig18b_block_size.png", dpi=110)
    plt.close(fig)


def plot_all(result: dict, out: Path, prefix: str = "") -> None:
    out = Path(out)
    _fig12(result, out, prefix)
    _bars(result, "fig13", "avg_batched_requests", "avg batched requests",
          out / f"{prefix}fig13_batched_requests.png")
    _fig2(result, out, prefix)
    _fig18b(result, out, prefix)


def _panel(ax, sw: dict) -> None:
    """One rate sweep of :func:`bench.paper.figures.sweep_panel`: lines replay, stars real."""
    from bench.paper.figures import LABELS as PANEL_LABELS

    colors = {}
    for s, d in sw["systems"].items():
        (line,) = ax.plot(d["rates"], d["normalized_latency"], marker="o", ms=3,
                          label=f"{PANEL_LABELS[s]} ({'' if d.get('bounded', True) else '>='}"
                                f"{d['sustainable_rate']:.2f} req/s)")
        colors[s] = line.get_color()
    for s, pt in sw.get("real", {}).items():
        ax.scatter([pt["rate"]], [pt["real"]["normalized_latency_s_per_token"]], marker="*", s=120,
                   color=colors[s], edgecolor="k", zorder=5)
    ax.axhline(sw["threshold_s_per_token"], color="gray", ls="--", lw=0.8)
    ax.set_ylim(0, 3 * sw["threshold_s_per_token"])
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(sw["title"], fontsize=9)
    ax.legend(fontsize=6)


def _panels(result: dict, keys: list[str], shape: tuple[int, int], path: Path, title: str, note: str) -> None:
    keys = [k for k in keys if k in result]
    if not keys:
        return
    fig, axes = plt.subplots(*shape, figsize=(4.2 * shape[1], 3.6 * shape[0]), squeeze=False)
    for ax, k in zip(axes.flat, keys):
        _panel(ax, result[k])
    fig.suptitle(f"{title} ({note})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fig19b(result: dict, path: Path) -> None:
    d = result["fig19b"]["per_block_size"]
    bss = sorted(d, key=int)
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for j, m in enumerate(("recompute", "swap")):
        vals = [d[b][m]["normalized_latency_s_per_token"] for b in bss]
        ax.bar([i + 0.4 * j for i in range(len(bss))], vals, width=0.4, label=f"{m} (replay)")
    for m, pt in result["fig19b"].get("real", {}).items():
        i = bss.index(next(b for b in bss if int(b) == result["config"]["block_size"]))
        ax.scatter([i + 0.4 * (m == "swap")], [pt["real"]["normalized_latency_s_per_token"]], marker="*",
                   s=120, color="k", zorder=5, label="real execution" if m == "recompute" else None)
    ax.set_xticks([i + 0.2 for i in range(len(bss))], [str(b) for b in bss])
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(f"ShareGPT-like @ {result['fig19b']['rate']:.2f} req/s: recompute vs swap", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_more(result: dict, out: Path, prefix: str = "",
              note: str = "lines: replay clock; stars: real execution") -> None:
    """Fig. 14, 16, 17 and 19b from a ``--figures 14,16,17,19`` run."""
    out = Path(out)
    _panels(result, [f"fig14_{m}{k}" for m in ("parallel", "beam") for k in (2, 4, 6)], (2, 3),
            out / f"{prefix}fig14_parallel_beam.png", "Fig. 14: parallel sampling and beam search", note)
    _panels(result, ["fig16_1shot", "fig16_5shot"], (1, 2), out / f"{prefix}fig16_shared_prefix.png",
            "Fig. 16: shared prefix", note)
    _panels(result, ["fig17_chatbot"], (1, 1), out / f"{prefix}fig17_chatbot.png", "Fig. 17: chatbot", note)
    if "fig19b" in result:
        _fig19b(result, out / f"{prefix}fig19b_recompute_vs_swap.png")


if __name__ == "__main__":
    import json
    import sys

    p = Path(sys.argv[1])
    r = json.load(open(p))
    (plot_all if "fig12_sharegpt" in r else plot_more)(r, p.parent, sys.argv[2] if len(sys.argv) > 2 else "")
