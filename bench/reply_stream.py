"""The tracing client's live parse (``formats.ReplyStream``): its cost per piece as replies grow.

A reply of ``n`` 4-character pieces (a ``<think>`` block, then plain words; Hermes tool calls
offered, so the call marker is watched for) is fed piece by piece to ``ReplyStream``, and to
its first design, which parsed the whole text so far at every piece (kept as the reference of
tests/test_reply_stream.py), alternating, ``--repeat`` times for each length; the table gives
the median and range of the whole feed and of a piece. A cost that stays flat per piece as
``n`` grows is linear in the reply.

    PYTHONPATH=. python bench/reply_stream.py [--pieces 4000,32000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from agentarium.formats import ReplyStream

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from formatcases import whole_text_deltas  # noqa: E402


def reply_pieces(n: int) -> list[str]:
    text = "<think>" + "reason " * (n // 4) + "</think>" + "word " * n
    return [text[i : i + 4] for i in range(0, 4 * n, 4)]


def feed_seconds(pieces: list[str], way: str) -> float:
    start = time.perf_counter()
    if way == "reparse":
        whole_text_deltas(pieces, "hermes", "think", True, False)
    else:
        stream = ReplyStream(tool_format="hermes", reasoning_format="think", tools=True)
        for piece in pieces:
            stream.feed(piece)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--pieces", default="4000,32000", help="reply lengths in pieces, comma-separated"
    )
    parser.add_argument("--repeat", type=int, default=5, help="feeds of each length (>= 1)")
    args = parser.parse_args()
    try:
        lengths = [int(n) for n in args.pieces.split(",")]
    except ValueError:
        parser.error(f"--pieces takes whole numbers separated by commas, got {args.pieces!r}")
    if args.repeat < 1 or any(n < 1 for n in lengths):
        parser.error("--repeat and every --pieces length must be at least 1")
    ways = ("ReplyStream", "reparse")
    times: dict[tuple[int, str], list[float]] = {(n, w): [] for n in lengths for w in ways}
    for round_ in range(args.repeat):
        for n in lengths:
            for way in ways if round_ % 2 == 0 else reversed(ways):
                times[n, way].append(feed_seconds(reply_pieces(n), way))
    print("| pieces | way | feed s, median (range) | per piece us |")
    print("|---|---|---|---|")
    for (n, way), runs in times.items():
        med = statistics.median(runs)
        print(
            f"| {n:,} | {way} | {med:.3f} ({min(runs):.3f}-{max(runs):.3f}) | {med / n * 1e6:.1f} |"
        )


if __name__ == "__main__":
    main()
