"""Where a trainer step's peak RSS is: the process's resident memory sampled every
millisecond, each sample tagged with the phase of the step it fell in.

``Timeline(model)`` marks, with forward pre-hooks on the model and on each decoder layer
(``model.model.layers``), which step and pass is running and which layer's forward or backward
it is in (hooks on each layer's output gradient). A thread reads
``/proc/self/statm`` every ``interval`` seconds and keeps, per (step, pass), the highest RSS
and the phase it was reached in, plus, on jemalloc, the bytes its tensors and everything else
hold then (``stats.allocated``) and the pages it keeps for them, freed ones not yet purged
included (``stats.resident``), both sampled every tenth reading (a ``mallctl`` epoch costs
more). A layer's backward phase starts when the gradient of its output arrives: under
activation checkpointing its recomputation, then its backward.

bench/trainer_packing.py ``--timeline`` prints the table after its steps. The sampler sees
what it sees: a peak shorter than ``interval`` can fall between two readings, so the table's
peaks are at most ``ru_maxrss`` (the process's true peak, printed with them).
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 2**20


def _rss() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * PAGE


def _jemalloc_allocated():  # type: ignore[no-untyped-def]
    """A function returning jemalloc's ``stats.allocated`` (bytes), or None off jemalloc."""
    try:
        mallctl = ctypes.CDLL(None).mallctl
    except AttributeError:
        return None
    epoch = ctypes.c_uint64(1)
    value = ctypes.c_size_t(0)
    size = ctypes.c_size_t(ctypes.sizeof(value))

    def allocated() -> tuple[int, int]:
        """(allocated, resident): what the program holds, and the pages jemalloc holds for
        it, freed ones it has not purged yet included."""
        mallctl(b"epoch", None, None, ctypes.byref(epoch), ctypes.sizeof(epoch))
        read = []
        for name in (b"stats.allocated", b"stats.resident"):
            mallctl(name, ctypes.byref(value), ctypes.byref(size), None, 0)
            read.append(value.value)
        return read[0], read[1]

    return allocated


class Timeline:
    """Per (step, pass): the highest RSS sampled, the phase it fell in, jemalloc's allocated
    bytes near it. ``step()`` starts the next step's count; ``close()`` stops the sampler."""

    def __init__(self, model, optimizer=None, interval: float = 0.001) -> None:  # type: ignore[no-untyped-def]
        self.interval = interval
        self.step_index = -1
        self.pass_index = -1
        self.pass_tokens = 0
        self.phase = "setup"
        self.peaks: dict[tuple[int, int], dict] = {}
        self._allocated = _jemalloc_allocated()
        self._hooks = []
        self._stop = threading.Event()
        inner = getattr(model, "model", model)
        layers = getattr(inner, "layers", [])

        def on_model(_module, args, kwargs):  # type: ignore[no-untyped-def]
            if torch._C._current_autograd_node() is not None:
                return  # a recomputation inside the backward pass, not a new pass
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.pass_index += 1
            self.pass_tokens = int(ids.numel()) if ids is not None else 0
            self.phase = "embed"

        self._hooks.append(model.register_forward_pre_hook(on_model, with_kwargs=True))
        for index, layer in enumerate(layers):

            def on_layer(_module, _args, index=index):  # type: ignore[no-untyped-def]
                if torch._C._current_autograd_node() is None:
                    self.phase = f"forward L{index}"

            def after_layer(_module, _args, output, index=index):  # type: ignore[no-untyped-def]
                # the gradient of a layer's output arrives when its backward (and, under
                # checkpointing, its recomputation) is next: that phase starts then
                hidden = output[0] if isinstance(output, tuple) else output
                if isinstance(hidden, torch.Tensor) and hidden.requires_grad:

                    def on_grad(grad, index=index):  # type: ignore[no-untyped-def]
                        self.phase = f"backward L{index}"

                    hidden.register_hook(on_grad)

            self._hooks.append(layer.register_forward_pre_hook(on_layer))
            self._hooks.append(layer.register_forward_hook(after_layer))
        if layers:

            def after_layers(_module, _args, _output):  # type: ignore[no-untyped-def]
                if torch._C._current_autograd_node() is None:
                    self.phase = "head and loss"

            self._hooks.append(layers[-1].register_forward_hook(after_layers))
        if optimizer is not None:

            def on_update(_optimizer, _args, _kwargs):  # type: ignore[no-untyped-def]
                self.phase = "update"

            self._hooks.append(optimizer.register_step_pre_hook(on_update))
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def step(self) -> None:
        self.step_index += 1
        self.pass_index = -1
        self.phase = "step start"

    def _sample(self) -> None:
        count = 0
        allocated = resident = 0
        while not self._stop.wait(self.interval):
            rss = _rss()
            count += 1
            if self._allocated is not None and count % 10 == 0:
                allocated, resident = self._allocated()
            key = (self.step_index, self.pass_index)
            best = self.peaks.get(key)
            if best is None or rss > best["rss"]:
                self.peaks[key] = {
                    "rss": rss,
                    "phase": self.phase,
                    "tokens": self.pass_tokens,
                    "allocated": allocated,
                    "resident": resident,
                }

    def close(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        for hook in self._hooks:
            hook.remove()
        return [
            {"step": step, "pass": index, **peak, "rss_mib": round(peak["rss"] / MIB),
             "allocated_mib": round(peak["allocated"] / MIB),
             "resident_mib": round(peak["resident"] / MIB)}
            for (step, index), peak in sorted(self.peaks.items())
        ]  # fmt: skip


def table(rows: list[dict], top: int = 3) -> str:
    """Each step's ``top`` passes by peak RSS, as a Markdown table."""
    lines = [
        "| step | pass | tokens | peak RSS MiB | at | jemalloc allocated | jemalloc resident |",
        "|---|---|---|---|---|---|---|",
    ]
    for step in sorted({row["step"] for row in rows}):
        ranked = sorted((r for r in rows if r["step"] == step), key=lambda r: -r["rss"])
        for row in ranked[:top]:
            lines.append(
                f"| {step + 1} | {row['pass'] + 1} | {row['tokens']} | {row['rss_mib']:,} | "
                f"{row['phase']} | {row['allocated_mib']:,} | {row['resident_mib']:,} |"
            )
    return "\n".join(lines)
