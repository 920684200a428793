"""Serving: the async engine, the gRPC server and its clients (networking stays out of the engine)."""

from pagedjax.serving.async_engine import AsyncEngine, DeltaTracker, RequestMetrics, RequestStream
from pagedjax.serving.client import AsyncClient, Client, GenerateResult

__all__ = ["AsyncClient", "AsyncEngine", "Client", "DeltaTracker", "GenerateResult", "RequestMetrics",
           "RequestStream"]
