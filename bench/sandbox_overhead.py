"""The shell sandbox's overhead per command, beside a plain subprocess of the same command.

Each variant runs the same command N times in a row (one session, sequential, output captured)
and reports milliseconds per command; the variants alternate within every repeat (rotating
which goes first), so machine noise hits them alike. Printed: median and range over repeats.

  plain          asyncio.create_subprocess_exec("/bin/bash", "-c", cmd), stdout+stderr piped,
                 communicate(): what a worker without a sandbox would do
  plain+preexec  the same with a no-op preexec_fn: Python then forks and runs code in the child
                 instead of vfork+exec (the price of applying limits in the child)
  sandbox        environments.sandbox.Sandbox.run(cmd): in mode namespaces (root, bubblewrap)
                 nsenter into the session's namespaces as its uid, joined to its cgroup, the
                 rlimits, empty environment, wall, output and session-CPU watch, and every
                 process of the session ended after it; in a weaker mode what that mode does

    .venv/bin/python bench/sandbox_overhead.py [--commands 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentarium.environments.sandbox import Sandbox, isolation  # noqa: E402

COMMANDS = ("true", "echo hello")


async def plain(command: str, **options) -> bytes:
    proc = await asyncio.create_subprocess_exec(
        "/bin/bash",
        "-c",
        command,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        **options,
    )
    out, _ = await proc.communicate()
    return out


async def plain_preexec(command: str) -> bytes:
    return await plain(command, preexec_fn=lambda: None)


async def per_command_ms(run, command: str, n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        await run(command)
    return (time.perf_counter() - started) / n * 1000


async def main(n: int, repeats: int) -> None:
    iso = isolation()
    base = Path(tempfile.mkdtemp(prefix="sandbox-bench-"))
    box = await Sandbox.open(base_dir=base / "a", allow_weaker=True)

    async def sandboxed(command: str) -> bytes:
        return (await box.run(command)).output.encode()

    variants = {"plain": plain, "plain+preexec": plain_preexec, "sandbox": sandboxed}
    for command in COMMANDS:  # warm up, and the outputs agree
        outs = {name: await run(command) for name, run in variants.items()}
        assert len(set(outs.values())) == 1, outs
    print(f"isolation: {iso.as_dict()}; {n} commands per repeat, {repeats} repeats (alternated)")
    results: dict[tuple[str, str], list[float]] = {}
    names = list(variants)
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for command in COMMANDS:
            for name in order:
                ms = await per_command_ms(variants[name], command, n)
                results.setdefault((command, name), []).append(ms)
    await box.close()
    print(f"\n| command | {' | '.join(names)} | sandbox - plain |")
    print("|---" * (len(names) + 2) + "|")
    for command in COMMANDS:
        cells, medians = [], {}
        for name in names:
            values = results[(command, name)]
            medians[name] = statistics.median(values)
            cells.append(f"{medians[name]:.2f} ({min(values):.2f}..{max(values):.2f})")
        extra = medians["sandbox"] - medians["plain"]
        print(f"| `{command}` | {' | '.join(cells)} | +{extra:.2f} ms |")
    print("\nms per command: median (min..max) over repeats")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commands", type=int, default=200, help="commands per variant and repeat")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.commands, args.repeats))
