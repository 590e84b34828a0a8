"""``--heap release`` (trainer/heap.py): the memory a pass frees goes back to the system, which
glibc left alone keeps; the trainer releases after each pass and after each step, and not at
all with ``--heap default``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from updatelib import batch_of

from agentarium.tiny import ensure_tiny_model
from agentarium.trainer import heap
from agentarium.trainer.config import TrainerConfig
from agentarium.trainer.step import LocalUpdater

pytestmark = pytest.mark.skipif(
    heap._libc() is None, reason="glibc only: nothing is done elsewhere"
)

# In a process of its own (the allocator's state is the process's): one 4 MiB tensor mapped and
# freed raises glibc's mmap threshold past its size, so the next 600 (2.4 GiB) come from the
# heap; they are freed while one allocated last stays, so the heap's top cannot shrink past it.
# What glibc keeps of them, and what is left after release(), in MiB of RSS over the start.
PROBE = textwrap.dedent(
    """
    import json, torch
    from agentarium.trainer import heap

    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024

    start = rss()
    warm = torch.ones(1 << 20)
    del warm
    blocks = [torch.ones(1 << 20) for _ in range(600)]  # 600 x 4 MiB, touched
    pin = torch.ones(1 << 20)
    del blocks
    kept = rss() - start
    released = heap.release()
    print(json.dumps({"kept": kept, "after": rss() - start, "released": released}))
    """
)


def test_release_gives_the_heaps_free_pages_back():
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # glibc keeps the freed 2.4 GiB (free heap memory below a live block); release hands all
    # but the live block (4 MiB) and the allocator's bookkeeping back
    assert out["kept"] > 2000 and out["released"], out
    assert out["after"] < 100, out


@pytest.mark.parametrize("mode", ["release", "default"])
def test_the_trainer_releases_after_each_pass_and_each_step(mode, monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "release", lambda: calls.append(1) or True)
    config = TrainerConfig(
        run="r", agent="a", model_dir=str(ensure_tiny_model()), micro_batch_size=2, heap=mode
    )
    updater = LocalUpdater(config)
    updater.step(batch_of(5), seed=1)  # 3 passes of at most 2 rows
    assert len(calls) == (3 + 1 if mode == "release" else 0)
