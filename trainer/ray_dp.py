"""Data-parallel GRPO updates on Ray: N actors, torch.distributed inside, one optimizer step.

Each actor holds a full replica (model, frozen reference when kl_coef > 0, AdamW), loaded from
the same model directory, so the replicas start equal. A step splits the batch's rows into N
contiguous shards; every actor accumulates its shard's gradient with the loss normalised by
the *whole* batch's counts (``step.Totals``), the gradients are summed with one all-reduce
over a flat buffer, and each actor clips and steps identically. The replicas therefore stay
equal, and N workers compute the same update as one worker on the whole batch (up to the
order of floating-point sums).

Backends: gloo on CPU, nccl on CUDA (one GPU per actor). Rank 0's weights are the ones
published and checkpointed: the driver copies its state dict into a CPU mirror model for the
publisher. ``ray.init()`` is the caller's (connect to a cluster with RAY_ADDRESS); when Ray is
not initialised, a local instance is started, its workers at nice 0 (``LOCAL_RAY``): Ray's
default of 15 gives the ranks a few per cent of a core beside any other busy process (an
engine, a consumer), and the ranks are the trainer. A cluster's own raylets decide their
workers' niceness (``RAY_worker_niceness=0 ray start ...``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from agentarium.broker import free_port

from .batch import Batch
from .checkpoint import Loaded, write_full
from .config import TrainerConfig
from .errors import DistributedError
from .grpo import LossSums
from .step import (
    StepSettings,
    StepStats,
    Totals,
    apply_update,
    check_moments,
    forward_backward,
    load_policy,
    load_reference,
    make_optimizer,
    memory_of,
    publishable,
)

# ray.init's _system_config when it starts a local Ray: its workers at nice 0, not Ray's 15
LOCAL_RAY = {"worker_niceness": 0}


class _Worker:
    """One data-parallel rank (wrapped with ray.remote at start-up)."""

    def __init__(self, rank: int, world: int, model_dir: str, settings: StepSettings, device: str):
        torch.set_num_threads(1 if device == "cpu" else torch.get_num_threads())
        self.rank, self.world = rank, world
        self.settings = settings
        self.device = torch.device(device)
        self.model = load_policy(model_dir, self.device, settings)
        self.ref_model = (
            load_reference(model_dir, self.device, settings) if settings.kl_coef > 0 else None
        )
        self.optimizer = make_optimizer(self.model, settings)

    def address(self) -> tuple[str, int]:
        import ray

        # a port below the ephemeral range, reserved: a kernel-picked one could be taken by
        # any outgoing connection before the rendezvous binds it
        return ray.util.get_node_ip_address(), free_port("")

    def setup(self, host: str, port: int) -> bool:
        import torch.distributed as dist

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.world
        )
        return True

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds of parameters and optimizer state (``step.memory_of``)."""
        return memory_of(self.model, self.optimizer)

    def step(self, shard: Batch, totals: Totals, seed: int) -> tuple[float, LossSums, float]:
        import torch.distributed as dist

        torch.manual_seed(seed)
        self.optimizer.zero_grad(set_to_none=True)
        loss, sums = forward_backward(
            self.model, self.ref_model, shard, self.settings, totals, self.device
        )
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])  # one all-reduce for all gradients
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n
        grad_norm = apply_update(
            self.model,
            self.optimizer,
            self.settings.grad_clip,
            release_heap=self.settings.heap == "release",
        )
        return loss, sums, grad_norm

    def state(self) -> tuple[dict, dict]:
        model_state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        return model_state, _to_cpu(self.optimizer.state_dict())

    def load_state(self, model_state: dict, optimizer_state: dict) -> bool:
        self.model.load_state_dict(model_state)
        self.optimizer.load_state_dict(optimizer_state)
        return True

    def shutdown(self) -> bool:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        return True


class RayDataParallel:
    """The LocalUpdater interface (step, state, load_state, publishable_model, close) over
    ``world`` Ray actors."""

    worker = _Worker  # one rank; trainer/fsdp.py's sharded ranks replace it

    def __init__(self, config: TrainerConfig, world: int) -> None:
        try:
            import ray
        except ImportError as exc:
            raise DistributedError("--ray-workers needs Ray: pip install 'ray>=2.40'") from exc
        assert world >= 1, "world must be >= 1"
        self.config = config
        self.world = world
        self.settings = StepSettings.from_config(config)
        if not ray.is_initialized():
            own = None if os.environ.get("RAY_ADDRESS") else LOCAL_RAY  # joins a cluster: its own
            ray.init(include_dashboard=False, log_to_driver=False, _system_config=own)
        gpu = config.device == "cuda"
        actor = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(self.worker)
        try:
            self.actors = [
                actor.remote(rank, world, str(config.model_dir), self.settings, config.device)
                for rank in range(world)
            ]
            # Ray's stubs give actor handles the plain methods of _Worker: ``.remote`` is typed
            # only on methods decorated with @ray.method, and this module must import without
            # Ray. Each ``.remote`` call below is therefore an attr-defined stub gap.
            host, port = ray.get(self.actors[0].address.remote())  # type: ignore[attr-defined]
            setups = [a.setup.remote(host, port) for a in self.actors]  # type: ignore[attr-defined]
            ray.get(setups, timeout=300)
        except Exception as exc:
            self.close()
            raise DistributedError(
                f"could not start {world} data-parallel workers on Ray ({exc}): check that the "
                f"cluster has {world} free {'GPUs' if gpu else 'CPUs'}"
            ) from exc
        self._mirror = None  # rank 0's weights, in this process, for the publisher

    def __repr__(self) -> str:
        return f"<RayDataParallel world={self.world} device={self.config.device}>"

    def step(self, batch: Batch, seed: int) -> StepStats:
        totals = Totals.of(batch)
        shards = batch.shards(self.world)
        extra = self._step_args(shards)
        pairs = zip(self.actors, shards, strict=True)
        calls = [a.step.remote(s, totals, seed, *extra) for a, s in pairs]  # type: ignore[attr-defined]
        results = self._get(calls, "during a step")
        loss, sums = 0.0, LossSums()
        for part_loss, part_sums, _ in results:
            loss += part_loss
            sums += part_sums
        return StepStats.from_sums(loss, sums, results[0][2], batch)

    def _step_args(self, shards: list[Batch]) -> tuple:
        """What each rank's step takes beyond its shard, the totals and the seed."""
        return ()

    def _get(self, calls: list, doing: str) -> list:
        """Every rank's answer; a failed rank is a DistributedError."""
        import ray

        try:
            return ray.get(calls)
        except ray.exceptions.RayError as exc:
            raise DistributedError(f"a data-parallel worker failed {doing}: {exc}") from exc

    def memory(self) -> list[dict[str, int]]:
        """Each rank's parameter and optimizer bytes (``_Worker.memory``)."""
        return self._get([a.memory.remote() for a in self.actors], "reporting memory")  # type: ignore[attr-defined]

    def state(self) -> tuple[dict, dict]:
        import ray

        ref: ray.ObjectRef[tuple[dict, dict]] = self.actors[0].state.remote()  # type: ignore[attr-defined]
        return ray.get(ref)

    def load_state(self, model_state: dict, optimizer_state: dict) -> None:
        import ray

        check_moments(optimizer_state, self.settings)  # here, not as an actor's error
        refs = [a.load_state.remote(model_state, optimizer_state) for a in self.actors]  # type: ignore[attr-defined]
        ray.get(refs)

    def write_checkpoint(self, directory: Path) -> None:
        write_full(directory, *self.state())

    def read_checkpoint(self, loaded: Loaded) -> None:
        self.load_state(*loaded.full_states())

    def publishable_model(self):
        model_state, _ = self.state()
        self.mirror().load_state_dict(model_state)
        return publishable(self.mirror(), self.settings)

    def mirror(self):
        """The driver's CPU copy of the policy, for the publishers (built on first use)."""
        if self._mirror is None:
            self._mirror = load_policy(self.config.model_dir, "cpu", self.settings)
            self._mirror.requires_grad_(False)
        return self._mirror

    def close(self) -> None:
        import ray

        for actor in getattr(self, "actors", []):
            try:
                ray.get(actor.shutdown.remote(), timeout=30)
            except Exception:  # a dead actor has nothing left to shut down
                pass
            ray.kill(actor)
        self.actors = []


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value
