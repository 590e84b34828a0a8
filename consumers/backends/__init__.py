"""Inference backends behind one interface: ``await backend.generate(GenerateRequest)``."""

from .balancer import StickyBalancer
from .base import Backend, BackendRetry, FinishReason, GenerateRequest, GenerateResult
from .cross_sampling import CrossSamplingBackend, model_of_call
from .openai_compat import OpenAICompatBackend
from .sglang import SGLangBackend, parse_generate_response

__all__ = [
    "Backend",
    "BackendRetry",
    "CrossSamplingBackend",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "OpenAICompatBackend",
    "SGLangBackend",
    "StickyBalancer",
    "model_of_call",
    "parse_generate_response",
]
