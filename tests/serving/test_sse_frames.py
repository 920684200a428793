"""A running choice's SSE event from its frame (`http.text_frame`): the same bytes as the whole
chunk encoded (`http.sse_chunk`), whatever the text, the ids a client sets or the choice index,
completions and chat alike."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.serving.http import _TEXT_SLOT, running_choice, sse_chunk, text_frame

# Text a client or a model can make: quotes, backslashes, control characters, non-ASCII,
# surrogate pairs' characters, and the placeholder itself.
TEXTS = st.one_of(st.text(), st.sampled_from(['"', "\\", "\n\t", "\x00", "é😀", _TEXT_SLOT,
                                              f'a{_TEXT_SLOT}"b', ""]))


@settings(max_examples=300, deadline=None)
@given(text=TEXTS, rid=TEXTS, model=TEXTS, idx=st.integers(0, 300), chat=st.booleans(),
       created=st.integers(0, 2**40))
def test_a_frame_with_its_text_is_the_whole_chunk(text, rid, model, idx, chat, created):
    meta = {"id": rid, "created": created, "model": model}
    obj = "chat.completion.chunk" if chat else "text_completion"
    head, tail = text_frame(meta, obj, idx, chat)
    got = f"{head}{json.dumps(text)}{tail}"
    assert got == sse_chunk(meta, obj, running_choice(idx, text, chat))
    event = json.loads(got.removeprefix("data: "))
    choice = event["choices"][0]
    assert event["id"] == rid and event["model"] == model and choice["index"] == idx
    assert (choice["delta"]["content"] if chat else choice["text"]) == text
    assert choice["finish_reason"] is None and choice["logprobs"] is None


def test_the_chunk_format_is_openais():
    """The event as OpenAI's streams carry it (what the general path wrote before frames)."""
    meta = {"id": "cmpl-1", "created": 7, "model": "m"}
    assert sse_chunk(meta, "text_completion", running_choice(2, "hi", False)) == (
        'data: {"id": "cmpl-1", "created": 7, "model": "m", "object": "text_completion", '
        '"choices": [{"index": 2, "text": "hi", "logprobs": null, "finish_reason": null}]}\n\n')
    head, tail = text_frame(meta, "chat.completion.chunk", 0, True)
    assert head + '"x"' + tail == (
        'data: {"id": "cmpl-1", "created": 7, "model": "m", "object": "chat.completion.chunk", '
        '"choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": null, '
        '"finish_reason": null}]}\n\n')
