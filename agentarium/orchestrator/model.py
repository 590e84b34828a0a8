"""The orchestrator's model: the tokenizer and chat template its trainable agents render
prompts with, and the name endpoint-style agents are handed."""

from __future__ import annotations

from dataclasses import dataclass

from agentarium.formats import ChatTemplate
from agentarium.trainer import pad_token_id

from ..models import model_name, resolve_model


@dataclass(frozen=True)
class PolicyModel:
    dir: str | None  # None: no model given, prompts are not rendered here
    name: str
    template: ChatTemplate | None

    @classmethod
    def load(
        cls, model: str | None, name: str | None = None, *, tool_fallback: bool = False
    ) -> PolicyModel:
        """``model``: 'tiny', 'smol' or a model directory; ``name`` defaults to the built-in
        model's word or the directory's name; ``tool_fallback``: the consumers' setting of that
        name (tools written into the text for a template that renders none)."""
        path = str(resolve_model(model)) if model else None
        default = model_name(model, path) if model and path else "model"
        template = ChatTemplate.from_model_dir(path, tool_fallback=tool_fallback) if path else None
        return cls(dir=path, name=name or default, template=template)

    @property
    def pad_token_id(self) -> int:
        template = self.template
        if template is None:
            return 0
        pad = template.special_tokens.get("pad_token")
        return pad_token_id(
            template.tokenizer.token_to_id(pad) if pad else None, template.eos_token_ids
        )
