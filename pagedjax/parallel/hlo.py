"""Count the collectives XLA inserted into a compiled (partitioned) step.

The layers are one `lax.scan`, i.e. one HLO `while` whose body is the layer: collectives
reachable from a while body are per layer, the rest run once per step (embedding lookup,
logits gather). Used by `bench/tensor_parallel.py` and the TP tests.
"""

from __future__ import annotations

import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def count_collectives(hlo: str) -> dict[str, dict[str, int]]:
    """Collective ops in the scanned layer body (= per layer) and elsewhere in the module."""
    comps: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if m:
            current = m.group(1)
            comps[current] = []
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))

    def reachable(roots: set[str]) -> set[str]:
        seen, todo = set(), list(roots)
        while todo:
            c = todo.pop()
            if c in seen or c not in comps:
                continue
            seen.add(c)
            for line in comps[c]:
                todo += re.findall(r"(?:calls|to_apply|body|condition|branch_computations)="
                                   r"\{?%?([\w.\-]+)", line)
        return seen

    in_body = reachable(bodies)

    def count(names) -> dict[str, int]:
        out = {}
        for op in COLLECTIVES:
            pat = re.compile(rf"= [^=]*\b{op}(?:-start)?\(")
            n = sum(1 for c in names for line in comps[c] if pat.search(line))
            if n:
                out[op] = n
        return out

    return {"per_layer": count(in_body), "outside_layers": count(set(comps) - in_body)}
