"""pagedjax: vLLM's PagedAttention serving engine, rebuilt for JAX."""

from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy so that `import pagedjax.core` (pure Python) never pulls in JAX.
    if name == "LLM":
        from pagedjax.llm import LLM

        return LLM
    raise AttributeError(name)
