"""One decoder layer's backward at a long pass's length: plain checkpointing against the sliced
layer (``--layer-chunk``, trainer/sliced_layers.py), alternated in one process.

    PYTHONPATH=. python bench/sliced_layer.py [--model smol] [--positions 8192] [--chunk 512]
        [--layer 5] [--repeat 5]

For each variant and round: the layer's work in a checkpointed training pass (its forward
without a graph, then in the backward pass its recomputation and backward: ``plain``; or the
sliced node's forward and backward: ``sliced``) on one row of ``--positions`` random hidden
states, one thread, and the most memory held above the round's start meanwhile (jemalloc's
``stats.allocated``, read every half millisecond by a thread: a peak shorter than that can
fall between readings). Prints the median and range of each, side by side, and how far the sliced layer's input
gradient is from plain checkpointing's (fp32: the same sums in another order). The process runs on
jemalloc (re-executed with it preloaded where it is installed; the bench refuses to run
without it).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory_timeline import MIB, _jemalloc_allocated  # noqa: E402

from agentarium.models import resolve_model  # noqa: E402
from agentarium.trainer import packing, sliced_layers  # noqa: E402
from agentarium.trainer.heap import use_allocator  # noqa: E402
from agentarium.trainer.step import StepSettings, load_policy  # noqa: E402


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smol", help="a built-in model's name or a directory")
    parser.add_argument("--positions", type=positive, default=8192, help="the row's length")
    parser.add_argument("--chunk", type=positive, default=512, help="--layer-chunk's value")
    parser.add_argument("--layer", type=int, default=5, help="which decoder layer")
    parser.add_argument("--repeat", type=positive, default=5, help="rounds of both variants")
    args = parser.parse_args()
    use_allocator("jemalloc")
    allocated = _jemalloc_allocated()
    if allocated is None:
        raise SystemExit("this bench reads jemalloc's counters: apt-get install libjemalloc2")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = load_policy(
        resolve_model(args.model), "cpu", StepSettings(activation_checkpointing=True)
    )
    layers = sliced_layers.decoder_layers(model)
    if not -len(layers) <= args.layer < len(layers):
        raise SystemExit(f"--layer {args.layer}: the model has {len(layers)} layers")
    layer = layers[args.layer]
    forward = type(layer).forward
    while hasattr(forward, "__wrapped__"):  # transformers' checkpointing wrapper: the layer's own
        forward = forward.__wrapped__
    t = args.positions
    hidden = torch.randn(1, t, model.config.hidden_size) * 0.5
    grad = torch.randn(1, t, model.config.hidden_size) * 1e-3
    positions = torch.arange(t)[None]
    bounds = torch.tensor([0, t], dtype=torch.int32)
    kwargs = {
        "attention_mask": None,
        "position_ids": positions,
        "position_embeddings": model.model.rotary_emb(hidden, positions),
        "cu_seq_lens_q": bounds,
        "cu_seq_lens_k": bounds,
        "max_length_q": t,
        "max_length_k": t,
        "packed_row_edges": [0, t],
    }

    def plain() -> torch.Tensor:
        with torch.no_grad():
            forward(layer, hidden, **kwargs)  # the forward pass, under checkpointing
        again = hidden.detach().requires_grad_(True)
        forward(layer, again, **kwargs).backward(grad)  # recomputed, then its backward
        return again.grad

    def sliced() -> torch.Tensor:
        call = sliced_layers._Call(functools.partial(forward, layer, **kwargs), t, args.chunk)
        call.output(hidden)
        return call.backward(hidden, grad)

    variants = {"plain": plain, "sliced": sliced}
    seen: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    grads: dict[str, torch.Tensor] = {}
    for round_ in range(args.repeat):
        order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
        for name in order:
            layer.zero_grad(set_to_none=True)
            base = allocated()[0]
            peak, stop = [base], threading.Event()

            def sample(peak=peak, stop=stop) -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], allocated()[0])
                    time.sleep(0.0005)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            started = time.monotonic()
            grads.pop(name, None)
            with packing.packed_forward():
                grads[name] = variants[name]()
            elapsed = time.monotonic() - started
            stop.set()
            sampler.join()
            seen[name].append((elapsed, (peak[0] - base) / MIB))
            print(f"round {round_ + 1} {name}: {elapsed:.2f} s, +{seen[name][-1][1]:.1f} MiB",
                  flush=True)  # fmt: skip
    print(
        f"\n{args.model}, layer {args.layer}, {t} positions, chunk {args.chunk}, 1 thread, "
        f"{args.repeat} rounds alternated: median (min-max)"
    )
    difference = (grads["sliced"] - grads["plain"]).abs().max() / grads["plain"].abs().max()
    print(
        f"the input's gradient: sliced against plain, {float(difference):.1e} of its largest entry"
    )
    print("| variant | seconds | peak above the start, MiB |\n|---|---|---|")
    for name, rows in seen.items():
        times, peaks = [r[0] for r in rows], [r[1] for r in rows]
        print(
            f"| {name} | {statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f}) | "
            f"{statistics.median(peaks):.1f} ({min(peaks):.1f}-{max(peaks):.1f}) |"
        )


if __name__ == "__main__":
    main()
