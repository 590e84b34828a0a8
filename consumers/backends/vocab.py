"""Which vocabulary a server reads, and the consumer's check that its engines read its own.

The tracing client renders prompts with the consumer's ``--model`` tokenizer and sends token
ids; an engine serving another model reads them in its own vocabulary and answers text that
is silently wrong for training (the trajectories are ``ok``). So a consumer asks each of its
servers' ``/model_info`` once, at start, and compares tokenizer fingerprints
(``chat_template.tokenizer_fingerprint``: sha256 over every token -> id pair):

- the local engine reports ``tokenizer_fingerprint`` (not an SGLang field);
- for an SGLang server, the fingerprint of its ``tokenizer_path`` when that is a model
  directory on this machine;
- a server that reports neither is not checked (logged: it names its tokenizer_path only), and
  a server that does not answer at start is not checked either (logged: the fleet holds
  rollouts until a server answers, and the check would hold the start for as long).

Equal fingerprints pass; a difference is refused with ``TokenizerMismatch``, naming both models.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import structlog

from agentarium.formats import ChatTemplate, load_tokenizer, tokenizer_fingerprint
from agentarium.inference import EngineControl, EngineControlError

from ..errors import TokenizerMismatch
from ..redact import log_safe

log = structlog.get_logger("agentarium.consumers")

FINGERPRINT = "tokenizer_fingerprint"  # the local engine's /model_info field (not SGLang's)


def server_fingerprint(info: dict, local_dir: str = "") -> tuple[str, str]:
    """A server's tokenizer fingerprint from its ``/model_info`` and where it came from ("" when
    unknown): the one it reports, else that of its ``tokenizer_path`` (or ``local_dir``) when
    that is a model directory here."""
    reported = info.get(FINGERPRINT)
    if isinstance(reported, str) and reported:
        return reported, "reported by its server"
    for path, source in (
        (info.get("tokenizer_path"), "of its tokenizer_path"),
        (local_dir, "of --model"),
    ):
        if path and (Path(str(path)) / "tokenizer.json").is_file():
            return tokenizer_fingerprint(load_tokenizer(str(path))), source
    return "", ""


async def check_engine_tokenizer(
    urls: Sequence[str],
    template: ChatTemplate,
    *,
    model_name: str,
    model_dir: str,
    timeout_s: float = 5.0,
) -> dict[str, str]:
    """Refuse (``TokenizerMismatch``) servers whose tokenizer is not ``template``'s.

    Returns each URL's outcome: ``same``, ``unknown`` (no fingerprint to compare) or
    ``unreachable``. Raises naming every mismatched server, before any rollout runs.
    """
    async with EngineControl(timeout_s=timeout_s) as control:
        infos = await asyncio.gather(
            *(control.model_info(url) for url in urls), return_exceptions=True
        )
    ours = template.fingerprint
    outcomes: dict[str, str] = {}
    wrong: list[str] = []
    for url, info in zip(urls, infos, strict=True):
        if isinstance(info, EngineControlError):
            outcomes[url] = "unreachable"
            log.warning(
                "tokenizer not checked: the LLM server did not answer /model_info at start",
                server=log_safe(url),
                error=str(info),
            )
            continue
        if isinstance(info, BaseException):
            raise info
        theirs, source = server_fingerprint(info)
        if not theirs:
            outcomes[url] = "unknown"
            log.info(
                "tokenizer not checked: the LLM server reports no tokenizer_fingerprint and its "
                "tokenizer_path is not a model directory here",
                server=log_safe(url),
                tokenizer_path=info.get("tokenizer_path"),
            )
            continue
        if theirs == ours:
            outcomes[url] = "same"
            continue
        served = info.get("model_path") or info.get("tokenizer_path") or "?"
        wrong.append(f"{url} serves {served!r} (fingerprint {theirs[:12]} {source})")
    if wrong:
        raise TokenizerMismatch(
            f"this consumer renders prompts with the model {model_name!r} ({model_dir}, "
            f"tokenizer fingerprint {ours[:12]}), but {'; '.join(wrong)}: the engine would read "
            "these token ids in another vocabulary and its replies would be silently wrong for "
            "training. Pass the model the engine serves as --model (its directory, or the "
            "built-in name it was started with: tiny, smol)"
        )
    return outcomes
