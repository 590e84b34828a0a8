"""The command line's parser: the CPU a build costs, with the settings classes' type hints
worked out once a class (``schemas.settings.type_hints``, the default) and, beside it, asked
anew for every flag as before it was kept.

Each round builds the parser ``--builds`` times in one process with each variant, alternated,
and prints the median (min-max) CPU seconds of a build over ``--repeat`` rounds; the first build
of the process (imports, bytecode) is not counted.

    PYTHONPATH=. python bench/cli_parser.py [--builds 20] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
import types
import typing

from agentarium.cli import build_parser
from agentarium.schemas import settings

CACHED = settings.type_hints


def uncached(klass: type) -> types.MappingProxyType[str, typing.Any]:
    return types.MappingProxyType(typing.get_type_hints(klass))


def per_build(builds: int, hints) -> float:  # type: ignore[no-untyped-def]
    """CPU seconds of one parser build, the mean of ``builds``."""
    settings.type_hints = hints  # flags and files look it up at each call
    try:
        start = time.process_time()
        for _ in range(builds):
            build_parser()
        return (time.process_time() - start) / builds
    finally:
        settings.type_hints = CACHED


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--builds", type=int, default=20, help="parser builds a measurement")
    parser.add_argument("--repeat", type=int, default=5, help="rounds, the variants alternated")
    args = parser.parse_args()
    for name in ("builds", "repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    build_parser()  # imports and the first build's one-off work, not counted
    times: dict[str, list[float]] = {"kept a class (type_hints)": [], "asked a flag": []}
    variants = [("kept a class (type_hints)", CACHED), ("asked a flag", uncached)]
    for round_ in range(args.repeat):
        for name, hints in variants if round_ % 2 == 0 else variants[::-1]:
            times[name].append(per_build(args.builds, hints))
    print(f"| type hints | CPU s a parser build, median (min-max) of {args.repeat} |")
    print("|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.4f} ({min(values):.4f}-{max(values):.4f}) |")


if __name__ == "__main__":
    main()
