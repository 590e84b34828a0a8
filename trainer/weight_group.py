"""Rank 0 of a weight-update group: the torch.distributed half of streaming weights.

The trainer makes a TCPStore (port 0: the OS picks a free one), and every engine joins the
group through it while the trainer joins too (inference/engine/weight_group.py is the engine's
half; SGLang's ``init_custom_process_group`` is the same recipe: a PrefixStore named after the
group, torch's process-group helper). It then broadcasts each update from rank 0: one tensor
per broadcast, in order, with at most ``window`` broadcasts in flight, so that a peer that
stops receiving fails the update after one timeout instead of one per queued tensor; or, as a
"flattened_bucket", every tensor's bytes in one uint8 buffer.

Blocking calls all: the streamer (weight_stream.py) runs them in worker threads. torch.distributed
is imported here, never by ``import agentarium.trainer``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

WINDOW = 4  # broadcasts in flight: enough to keep a socket busy, few to time out together


def master_store(world_size: int, timeout_s: float) -> Any:
    """The group's TCPStore, served by this process on a free port (``store.port``)."""
    return dist.TCPStore(
        "0.0.0.0",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )


def create_group(
    store: Any, *, world_size: int, group_name: str, backend: str, timeout_s: float
) -> Any:
    """Join as rank 0 (blocks until every rank has joined, or raises after ``timeout_s``)."""
    pg, _ = c10d._new_process_group_helper(
        world_size,
        0,
        [],
        c10d.Backend(backend),
        c10d.PrefixStore(group_name, store),
        group_name=cast(Any, group_name),  # torch >= 2.9 types it as GroupName
        timeout=timedelta(seconds=timeout_s),
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_group(pg: Any) -> None:
    """Leave the group; its sockets close, so peers still receiving fail at once."""
    dist.destroy_process_group(pg)


def broadcast(pg: Any, tensors: list[torch.Tensor], *, window: int = WINDOW) -> None:
    """Broadcast each tensor from rank 0, in order; raises when one fails or times out."""
    pending: deque = deque()
    try:
        for tensor in tensors:
            pending.append(dist.broadcast(tensor, src=0, group=pg, async_op=True))
            if len(pending) >= window:
                pending.popleft().wait()
        while pending:
            pending.popleft().wait()
    finally:
        pending.clear()  # no reference may keep a failed group's work alive


def broadcast_bucket(pg: Any, tensors: list[torch.Tensor]) -> None:
    """Broadcast every tensor's bytes as one uint8 buffer (SGLang's "flattened_bucket")."""
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
    dist.broadcast(flat, src=0, group=pg)


def streamable(
    model_or_state: Any, *, device: str | None = "cpu"
) -> list[tuple[str, torch.Tensor]]:
    """The tensors an update carries, by state-dict name, as a checkpoint file holds them: a
    tensor sharing another's storage (a tied output head) is left out. ``device`` "cpu" copies
    them off a GPU for gloo; None leaves them where they are (NCCL)."""
    state: Mapping[str, torch.Tensor] = (
        model_or_state if isinstance(model_or_state, Mapping) else model_or_state.state_dict()
    )
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in state.items():
        t = tensor.detach()
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape))
        if t.numel() and key in seen:
            continue
        seen.add(key)
        if device is not None:
            t = t.to(device)
        out.append((name, t.contiguous()))
    return out


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's spelling: "float32", "bfloat16"."""
    return str(dtype).removeprefix("torch.")
