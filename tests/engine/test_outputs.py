"""`running_delta` builds a streamed step's `RequestOutput` without the dataclass `__init__`s:
it must equal the constructors' result and leave no field unset."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from pagedjax.outputs import CompletionOutput, RequestOutput, running_delta


@given(rid=st.text(max_size=5), prompt=st.none() | st.text(max_size=5),
       ids=st.lists(st.integers(0, 10**6), max_size=4), index=st.integers(0, 8),
       text=st.text(max_size=5), toks=st.lists(st.integers(0, 10**6), max_size=4),
       cached=st.integers(0, 64), sched=st.none() | st.floats(0, 1e6),
       lp=st.none() | st.tuples(st.floats(-50, 0), st.lists(
           st.dictionaries(st.integers(0, 10**5), st.floats(-50, 0), max_size=3), max_size=3)))
def test_running_delta_equals_the_constructors(rid, prompt, ids, index, text, toks, cached,
                                               sched, lp):
    """With logprobs too (`OutputProcessor.make_output`'s running delta rows with logprobs
    or stop strings)."""
    if lp is None:
        got = running_delta(rid, prompt, ids, index, text, toks, cached, sched)
        comp = CompletionOutput(index, text, toks)
    else:
        got = running_delta(rid, prompt, ids, index, text, toks, cached, sched, *lp)
        comp = CompletionOutput(index, text, toks, *lp)
    want = RequestOutput(rid, prompt, ids, [comp], False, None, cached, None, sched)
    assert type(got) is RequestOutput and type(got.outputs[0]) is CompletionOutput
    assert got == want
    # Every field is set: a field added to either class and not to `running_delta` fails
    # here (an unset slot raises AttributeError), not in a client reading it.
    for obj, cls in ((got, RequestOutput), (got.outputs[0], CompletionOutput)):
        for f in dataclasses.fields(cls):
            getattr(obj, f.name)
    assert got.outputs[0].finished() is False
    assert dataclasses.asdict(got) == dataclasses.asdict(want)
