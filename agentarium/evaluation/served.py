"""What the eval's LLM servers serve, read once at start: part of the eval's identity.

An eval run id made of the agent, tasks, k and model *name* alone would be the same before and
after training (the engine serves new weights under the same name and URL), so evaluating the
base model after the trained one would find the trained model's results and do nothing. The
run id therefore includes what each ``--llm`` server serves:

- the local engine: ``sha256:<hex>``, its ``GET /weights_checksum`` (a sha256 over the served
  tensors, taken between steps; about a second for 135M fp32 parameters);
- an SGLang server (no such route): ``<model_path>@<weight_version>`` from ``/model_info``,
  the version being whatever string the server reports.

A server that answers neither is an error: an eval cannot say what it measured.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from agentarium.inference import EngineControl, EngineControlError

CHECKSUM_PATH = "/weights_checksum"  # the local engine's, not SGLang's


class ServedUnknown(ValueError):
    """A server did not say what it serves; the message names it."""


async def served_weights(urls: Sequence[str], *, timeout_s: float = 120.0) -> list[str]:
    """One string per URL (in order) naming the weights it serves."""
    async with EngineControl(timeout_s=timeout_s) as control:
        return list(await asyncio.gather(*(_served(control, url) for url in urls)))


async def _served(control: EngineControl, url: str) -> str:
    try:
        checksum = (await control.get(url, CHECKSUM_PATH)).get("checksum")
    except EngineControlError as exc:
        if exc.status != 404:  # 404: not the local engine
            raise ServedUnknown(f"cannot read what {url} serves ({exc}): start it first") from exc
        checksum = None
    if isinstance(checksum, str) and checksum:
        return f"sha256:{checksum}"
    try:
        info = await control.model_info(url)
    except EngineControlError as exc:
        raise ServedUnknown(f"cannot read what {url} serves ({exc}): start it first") from exc
    return f"{info.get('model_path') or '?'}@{info.get('weight_version')}"
