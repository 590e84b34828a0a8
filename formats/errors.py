"""Errors of the model formats.

ToolsNotRendered    (a ValueError) a call offered tools to a model whose chat template renders
                    none (the prompt is the same without them): an agent error (the proxy
                    answers 400), never a silent drop
"""

from __future__ import annotations


class ToolsNotRendered(ValueError):
    """Tools were offered to a chat template that does not render them."""
