"""Markdown tables from the paper-reproduction JSON (pasted into docs/paper-reproduction.md)."""

from __future__ import annotations

import json
import sys

from bench.paper.plots import LABELS, SYSTEMS, WORKLOADS


def tables(r: dict) -> str:
    out = []
    cm = r["cost_model"]
    out.append(f"Cost model (s): {', '.join(f'{n}={c:.4g}' for n, c in zip(cm['features'], cm['coef_s']))}; "
               f"{cm['num_calib_steps']} calibration steps, per-step MAPE {cm['in_sample_step_mape']:.0%}.\n")
    out.append("| workload | system | sustainable rate (req/s, replay) | paged / system | avg batched reqs "
               "@ paged's rate | token states (overloaded) |")
    out.append("|---|---|---|---|---|---|")
    for w in WORKLOADS:
        sw = r[f"fig12_{w}"]["systems"]
        p = sw["paged"]["sustainable_rate"]
        for s in SYSTEMS:
            x = sw[s]["sustainable_rate"]
            b = r[f"fig13_{w}"]["per_system"][s]["avg_batched_requests"]
            tok = r[f"fig2_{w}"]["per_system"][s]["memory_fractions"]["token_states"]
            ratio = p / x if x else float("inf")
            out.append(f"| {w} | {LABELS[s]} | {x:.3f} | {ratio:.2f}x | {b:.1f} | {tok:.1%} |")
    out.append("\nMemory breakdown at 1.5x paged's sustainable rate (replay, time-averaged):\n")
    out.append("| workload | system | token states | reserved | internal frag | external frag & others |")
    out.append("|---|---|---|---|---|---|")
    for w in WORKLOADS:
        for s in SYSTEMS:
            m = r[f"fig2_{w}"]["per_system"][s]["memory_fractions"]
            out.append(f"| {w} | {LABELS[s]} | {m['token_states']:.1%} | {m['reserved']:.1%} | "
                       f"{m['internal']:.1%} | {m['external']:.1%} |")
    out.append("\nReal execution vs replay of the identical trace:\n")
    out.append("| workload | system | rate | reqs | real norm. latency (s/tok) | replay | error "
               "| real avg batch | replay avg batch | compile steps (stall cut) |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for w in WORKLOADS:
        for s, pt in r.get(f"real_{w}", {}).items():
            a, b = pt["real"], pt["replay"]
            nl = "normalized_latency_s_per_token"
            out.append(f"| {w} | {LABELS[s]} | {pt['rate']:.3f} | {pt['num_requests']} | "
                       f"{a[nl]:.3f} | {b[nl]:.3f} | {pt['rel_error']:+.0%} | "
                       f"{a['avg_batched_requests']:.1f} | {b['avg_batched_requests']:.1f} | "
                       f"{a.get('compile_steps', '?')} ({a.get('compile_stall_removed_s', 0):.0f} s) |")
    out.append("\nBlock size (paged, replay, at paged's sustainable rate; same KV bytes):\n")
    out.append("| workload | " + " | ".join(str(b) for b in (8, 16, 32, 64, 128, 256)) + " |")
    out.append("|---|" + "---|" * 6)
    for w in WORKLOADS:
        d = r[f"fig18b_{w}"]["per_block_size"]
        out.append(f"| {w} | " + " | ".join(f"{d[str(b)]['normalized_latency_s_per_token']:.2f}"
                                             for b in (8, 16, 32, 64, 128, 256)) + " |")
    return "\n".join(out)


def more_tables(r: dict) -> str:
    """Tables for a ``--figures 14,16,17,19`` run."""
    from bench.paper.figures import LABELS as PL

    nl = "normalized_latency_s_per_token"
    cm = r["cost_model"]
    out = [f"Cost model (s): {', '.join(f'{n}={c:.4g}' for n, c in zip(cm['features'], cm['coef_s']))}; "
           f"{cm['num_calib_steps']} calibration steps, per-step MAPE {cm['in_sample_step_mape']:.0%}.\n",
           "| panel | system | sustainable rate (req/s, replay) | first system / this "
           "| blocks copied @ lowest rate |",
           "|---|---|---|---|---|"]
    keys = [k for k in r if k.startswith(("fig14_", "fig16_", "fig17_"))]
    for k in keys:
        sw = r[k]
        for s, d in sw["systems"].items():
            ratio = sw["ratio_first_over"].get(s)
            out.append(f"| {sw['title']} | {PL[s]} | {d['sustainable_rate']:.3f} | "
                       f"{'' if ratio is None else f'{ratio:.2f}x'} | {d['blocks_copied'][0]} |")
    out += ["\nReal execution vs replay of the identical trace:\n",
            "| panel | system | rate | reqs | real norm. latency | replay | error | real avg batch | "
            "replay avg batch | blocks copied real / replay | compile steps |", "|---" * 11 + "|"]
    for k, kind in [(k, "real") for k in keys] + [("fig19b", "real"), ("fig19b", "real_burst")]:
        for s, pt in r.get(k, {}).get(kind, {}).items():
            a, b = pt["real"], pt["replay"]
            burst = " burst" if kind == "real_burst" else ""
            title = r[k].get("title") or (f"ShareGPT-like{burst}, {a['preemptions']} / "
                                          f"{b['preemptions']} preemptions (real / replay)")
            out.append(f"| {title} | {PL[s]} | {pt['rate']:.3f} | {pt['num_requests']} | {a[nl]:.3f} | "
                       f"{b[nl]:.3f} | {pt['rel_error']:+.0%} | {a['avg_batched_requests']:.1f} | "
                       f"{b['avg_batched_requests']:.1f} | {a['blocks_copied']} / {b['blocks_copied']} | "
                       f"{a['compile_steps']} |")
    if "fig19b" in r:
        d = r["fig19b"]["per_block_size"]
        out += [f"\nFig. 19b (replay, ShareGPT-like @ {r['fig19b']['rate']:.3f} req/s):\n",
                "| block size | recompute (s/token) | swap (s/token) | preemptions (rec / swap) "
                "| blocks swapped out |",
                "|---|---|---|---|---|"]
        for bs in sorted(d, key=int):
            rc, sw = d[bs]["recompute"], d[bs]["swap"]
            out.append(f"| {bs} | {rc[nl]:.3f} | {sw[nl]:.3f} | {rc['preemptions']} / {sw['preemptions']} | "
                       f"{sw['blocks_swapped_out']} |")
    return "\n".join(out)


if __name__ == "__main__":
    res = json.load(open(sys.argv[1]))
    print(tables(res) if "fig12_sharegpt" in res else more_tables(res))
