"""A steady cohort's sampling metadata, kept across its steps.

A steady decode step (`core.steady_decode`) samples the same sequences, in the same order, as
the step before. For rows whose sampling never changes once they are past ``min_tokens`` (no
grammar or bad words to follow: `RequestState.fixed_sampling`), every field of
`SamplingMetadata` but the penalty histories is fixed by the requests except ``step``, the
count of tokens each row has generated (its random stream). Building the metadata row by
row took ~0.45 ms of a 256-row sampled step's host time on the Xeon host (rows,
`SamplingBatch` gather, assembly), about as much as the rest of the launch; kept, a step
makes ``step`` from the rows' output lists and replaces it (`bench/host_overhead.py
--mixes sampled`).

Penalised rows qualify where their histories are kept on the device (`HistorySlots`): the
kept metadata leaves the histories out, and each step gathers them as a built one does.

A cohort cut down (sequences ended) cuts its metadata the same way, rows kept in order and
padded again: host arrays are cut, empty device arrays (`DeviceFill`'s) replaced by the empty
ones of the new batch; a written device array (a token mask, a logit bias) would have to be
cut on the device, so the next step builds the metadata afresh instead. The result equals
the metadata built for the step from its rows, field for field
(`tests/engine/test_cohort_metadata.py`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pagedjax.sampler import DeviceFill, SamplingMetadata, param_columns

_SCALARS = ("engine_seed", "all_greedy", "do_top_k_top_p", "do_min_p", "want_topk")


@dataclasses.dataclass
class _Kept:
    key: int  # the cohort's
    b: int  # the sampler batch it was built for
    meta: SamplingMetadata
    outs: list[list[int]]  # each row's output list (a sequence keeps its list for life)
    wants: np.ndarray  # [rows] bool: the row's request wants logprobs


class CohortMetadata:
    """The sampling metadata of the steady cohort last seen, and the cohorts refused."""

    def __init__(self, vocab_size: int, fill: DeviceFill | None) -> None:
        self._columns = param_columns(vocab_size)
        self._vocab_size = vocab_size
        self._fill = fill
        self._kept: _Kept | None = None
        self._refused: int | None = None  # a cohort key with a row that never qualifies
        self.num_hits = 0  # steps given kept metadata (for tests and benchmarks)
        self.num_cuts = 0

    def get(self, cohort, b: int, pending: int) -> SamplingMetadata | None:
        """This step's metadata for ``cohort``'s rows at sampler batch ``b`` (each row has
        ``pending`` tokens on the device), or None: not kept, or the step must build it."""
        kept = self._kept
        if kept is None:
            return None
        if kept.key != cohort.key:
            parent = cohort.parent
            if parent is None or parent[0] != kept.key:
                return None
            kept = self._kept = self._cut(kept, cohort.key, parent[1], b)
            if kept is None:
                return None
            self.num_cuts += 1
        elif kept.b != b:
            return None
        outs = kept.outs
        n = len(outs)
        step = np.zeros(b, np.int32)
        step[:n] = np.fromiter(map(len, outs), np.int32, n)
        if pending:
            step[:n] += pending
        self.num_hits += 1
        return kept.meta.replace(step=step)

    def refused(self, cohort) -> bool:
        """Whether ``cohort`` has a row whose metadata follows its tokens (see `keep`)."""
        return self._refused == cohort.key

    def keep(self, cohort, b: int, meta: SamplingMetadata, outs: list[list[int]],
             wants: list[bool] | None) -> None:
        """Keep ``meta``, built for ``cohort``'s rows this step (histories left to the
        device), for its next steps; ``wants`` (each row wants logprobs) None: a row of it
        never qualifies (grammar, bad words, host-packed histories), so it is not kept and the
        cohort is not offered again."""
        if wants is None:
            self._refused = cohort.key
            self._kept = None
            return
        self._kept = _Kept(cohort.key, b, meta, outs, np.array(wants, bool))

    def _cut(self, kept: _Kept, key: int, rows: list[int], b: int) -> _Kept | None:
        """``kept`` cut to ``rows`` (indices, in order), padded to ``b``; None where an array
        written on the device would have to be cut too (a device op, compiled)."""
        meta, fill = kept.meta, self._fill
        idx = np.asarray(rows, np.intp)
        n = len(idx)
        fields: dict[str, object] = {}
        for name, dtype, pad in (*self._columns, ("step", np.int32, 0)):
            col = np.full(b, pad, dtype)
            col[:n] = getattr(meta, name)[idx]
            fields[name] = col
        # The id-list arrays are present at their fixed widths iff a row is penalised,
        # banned, masked or biased (`SamplingMetadata.assemble`'s ``full``): whether that
        # still holds of the rows kept. (Past min_tokens, none is banned.)
        wide = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)
                if f.name not in _SCALARS and getattr(meta, f.name) is not None
                and getattr(meta, f.name).ndim == 2}
        full = any(a.shape[1] for a in wide.values())
        if full:
            full = bool(((fields["presence_penalty"] != 0) | (fields["frequency_penalty"] != 0)
                         | (fields["repetition_penalty"] != 1))[:n].any())
            for name in ("banned_token_ids", "allowed_bitmask", "bias_token_ids"):
                a = wide[name]
                if isinstance(a, np.ndarray):
                    full = full or bool((a[idx] != -1).any())
                elif fill is None or a is not fill.blank(a.shape, -1, a.dtype):
                    return None
        for name, a in wide.items():
            # Id lists pad with -1, biases with 0 (`SamplingMetadata.assemble`).
            pad = -1 if a.dtype.kind in "iu" else 0.0
            width = a.shape[1] if full else 0
            if isinstance(a, np.ndarray):
                out = np.full((b, width), pad, a.dtype)
                if width:
                    out[:n] = a[idx]
                fields[name] = out
            elif a is fill.blank(a.shape, pad, a.dtype):
                fields[name] = fill.blank((b, width), pad, a.dtype)
            else:  # a written bias's values: the ids were checked above
                return None
        if not full and meta.output_token_ids is None:  # histories left to the device: none
            fields["output_token_ids"] = np.full((b, 0), -1, np.int32)
            fields["prompt_token_ids"] = np.full((b, 0), -1, np.int32)
        temperature, top_k, top_p, min_p = (fields[k] for k in ("temperature", "top_k",
                                                                 "top_p", "min_p"))
        wants = kept.wants[idx]
        meta = meta.replace(
            **fields,
            all_greedy=np.bool_(not temperature.any()),
            do_top_k_top_p=np.bool_((top_k < self._vocab_size).any() or (top_p < 1.0).any()),
            do_min_p=np.bool_((min_p > 0.0).any()),
            want_topk=np.bool_(wants.any()))
        return _Kept(key, b, meta, [kept.outs[i] for i in rows], wants)
