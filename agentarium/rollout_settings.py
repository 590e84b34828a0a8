"""RolloutSettings: what an in-process consumer runs besides the agent and its LLM servers.

``agentarium consumer`` and ``agentarium eval run`` both start one (eval in its own process),
so both hold this section: the generic agent's environment and turn limit, the model whose
tokenizer renders prompts, the reward function, and cross-sampling. One declaration, one
default each; the consumer's own settings are ``consumers.ConsumerSettings``.
"""

from __future__ import annotations

from dataclasses import dataclass

from consumers import CrossTarget, LLMTarget, normalize_urls
from schemas import check_settings, setting


@dataclass(frozen=True, kw_only=True)
class RolloutSettings:
    env: str | None = setting(
        None,
        metavar="ENV",
        help="run the generic function-call agent on environment ENV (`agentarium env serve "
        "ENV`), no code needed: each job's task opens a session, the model calls the "
        "environment's tools until it is done or --max-turns, and the reward is the session's "
        "score. Give --agent a bare NAME with it, e.g. --agent db --env sql",
    )
    max_turns: int = setting(
        10,
        ge=1,
        metavar="N",
        help="with --env: model calls per rollout before the episode is cut (truncated, scored "
        "as the environment scores it at close)",
    )
    model: str = setting(
        "tiny",
        metavar="PATH|tiny",
        help="model directory whose tokenizer and chat template render prompts (default: the "
        "built-in tiny model); with `eval run --openai-base`: the API's model name",
    )
    model_name: str | None = setting(
        None, help="model name handed to endpoint-style agents and spans (default: from --model)"
    )
    reward: str | None = setting(
        None,
        metavar="module:fn",
        help="reward function fn(task, result, trajectory) -> float | dict",
    )
    # Cross-sampling: a call goes to this second model with probability cross_ratio;
    # recorded with policy false, never trained on.
    cross_model: tuple[str, ...] = setting(
        (),
        metavar="URL",
        help="cross-sampling: a second model's server, of the first one's kind (SGLang or "
        "`agentarium engine`, repeat for a fleet, sharing the policy's tokenizer: checked at "
        "start; or one OpenAI-compatible base with `eval run --openai-base`); each LLM call "
        "goes there with probability --cross-ratio, and is recorded as not the policy's: the "
        "trainer keeps its tokens as context and trains only on the policy's",
    )
    cross_model_name: str = setting(
        "cross",
        metavar="NAME",
        help="the second model's name in the recorded calls (and its API model name with "
        "`eval run --openai-base`)",
    )
    cross_ratio: float = setting(
        0.5,
        ge=0,
        le=1,
        metavar="P",
        help="probability that a call goes to --cross-model, decided per call",
    )

    def __post_init__(self) -> None:
        check_settings(self)

    def cross(
        self, *, openai: bool = False, api_key: str | None = None, seed: int | None = None
    ) -> CrossTarget | None:
        """The cross-sampling target (None without --cross-model): SGLang-compatible
        servers, or with ``openai`` the one OpenAI-compatible base named ``cross_model_name``."""
        urls = normalize_urls(list(self.cross_model))
        if not urls:
            return None
        if openai:
            if len(self.cross_model) != 1:
                raise ValueError(
                    "with an OpenAI-compatible model, --cross-model is one base URL, "
                    f"got {len(self.cross_model)}"
                )
            target = LLMTarget(
                openai_base=self.cross_model[0].rstrip("/"),
                openai_model=self.cross_model_name,
                api_key=api_key,
            )
        else:
            target = LLMTarget(urls=tuple(urls))
        return CrossTarget(
            target=target, ratio=self.cross_ratio, name=self.cross_model_name, seed=seed
        )
