"""Inference backends behind one interface: ``await backend.generate(GenerateRequest)``."""

from .balancer import StickyBalancer
from .base import Backend, BackendRetry, FinishReason, GenerateRequest, GenerateResult
from .openai_compat import OpenAICompatBackend
from .sglang import SGLangBackend, parse_generate_response

__all__ = [
    "Backend",
    "BackendRetry",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "OpenAICompatBackend",
    "SGLangBackend",
    "StickyBalancer",
    "parse_generate_response",
]
