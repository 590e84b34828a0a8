"""The asynchronous GRPO trainer (see trainer/README in a later issue)."""
