"""Inference backends behind one interface: ``await backend.generate(GenerateRequest)``."""

from .balancer import StickyBalancer
from .base import Backend, BackendRetry, FinishReason, GenerateRequest, GenerateResult
from .cross_sampling import CrossSamplingBackend, model_of_call
from .openai_compat import OpenAICompatBackend
from .sglang import SGLangBackend, parse_generate_response
from .vllm import VLLMBackend, parse_vllm_response

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
    "VLLMBackend",
    "model_of_call",
    "parse_generate_response",
    "parse_vllm_response",
]
