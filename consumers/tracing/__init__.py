"""Tracing: the ``llm`` object handed to agents (``llm.py``: ``TracingLLM``), multi-turn prompts
from token ids (``prompt_chain.py``), chat spans in the GenAI conventions (``genai.py``), and the
tracing proxy (``proxy.py``) in front of the gateway (``gateway/``: OpenAI Chat Completions and
Responses, Anthropic Messages), so unmodified agents are traced."""

from .llm import ChatResult, TracingLLM
from .prompt_chain import Prompt, PromptChain
from .proxy import TracingProxy

__all__ = ["ChatResult", "Prompt", "PromptChain", "TracingLLM", "TracingProxy"]
