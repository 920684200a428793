"""Optional API key for both front doors, as `vllm serve --api-key` does.

Clients send ``Authorization: Bearer <key>`` (an HTTP header, or gRPC metadata ``authorization``).
HTTP checks every ``/v1`` route; ``/health`` and ``/metrics`` stay open, as in vLLM, so probes
and scrapers need no secret. gRPC checks every method of the pagedjax service; the standard
health and reflection services stay open. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
import os

import grpc

ENV_API_KEY = "PAGEDJAX_API_KEY"
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
UNAUTHENTICATED_MESSAGE = "invalid or missing API key (send 'Authorization: Bearer <key>')"


def resolve_api_key(flag: str | None) -> str | None:
    """`--api-key`, else $PAGEDJAX_API_KEY, else None (no authentication)."""
    key = flag if flag is not None else os.environ.get(ENV_API_KEY)
    if key is not None and not key.strip():
        raise ValueError("api_key: must not be empty")
    return key


def bearer_ok(header: str | None, key: str) -> bool:
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), key.encode())


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED before any handler runs (or any request bytes are parsed)."""

    def __init__(self, key: str):
        self.key = key

        async def deny_unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
            yield  # pragma: no cover - unreachable, makes this an async generator

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny_unary)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny_stream)

    async def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_GRPC_PREFIXES):
            return await continuation(details)
        md = {k.lower(): v for k, v in (details.invocation_metadata or ())}
        if bearer_ok(md.get("authorization"), self.key):
            return await continuation(details)
        return self._deny_stream if details.method.endswith("/Generate") else self._deny_unary
