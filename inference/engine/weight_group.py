"""The engine's side of SGLang's distributed weight update: process groups and receiving.

A trainer makes itself rank 0 of a torch.distributed group created for the purpose and asks
each engine to join it (``/init_weights_update_group``: ``master_address``, ``master_port``,
``rank_offset``, ``world_size``, ``group_name``, ``backend``). For each update it posts the
tensors' ``names``, ``dtypes`` and ``shapes`` (``/update_weights_from_distributed``) while it
broadcasts them from rank 0: one broadcast per tensor in the order of ``names``, or, with
``load_format: "flattened_bucket"``, one uint8 buffer holding every tensor's bytes back to back.
That is what SGLang's model runner receives, and the group is joined the way SGLang joins it
(a TCPStore client at master_address:master_port, a PrefixStore named after the group, torch's
process-group helper), so one trainer drives SGLang and this engine alike.

Receiving never touches the live weights: tensors arrive in spare buffers (the previous
version's tensors, kept after each swap, so a large update does not first page-fault fresh
memory) or in new ones where a shape or dtype differs, and are swapped in only once every
broadcast has arrived. A broadcast that fails or times out leaves the served weights as they
were. The local engine runs on the CPU: its groups use gloo.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import structlog
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .errors import InvalidRequest, WeightLoadError

log = structlog.get_logger("agentarium.engine")

GROUP_TIMEOUT_S = 300.0  # joining, and each broadcast: the trainer's own timeout is shorter
FLATTENED_BUCKET = "flattened_bucket"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class WeightGroup:
    """One joined group: the process group and this engine's rank in it."""

    name: str
    group: Any  # torch.distributed.ProcessGroup
    rank: int
    world_size: int
    backend: str
    updates: int = 0


def join_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = GROUP_TIMEOUT_S,
) -> WeightGroup:
    """Join the trainer's group (blocks until every rank has joined, or raises)."""
    timeout = timedelta(seconds=timeout_s)
    rendezvous = c10d.rendezvous(
        f"tcp://{_host(master_address)}:{int(master_port)}", rank, world_size, timeout=timeout
    )
    store, _, _ = next(rendezvous)
    store.set_timeout(timeout)
    pg, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        c10d.PrefixStore(group_name, store),
        group_name=cast(Any, group_name),  # torch >= 2.9 types it as GroupName
        timeout=timeout,
    )
    # broadcast(src=0, group=pg) maps group rank 0 to a global rank through this table
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return WeightGroup(group_name, pg, rank, world_size, backend)


def leave_group(group: WeightGroup) -> None:
    dist.destroy_process_group(group.group)


def parse_specs(body: dict[str, Any]) -> list[TensorSpec]:
    """The ``names``/``dtypes``/``shapes`` of an update request; InvalidRequest if malformed."""
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not isinstance(names, list) or not isinstance(dtypes, list) or not isinstance(shapes, list):
        raise InvalidRequest(
            "update_weights_from_distributed needs names, dtypes and shapes (lists)"
        )
    if not len(names) == len(dtypes) == len(shapes):
        raise InvalidRequest(
            f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, "
            f"{len(shapes)}): one entry per tensor, in broadcast order"
        )
    if len(set(names)) != len(names):
        raise InvalidRequest("names repeat a tensor: each is broadcast once")
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"tensor name {name!r} is not a non-empty string")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise InvalidRequest(f"{name}: shape {shape!r} is not a list of sizes")
        specs.append(TensorSpec(name, parse_dtype(dtype, name), tuple(shape)))
    return specs


def parse_dtype(value: Any, name: str = "") -> torch.dtype:
    """``"float32"`` (SGLang's spelling) or ``"torch.float32"``."""
    text = value.removeprefix("torch.") if isinstance(value, str) else ""
    dtype = getattr(torch, text, None) if text else None
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequest(f"{name}: dtype {value!r} is not a torch dtype (e.g. float32)")
    return dtype


def receive(
    group: WeightGroup,
    specs: list[TensorSpec],
    spares: dict[str, torch.Tensor],
    *,
    load_format: str | None = None,
) -> dict[str, torch.Tensor]:
    """Receive one update's tensors from rank 0 (blocking; run it in a worker thread).

    ``spares`` lends buffers of the right shape and dtype (never live weights); the others
    are allocated. Raises WeightLoadError when a broadcast fails: the received tensors are then
    incomplete and must not be used.
    """
    try:
        if load_format == FLATTENED_BUCKET:
            return _receive_bucket(group, specs)
        buffers = {spec.name: _buffer(spec, spares) for spec in specs}
        works = [
            dist.broadcast(buffers[spec.name], src=0, group=group.group, async_op=True)
            for spec in specs
        ]
        for work in works:
            work.wait()
        return buffers
    except (RuntimeError, ValueError) as exc:  # torch raises DistBackendError, a RuntimeError
        raise WeightLoadError(
            f"the broadcast on group {group.name!r} failed after {group.updates} updates: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}; the served "
            "weights are unchanged"
        ) from exc


def _receive_bucket(group: WeightGroup, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    flat = torch.empty(sum(spec.nbytes for spec in specs), dtype=torch.uint8)
    dist.broadcast(flat, src=0, group=group.group)
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for spec in specs:
        chunk = flat[offset : offset + spec.nbytes]
        offset += spec.nbytes
        try:
            out[spec.name] = chunk.view(spec.dtype).view(spec.shape)
        except RuntimeError:  # an offset not aligned to this dtype's size: copy it out
            out[spec.name] = chunk.clone().view(spec.dtype).view(spec.shape)
    return out


def _buffer(spec: TensorSpec, spares: dict[str, torch.Tensor]) -> torch.Tensor:
    spare = spares.get(spec.name)
    if spare is not None and spare.dtype == spec.dtype and tuple(spare.shape) == spec.shape:
        return spare
    return torch.empty(spec.shape, dtype=spec.dtype)


def prefault(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Buffers like ``tensors``, written once so their pages exist before the first update."""
    return {name: torch.zeros_like(t) for name, t in tensors.items()}


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address
