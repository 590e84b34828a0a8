"""Where a trainer step's peak RSS is: the process's resident memory sampled every
millisecond, each sample tagged with the phase of the step it fell in.

``Timeline(model)`` marks, with hooks on the model and on each decoder layer (transformers'
``GradientCheckpointingLayer``), which step and pass is running and which layer's forward or
backward it is in: a layer's backward phase starts when the gradient of its output arrives
(under activation checkpointing: its recomputation, then its backward); the optimizer's update
is a phase of its own. A thread reads ``/proc/self/statm`` every ``interval`` seconds and
keeps, per (step, pass), the highest RSS and the phase it was reached in, and, on jemalloc,
the bytes the program holds at that reading (``stats.allocated``) and the pages jemalloc keeps
for them, freed ones not yet purged included (``stats.resident``), read whenever a reading is
a new peak; with them, the part of that RSS that is pages of mapped files or shared memory
(``statm``'s shared pages: the libraries, and the weights while they are still the safetensors
file's pages; a trainer step maps no shared memory).

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


def _rss() -> tuple[int, int]:
    """(resident, file-backed): the process's resident bytes, and those of them that are
    pages of mapped files (shared libraries, a mapped weights file) or shared memory, rather
    than its heap (``statm``'s third field: RssFile plus RssShmem)."""
    with open("/proc/self/statm", "rb") as f:
        fields = f.read().split()
    return int(fields[1]) * PAGE, int(fields[2]) * PAGE


def _jemalloc_allocated():  # type: ignore[no-untyped-def]
    """A function returning jemalloc's ``stats.allocated`` and ``stats.resident`` (bytes), or
    None where the process does not run on jemalloc."""
    try:
        mallctl = ctypes.CDLL(None).mallctl
    except AttributeError:
        return None
    epoch = ctypes.c_uint64(1)

    def allocated() -> tuple[int, int]:
        """(allocated, resident): what the program holds, and the pages jemalloc holds for
        it, freed ones it has not purged yet included."""
        if mallctl(b"epoch", None, None, ctypes.byref(epoch), ctypes.sizeof(epoch)) != 0:
            raise OSError("jemalloc: mallctl('epoch') failed")
        read = []
        for name in (b"stats.allocated", b"stats.resident"):
            value = ctypes.c_size_t(0)
            size = ctypes.c_size_t(ctypes.sizeof(value))
            if mallctl(name, ctypes.byref(value), ctypes.byref(size), None, 0) != 0:
                raise OSError(f"jemalloc: mallctl({name.decode()!r}) failed")
            read.append(value.value)
        return read[0], read[1]

    return allocated


UPDATE = 1_000_000  # the pass number the optimizer's update is filed under


class Timeline:
    """Per (step, pass): the highest RSS sampled, its file-backed part, the phase it fell in,
    jemalloc's allocated and resident bytes read at that reading. ``step()`` starts the next step's count;
    ``close()`` stops the sampler. Pass -1 is a step's start, ``UPDATE`` its update."""

    def __init__(self, model, optimizer=None, interval: float = 0.001) -> None:  # type: ignore[no-untyped-def]
        from transformers.modeling_layers import GradientCheckpointingLayer

        self.interval = interval
        # (step, pass, the pass's tokens, phase): one tuple, replaced whole, so the sampler
        # never reads a step with the last step's pass
        self.state: tuple[int, int, int, str] = (-1, -1, 0, "setup")
        self.peaks: dict[tuple[int, int], dict] = {}
        self._allocated = _jemalloc_allocated()
        self._hooks = []
        self._stop = threading.Event()
        layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        if not layers:
            raise ValueError(f"{type(model).__name__} has no decoder layers to follow")

        def on_model(_module, args, kwargs):  # type: ignore[no-untyped-def]
            if torch._C._current_autograd_node() is not None:
                return  # a recomputation inside the backward pass, not a new pass
            ids = kwargs.get("input_ids", args[0] if args else None)
            step, index, _, _ = self.state
            self.state = (step, index + 1, int(ids.numel()) if ids is not None else 0, "embed")

        def phase(name: str) -> None:
            step, index, tokens, _ = self.state
            self.state = (step, index, tokens, name)

        self._hooks.append(model.register_forward_pre_hook(on_model, with_kwargs=True))
        for index, layer in enumerate(layers):

            def on_layer(_module, _args, index=index):  # type: ignore[no-untyped-def]
                if torch._C._current_autograd_node() is None:
                    phase(f"forward L{index}")

            def after_layer(_module, _args, output, index=index):  # type: ignore[no-untyped-def]
                # the gradient of a layer's output arrives when its backward (and, under
                # checkpointing, its recomputation) is next: that phase starts then
                hidden = output[0] if isinstance(output, tuple) else output
                if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                    hidden.register_hook(lambda _grad, index=index: phase(f"backward L{index}"))

            self._hooks.append(layer.register_forward_pre_hook(on_layer))
            self._hooks.append(layer.register_forward_hook(after_layer))

        def after_layers(_module, _args, _output):  # type: ignore[no-untyped-def]
            if torch._C._current_autograd_node() is None:
                phase("head and loss")

        self._hooks.append(layers[-1].register_forward_hook(after_layers))
        if optimizer is not None:

            def on_update(_optimizer, _args, _kwargs):  # type: ignore[no-untyped-def]
                step, _, _, _ = self.state
                self.state = (step, UPDATE, 0, "update")

            self._hooks.append(optimizer.register_step_pre_hook(on_update))
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def step(self) -> None:
        self.state = (self.state[0] + 1, -1, 0, "step start")

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            rss, file_backed = _rss()
            step, index, tokens, phase = self.state
            best = self.peaks.get((step, index))
            if best is None or rss > best["rss"]:
                # jemalloc's counters at this reading (a mallctl epoch costs tens of
                # microseconds: only on a new peak)
                allocated, resident = self._allocated() if self._allocated else (0, 0)
                self.peaks[(step, index)] = {
                    "rss": rss, "file": file_backed, "phase": phase, "tokens": tokens,
                    "allocated": allocated, "resident": resident,
                }  # fmt: skip

    def close(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        for hook in self._hooks:
            hook.remove()
        return [
            {"step": step, "pass": index, **peak, "rss_mib": round(peak["rss"] / MIB),
             "allocated_mib": round(peak["allocated"] / MIB),
             "resident_mib": round(peak["resident"] / MIB),
             "file_mib": round(peak["file"] / MIB)}
            for (step, index), peak in sorted(self.peaks.items())
            if step >= 0
        ]  # fmt: skip


def _pass_label(index: int) -> str:
    return {-1: "start", UPDATE: "update"}.get(index, str(index + 1))


def table(rows: list[dict], top: int = 3) -> str:
    """Each step's ``top`` passes by peak RSS, as a Markdown table."""
    lines = [
        "| step | pass | tokens | peak RSS MiB | at | jemalloc allocated | jemalloc resident "
        "| file-backed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for step in sorted({row["step"] for row in rows}):
        ranked = sorted((r for r in rows if r["step"] == step), key=lambda r: -r["rss"])
        for row in ranked[:top]:
            lines.append(
                f"| {step + 1} | {_pass_label(row['pass'])} | {row['tokens']} | "
                f"{row['rss_mib']:,} | {row['phase']} | {row['allocated_mib']:,} | "
                f"{row['resident_mib']:,} | {row['file_mib']:,} |"
            )
    return "\n".join(lines)
