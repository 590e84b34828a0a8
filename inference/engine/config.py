"""EngineSettings: how the local engine is served, declared once (flags of `agentarium engine`).

torch-free, so the CLI can build its flags without loading the engine."""

from __future__ import annotations

from dataclasses import dataclass

from agentarium.schemas import check_settings, setting


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """Where the engine listens and how much it computes at once."""

    host: str = setting("127.0.0.1", help="listen address")
    port: int = setting(30000, ge=0, le=65535, metavar="PORT", help="port; 0 picks a free one")
    threads: int = setting(1, ge=1, help="torch threads")
    max_batch: int = setting(64, ge=1, help="most sequences decoded together")
    prefix_cache_tokens: int = setting(
        32768,
        ge=0,
        metavar="TOKENS",
        help="tokens of finished sequences' KV kept for later prompts that start with them (a "
        "multi-turn rollout's previous turn, a group's shared prompt), least recently used out; "
        "requests prefilled together that begin alike compute their common prefix once and "
        "keep it there too; reused tokens are reported as cached_tokens; a token holds 2 x "
        "layers x KV heads x head dim floats (45 KiB for SmolLM2-135M); 0 turns both off",
    )

    def __post_init__(self) -> None:
        check_settings(self)
