"""Inference backends behind one interface: ``await backend.generate(GenerateRequest)``."""

from .balancer import StickyBalancer
from .base import Backend, FinishReason, GenerateRequest, GenerateResult, RetryPolicy
from .openai_compat import OpenAICompatBackend
from .sglang import SGLangBackend, parse_generate_response

__all__ = [
    "Backend",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "OpenAICompatBackend",
    "RetryPolicy",
    "SGLangBackend",
    "StickyBalancer",
    "parse_generate_response",
]
