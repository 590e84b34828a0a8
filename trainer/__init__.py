"""The asynchronous GRPO trainer (see trainer/README in a later issue).

What other packages may import from here is this face: trajectory -> token rows and the rules
rows share (trainer/rows.py). It is torch-free; the modules that train import torch.
"""

from .rows import (
    HOW,
    MULTI_TURN,
    TokenRow,
    call_refusal,
    grpo_advantages,
    pad_token_id,
    refusal,
    rows_of,
)

__all__ = [
    "HOW",
    "MULTI_TURN",
    "TokenRow",
    "call_refusal",
    "grpo_advantages",
    "pad_token_id",
    "refusal",
    "rows_of",
]
