"""An instant SGLang-shaped server for benchmarks: ``python bench/fake_fleet.py --port 0``.

Uses the same fake as the tests (tests/fake_sglang.py: SGLang's exact /generate shapes),
answering immediately, so a benchmark measures Agentarium and not a model.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fake_sglang import FakeSGLang  # noqa: E402


async def main(port: int) -> None:
    server = FakeSGLang(output_ids=[49], text="1")
    server.requests = _Counter()  # do not keep every request body in memory
    url = await server.start() if port == 0 else None
    print(f"engine ready on {url}", flush=True)
    await asyncio.Event().wait()


class _Counter(list):
    def append(self, item) -> None:  # count only
        self.n = getattr(self, "n", 0) + 1

    def __len__(self) -> int:
        return getattr(self, "n", 0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    asyncio.run(main(parser.parse_args().port))
