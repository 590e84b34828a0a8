"""TrainerProcess: what one trainer process does beside the algorithm, and the weight transport
those settings choose (``publisher_for``).

``TrainerConfig`` holds the algorithm's settings; these are the process's: how long it runs,
how its weights reach the engines, its torch threads. Each field is a setting
(schemas/settings.py), so ``agentarium trainer`` derives their flags and config keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agentarium.schemas import SettingError, check_settings, setting

from . import heap
from .app import PublisherFactory, store_publisher
from .config import BATCH, COMPUTE, OUTPUTS, TrainerConfig
from .errors import TrainerConfigError
from .heap import ALLOCATORS
from .memory import plan_for
from .weight_stream import WEIGHT_TRANSPORTS, StreamConfig, stream_publisher

STREAM_BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True, kw_only=True)
class TrainerProcess:
    """What this trainer process does beside the algorithm (TrainerConfig's fields)."""

    max_steps: int | None = setting(
        None,
        ge=0,
        group=BATCH,
        metavar="N",
        help="stop after step N (counted across resumes; 0: set up, write the resolved config "
        "and stop before training); default: run until SIGTERM",
    )
    # None: shared-path with weights_dir, else object-store (publisher_for)
    weight_transport: str | None = setting(
        None,
        choices=WEIGHT_TRANSPORTS,
        group=OUTPUTS,
        help="how new weights reach the engines: object-store (the default: `agentarium sync` "
        "beside the engines fetches each version), shared-path (files under --weights-dir, "
        "which the syncers read in place; the default when --weights-dir is given) or stream "
        "(this process broadcasts each version to the --stream-engine URLs over "
        "torch.distributed, no file, then stores it as object-store, or shared-path with "
        "--weights-dir, does: the syncers catch up any engine the stream missed)",
    )
    weights_dir: str | None = setting(
        None,
        group=OUTPUTS,
        metavar="DIR",
        help="shared-path mode: write each version under DIR/<run>/v<version>/ (a filesystem "
        "the engines' syncers also see) instead of the weights object store",
    )
    stream_engines: tuple[str, ...] = setting(
        (),
        flag="--stream-engine",
        group=OUTPUTS,
        metavar="URL",
        help="with --weight-transport stream: an engine's base URL (SGLang or the local "
        "engine); repeat it for every engine",
    )
    stream_address: str | None = setting(
        None,
        group=OUTPUTS,
        metavar="HOST",
        help="with --weight-transport stream: the address the engines reach this process at "
        "(the group's master_address); default 127.0.0.1 when every engine is local, else this "
        "machine's address on the route to the first engine",
    )
    stream_backend: str | None = setting(
        None,
        choices=STREAM_BACKENDS,
        group=OUTPUTS,
        help="with --weight-transport stream: the torch.distributed backend (default: nccl "
        "with --device cuda, else gloo; the local engine takes gloo only)",
    )
    stream_timeout_s: float = setting(
        60.0,
        gt=0,
        group=OUTPUTS,
        help="with --weight-transport stream: longest wait for the engines to join the group "
        "and for each broadcast; an engine that times out keeps its weights until the syncer "
        "brings it the stored version",
    )
    keep_versions: int = setting(
        3,
        ge=1,  # the version the engines are loading is never pruned
        group=OUTPUTS,
        metavar="K",
        help="published versions kept per run; older ones are pruned",
    )
    publish: bool = setting(
        True,
        negate=True,
        group=OUTPUTS,
        help="train without publishing weights (the fleet keeps serving what it has; staleness "
        "stays 0)",
    )
    torch_threads: int | None = setting(
        None,
        ge=1,
        group=COMPUTE,
        metavar="N",
        help="torch CPU threads in this process (default: torch's choice)",
    )

    allocator: str = setting(
        "auto",
        choices=ALLOCATORS,
        group=COMPUTE,
        help="the malloc this process runs on: jemalloc (Debian's libjemalloc2, preloaded: the "
        "process executes itself again once, at its start), whose freed tensors are reused "
        "and handed back where glibc's heap keeps them (SmolLM2's step under --memory small: "
        "trainer/heap.py); glibc; auto: jemalloc where --memory resolves to small and "
        "libjemalloc.so.2 is installed, else glibc",
    )

    def __post_init__(self) -> None:
        try:
            check_settings(self)
        except SettingError as exc:
            raise TrainerConfigError(str(exc)) from None


def publisher_for(config: TrainerConfig, process: TrainerProcess) -> PublisherFactory:
    """The publisher of the chosen weight transport: none with ``publish`` off, else
    object-store, shared-path or stream (with ``weight_transport`` None: shared-path when a
    ``weights_dir`` is given, else object-store). TrainerConfigError (a ValueError) for
    settings that contradict each other."""
    if not process.publish:
        return lambda js, topology, cfg: None
    weights_dir = Path(process.weights_dir) if process.weights_dir else None
    transport = process.weight_transport or ("shared-path" if weights_dir else "object-store")
    if transport == "shared-path" and weights_dir is None:
        raise TrainerConfigError(
            "--weight-transport shared-path writes under --weights-dir: pass it"
        )
    if transport == "object-store" and weights_dir is not None:
        raise TrainerConfigError(
            "--weights-dir is the shared-path mode's directory: drop it, or pass "
            "--weight-transport shared-path (or stream)"
        )
    if transport == "stream" and config.lora_rank > 0:
        raise TrainerConfigError(
            "LoRA publishes adapters (--lora-rank, or TRL's peft model), and "
            "--weight-transport stream broadcasts the model's own tensors: use object-store "
            "or shared-path with LoRA"
        )
    if transport != "stream":
        if process.stream_engines:
            raise TrainerConfigError("--stream-engine is for --weight-transport stream")
        return store_publisher(weights_dir, process.keep_versions)
    try:
        stream = StreamConfig(
            engines=tuple(process.stream_engines),
            master_address=process.stream_address,
            backend=process.stream_backend or ("nccl" if config.device == "cuda" else "gloo"),
            timeout_s=process.stream_timeout_s,
        )
    except ValueError as exc:
        raise TrainerConfigError(str(exc)) from None
    return stream_publisher(stream, weights_dir, process.keep_versions)


def allocator_for(config: TrainerConfig, process: TrainerProcess) -> str:
    """The allocator this trainer runs on (``heap.use_allocator`` takes it): the one named, or
    for ``auto`` jemalloc where ``--memory`` resolves to small and jemalloc is installed."""
    if process.allocator != "auto":
        return process.allocator
    plan = plan_for(config.memory, lora_rank=config.lora_rank, model_dir=config.model_dir)
    return "jemalloc" if plan == "small" and heap.find_jemalloc() else "glibc"
