"""Bounded fuzz of the gRPC front door: whatever a client sends, never INTERNAL or UNKNOWN.

Why: INTERNAL/UNKNOWN tell a client "the server broke", and usually mean a value got past
validation (into the engine thread) or a handler raised. Messages are generated from the proto
descriptors, so every field of every request message is covered, with extreme values (NaN/inf,
int32/int64 limits, odd Unicode, empty oneofs); raw bytes cover bodies that do not decode.
Afterwards the server must still be SERVING, answer a normal Generate, and hold no request.
Deterministic (derandomized) and bounded (a fake engine, <= 4 tokens per request).
"""

from __future__ import annotations

import math

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as F
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pagedjax.serving.client import Client
from pagedjax.serving.convert import params_to_proto
from pagedjax.serving.proto import pagedjax_pb2 as pb
from tests.serving.fuzz_support import SANE_SAMPLING, FuzzFakeEngine, wait_idle
from tests.serving.inproc import InProcessServer

SERVICE = "/pagedjax.v1.PagedJax"
# A client's mistake or a server's refusal, never "the server broke".
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED,
           grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS}
FUZZ = settings(max_examples=300, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])
TIMEOUT_S = 10.0

# ---- strategies from the descriptors -----------------------------------------------------------

_I32, _I64 = 2**31 - 1, 2**63 - 1
_TEXT = st.one_of(
    st.text(alphabet=st.characters(codec="utf-8"), max_size=40),  # NUL, controls, RTL, astral, ...
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=40),  # printable
    st.sampled_from(["", " ", "\x00", "\u202e\u0301", "\U0001f600" * 3, "a" * 5000, "\r\n", "boo\u200bm"]),
)


def _int(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(-3, 70), st.integers(lo, hi), st.sampled_from([lo, hi, lo + 1, hi - 1]))


_SCALARS = {
    F.TYPE_INT32: _int(-_I32 - 1, _I32), F.TYPE_INT64: _int(-_I64 - 1, _I64),
    F.TYPE_DOUBLE: st.one_of(st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 5e-324,
                                                           1.7976931348623157e308])),
    F.TYPE_BOOL: st.booleans(), F.TYPE_STRING: _TEXT,
}


def _value(field) -> st.SearchStrategy:
    if field.type == F.TYPE_MESSAGE:
        return messages(field.message_type)
    if field.type not in _SCALARS:  # a new field type in the proto: give it a strategy here
        raise NotImplementedError(f"no fuzz strategy for {field.full_name} (type {field.type})")
    return _SCALARS[field.type]


def _real_oneof(field):
    """The field's oneof, unless it is the synthetic one of a proto3 `optional`."""
    o = field.containing_oneof
    return o if o is not None and len(o.fields) > 1 else None


@st.composite
def _message(draw, descriptor):
    cls = getattr(pb, descriptor.name)
    msg = cls()
    oneofs = {o.name: o for o in descriptor.oneofs if len(o.fields) > 1}
    chosen = {name: draw(st.sampled_from([None, *o.fields])) for name, o in oneofs.items()}
    for field in descriptor.fields:
        oneof = _real_oneof(field)
        if oneof is not None and chosen[oneof.name] is not field:
            continue  # another member of the oneof, or none at all (an empty oneof)
        if field.has_presence and not field.is_repeated and oneof is None \
                and not draw(st.booleans()):
            continue  # unset optional field / message
        _fill(draw, msg, field)
    return msg


def _is_map(field) -> bool:
    return field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _fill(draw, msg, field) -> None:
    """Set `field` of `msg` to a drawn value: scalars, messages, repeated fields and maps."""
    target = getattr(msg, field.name)
    if _is_map(field):
        key, value = (field.message_type.fields_by_name[n] for n in ("key", "value"))
        for k, v in draw(st.lists(st.tuples(_value(key), _value(value)), max_size=4)):
            target[k] = v
    elif field.is_repeated:
        values = draw(st.lists(_value(field), max_size=4))
        if field.type == F.TYPE_MESSAGE:
            for v in values:
                target.add().CopyFrom(v)
        else:
            target.extend(values)
    elif field.type == F.TYPE_MESSAGE:
        target.CopyFrom(draw(_value(field)))
    else:
        setattr(msg, field.name, draw(_value(field)))


def messages(descriptor) -> st.SearchStrategy:
    """Any message of this type: every field drawn from its wire type's extreme values."""
    return st.deferred(lambda: _message(descriptor))


@st.composite
def _mostly_sane_generate(draw):
    """Valid params and prompt plus at most one field replaced by an arbitrary value, so that
    requests reach the engine (scheduler, sampler) instead of stopping at the first check."""
    params = draw(SANE_SAMPLING)
    msg = pb.GenerateRequest(params=params_to_proto(params), stream=draw(st.booleans()))
    if draw(st.booleans()):
        msg.prompt = draw(st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=30))
    else:
        msg.prompt_token_ids.ids.extend(draw(st.lists(st.integers(0, 99), min_size=1, max_size=30)))
    if draw(st.booleans()):
        field = draw(st.sampled_from(list(pb.SamplingParams.DESCRIPTOR.fields)))
        msg.params.ClearField(field.name)
        _fill(draw, msg.params, field)
    return msg


GENERATE_REQUESTS = st.one_of(messages(pb.GenerateRequest.DESCRIPTOR), _mostly_sane_generate())

# ---- the server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    fake = FuzzFakeEngine(step_s=0.001)
    srv = InProcessServer(fake, tmp_path_factory.mktemp("fuzz-grpc")).start()
    client = Client(srv.target, timeout=TIMEOUT_S)
    client.wait_ready(10)
    channel = grpc.insecure_channel(srv.target)
    yield fake, client, channel
    channel.close()
    client.close()
    assert srv.close() == 0


def _status(fn) -> tuple[grpc.StatusCode, str]:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def _stub(channel, method: str, request_cls, response_cls, stream: bool = False, raw: bool = False,
          timeout: float = TIMEOUT_S):
    make = channel.unary_stream if stream else channel.unary_unary
    ser = (lambda b: b) if raw else request_cls.SerializeToString
    call = make(f"{SERVICE}/{method}", request_serializer=ser, response_deserializer=response_cls.FromString)
    if stream:
        return lambda req: list(call(req, timeout=timeout))
    return lambda req: call(req, timeout=timeout)


METHODS = {  # name: (request, response, server-streaming)
    "Generate": (pb.GenerateRequest, pb.GenerateResponse, True),
    "Abort": (pb.AbortRequest, pb.AbortResponse, False),
    "GetModelInfo": (pb.ModelInfoRequest, pb.ModelInfo, False),
    "GetStats": (pb.StatsRequest, pb.Stats, False),
}


def _check(code, details, what) -> None:
    assert code in ALLOWED, f"{what}: {code} {details!r}"
    if code != grpc.StatusCode.OK:
        assert details, f"{what}: {code} without a message"


# ---- the fuzzers -------------------------------------------------------------------------------


def _hi(**params) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(**params))


@example(req=pb.GenerateRequest(), deadline=TIMEOUT_S)  # no input at all (empty oneof)
@example(req=_hi(temperature=math.nan), deadline=TIMEOUT_S)
@example(req=_hi(max_tokens=-(2**31)), deadline=TIMEOUT_S)
@example(req=_hi(early_stopping="\x00"), deadline=TIMEOUT_S)
@example(req=_hi(prompt_logprobs=-1), deadline=TIMEOUT_S)  # finding: was UNIMPLEMENTED
@FUZZ
@given(req=GENERATE_REQUESTS, deadline=st.sampled_from([TIMEOUT_S, TIMEOUT_S, TIMEOUT_S, 0.002, 0.02]))
def test_fuzz_generate(live, req, deadline):
    """Short deadlines cancel requests mid-flight: DEADLINE_EXCEEDED then, and nothing may leak."""
    _, _, channel = live
    call = _stub(channel, "Generate", pb.GenerateRequest, pb.GenerateResponse, stream=True,
                 timeout=deadline)
    code, details = _status(lambda: call(req))
    if deadline < TIMEOUT_S and code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return
    _check(code, details, f"Generate({req})")


@settings(FUZZ, max_examples=60)
@given(method=st.sampled_from(["Abort", "GetModelInfo", "GetStats"]), data=st.data())
def test_fuzz_unary_rpcs(live, method, data):
    _, _, channel = live
    req_cls, resp_cls, _ = METHODS[method]
    req = data.draw(messages(req_cls.DESCRIPTOR))
    code, details = _status(lambda: _stub(channel, method, req_cls, resp_cls)(req))
    _check(code, details, f"{method}({req})")


def _mutations(valid: bytes) -> st.SearchStrategy[bytes]:
    """Valid bytes truncated, extended or with one byte changed (tag/length/varint damage)."""
    return st.one_of(
        st.integers(0, max(0, len(valid) - 1)).map(lambda n: valid[:n]),
        st.binary(max_size=8).map(lambda tail: valid + tail),
        st.tuples(st.integers(0, max(0, len(valid) - 1)), st.integers(0, 255)).map(
            lambda p: valid[:p[0]] + bytes([p[1]]) + valid[p[0] + 1:]),
    )


_VALID_GENERATE = pb.GenerateRequest(prompt="hello", params=pb.SamplingParams(max_tokens=2, stop=["x"]),
                                     stream=True).SerializeToString()


@example(method="Generate", body=b"\x12\x02\xff\xfe")  # prompt (field 2) that is not UTF-8
@example(method="Generate", body=b"\x22\x03\x52\x01\xff")  # params.early_stopping not UTF-8
@example(method="Generate", body=b"\x1a\x05\x0a\x03\xff\xff\xff")  # truncated packed token ids
@example(method="Abort", body=b"\x0a\x01\xc0")  # an id that is not UTF-8
@settings(FUZZ, max_examples=200)
@given(method=st.sampled_from(sorted(METHODS)),
       body=st.one_of(st.binary(max_size=64), _mutations(_VALID_GENERATE)))
def test_fuzz_raw_bytes(live, method, body):
    """Bodies that may not decode: INVALID_ARGUMENT (or OK if they happen to), never UNKNOWN."""
    _, _, channel = live
    req_cls, resp_cls, stream = METHODS[method]
    call = _stub(channel, method, req_cls, resp_cls, stream=stream, raw=True)
    code, details = _status(lambda: call(body))
    _check(code, details, f"{method}({body!r})")


def test_out_of_range_unsupported_field_is_invalid_argument(live):
    """Fuzz finding: prompt_logprobs=-1 was UNIMPLEMENTED (the field is unsupported) although the
    value is simply out of range; an in-range value is the unsupported feature."""
    _, client, _ = live
    bad = _status(lambda: client.generate("hi", {"prompt_logprobs": -1}))
    assert bad[0] == grpc.StatusCode.INVALID_ARGUMENT and bad[1].startswith("prompt_logprobs"), bad
    assert _status(lambda: client.generate("hi", {"prompt_logprobs": 2}))[0] == grpc.StatusCode.UNIMPLEMENTED


def test_still_serving_and_nothing_in_flight_after_fuzz(live):
    """Runs after the fuzzers (file order): health SERVING, a normal Generate works, and no
    request is left in the async engine or the (fake) engine."""
    fake, client, channel = live
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "pagedjax.v1.PagedJax"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    out = client.generate("hi", {"max_tokens": 3, "temperature": 0.0})
    assert out.outputs[0].text == "w0 w1 w2 " and out.outputs[0].finish_reason == "length"
    assert wait_idle(client).num_in_flight == 0
    assert not fake.has_unfinished_requests()
