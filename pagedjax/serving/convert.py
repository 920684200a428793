"""Conversions between protobuf messages and engine objects (used by server and client)."""

from __future__ import annotations

import dataclasses

from pagedjax.sampling_params import SamplingParams
from pagedjax.serving.async_engine import Delta
from pagedjax.serving.errors import InvalidRequestError
from pagedjax.serving.proto import pagedjax_pb2 as pb

_SCALARS = ("n", "best_of", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
            "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
            "prompt_logprobs", "skip_special_tokens", "use_beam_search", "length_penalty",
            "include_stop_str_in_output")
_EARLY = {"true": True, "false": False, "never": "never"}


def params_from_proto(msg: pb.SamplingParams) -> dict:
    """Only the fields the client set, so unset ones keep `SamplingParams` defaults."""
    d = {name: getattr(msg, name) for name in _SCALARS if msg.HasField(name)}
    if msg.stop:
        d["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        d["stop_token_ids"] = list(msg.stop_token_ids)
    if msg.HasField("early_stopping"):
        v = msg.early_stopping.lower()
        if v not in _EARLY:
            raise InvalidRequestError(f"early_stopping must be 'true', 'false' or 'never', got {v!r}",
                                      "early_stopping")
        d["early_stopping"] = _EARLY[v]
    if msg.logit_bias:
        d["logit_bias"] = dict(msg.logit_bias)
    if msg.allowed_token_ids:
        d["allowed_token_ids"] = list(msg.allowed_token_ids)
    if msg.bad_words:
        d["bad_words"] = list(msg.bad_words)
    if msg.HasField("guided_decoding"):
        d["guided_decoding"] = _guide_from_proto(msg.guided_decoding)
    return d


def _guide_from_proto(g: pb.GuidedDecoding) -> dict:
    kind = g.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("guided_decoding: set one of json, regex, choice, grammar, "
                                  "json_object", "guided_decoding")
    if kind == "choice":
        return {"choice": list(g.choice.values)}
    return {kind: getattr(g, kind)}


def _guide_to_proto(guide) -> pb.GuidedDecoding:
    from pagedjax.structured import GuidedDecodingParams

    g = GuidedDecodingParams.coerce(guide)
    kind = g.kind
    if kind == "choice":
        return pb.GuidedDecoding(choice=pb.Choices(values=list(g.choice)))
    if kind == "json":
        return pb.GuidedDecoding(json=g.source()[1])
    return pb.GuidedDecoding(**{kind: getattr(g, kind)})


def params_to_proto(params: SamplingParams | dict | None) -> pb.SamplingParams:
    """From a `SamplingParams` (all fields) or a dict (only the keys given)."""
    if params is None:
        return pb.SamplingParams()
    if isinstance(params, SamplingParams):
        params = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}
    d = dict(params)
    stop = d.pop("stop", None)
    stop_ids = d.pop("stop_token_ids", None)
    early = d.pop("early_stopping", None)
    guide = d.pop("guided_decoding", None)
    bias = d.pop("logit_bias", None)
    allowed = d.pop("allowed_token_ids", None)
    bad = d.pop("bad_words", None)
    msg = pb.SamplingParams(**{k: v for k, v in d.items() if v is not None})
    if bias:
        for t, v in bias.items():
            msg.logit_bias[int(t)] = v
    if allowed:
        msg.allowed_token_ids.extend(allowed)
    if bad:
        msg.bad_words.extend(bad)
    if guide is not None:
        msg.guided_decoding.CopyFrom(_guide_to_proto(guide))
    if stop:
        msg.stop.extend([stop] if isinstance(stop, str) else stop)
    if stop_ids:
        msg.stop_token_ids.extend(stop_ids)
    if early is not None:
        msg.early_stopping = early if isinstance(early, str) else str(bool(early)).lower()
    return msg


def delta_to_proto(d: Delta) -> pb.CompletionDelta:
    msg = pb.CompletionDelta(index=d.index, text=d.text, token_ids=d.token_ids,
                             finish_reason=d.finish_reason or "", completion_tokens=d.completion_tokens)
    if d.cumulative_logprob is not None:
        msg.cumulative_logprob = d.cumulative_logprob
    if isinstance(d.stop_reason, str):
        msg.stop_str = d.stop_reason
    elif isinstance(d.stop_reason, int):
        msg.stop_token_id = d.stop_reason
    for entry in d.logprobs or []:
        msg.logprobs.add(token_ids=list(entry), logprobs=list(entry.values()))
    return msg
