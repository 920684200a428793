"""KV-cache groups: how a model's layers share block tables and cache storage.

A model whose layers all attend alike needs one block table per sequence: layer ``l``'s
K/V for block ``b`` lives at ``cache[l, :, b]``. A hybrid model (Gemma 2: local and global
layers alternating; Gemma 3: five local layers per global one) has layers that stop reading a
block once it falls behind their window while global layers read it forever; with one table
the block stays allocated for every layer, so a window saves nothing.

vLLM's hybrid KV-cache manager (its `KVCacheGroupSpec`s) splits the layers into groups of
equal size, one kind of attention per group, each group with its own block table. Block
``b`` of the pool then holds the K/V of *one group's* layers: the cache is
``[group_size, heads, blocks, block_size, head_dim]`` and a layer reads slot
``slot_of_layer[l]`` through table ``group_of_layer[l]``. Windowed groups release blocks
behind their window, so at long context each windowed group holds about a window's worth of
blocks while the global group holds everything (Gemma 3 270M, 5:1, window 512, 8k tokens:
about 22% of the full cache).

The group size is the count of the rarest kind; a kind whose count it does not divide gets a
last group with unused slots (Gemma 3 1B: 4 global, 22 local layers, size 4: 7 groups, 2 of
28 slots idle, 7% of the cache).

Pure Python: the block manager and the runner both read the layout.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroupLayout:
    """``group_windows[g]``: the sliding window of group g's layers (0: global);
    ``group_of_layer[l]`` / ``slot_of_layer[l]``: the table and cache slot of layer l."""

    group_windows: tuple[int, ...]
    group_of_layer: tuple[int, ...]
    slot_of_layer: tuple[int, ...]
    num_slots: int

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def hybrid(self) -> bool:
        return self.num_groups > 1

    def layers_of_group(self, g: int) -> list[int]:
        return [layer for layer, x in enumerate(self.group_of_layer) if x == g]


def single_group(num_layers: int, window: int = 0) -> KVGroupLayout:
    """One table for every layer; ``window``: released behind it (every layer windowed)."""
    return KVGroupLayout((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)


def plan_kv_groups(windows: tuple[int, ...], hybrid: bool = True) -> KVGroupLayout:
    """The layout for per-layer ``windows`` (0: global layer).

    One group unless the model mixes windowed and global layers and ``hybrid`` is on; a model
    whose layers are all windowed (Mistral) is one group released behind its widest window.
    """
    n = len(windows)
    if n == 0:
        raise ValueError("a model needs at least one layer")
    if any(w < 0 for w in windows):
        raise ValueError("windows must be >= 0 (0: global)")
    if not any(windows):
        return single_group(n)
    if all(windows) or not hybrid:
        return single_group(n, max(windows) if all(windows) else 0)
    counts = Counter(windows)
    size = min(counts.values())
    group_windows: list[int] = []
    group_of = [0] * n
    slot_of = [0] * n
    # Kinds in order of first appearance, so a layout reads like the model.
    for kind in dict.fromkeys(windows):
        layers = [i for i, w in enumerate(windows) if w == kind]
        for start in range(0, len(layers), size):
            g = len(group_windows)
            group_windows.append(kind)
            for slot, layer in enumerate(layers[start : start + size]):
                group_of[layer] = g
                slot_of[layer] = slot
    return KVGroupLayout(tuple(group_windows), tuple(group_of), tuple(slot_of), size)
