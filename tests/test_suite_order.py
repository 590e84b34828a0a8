"""The first pass's order: long tests head worksteal's runs, one share per worker."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from suite_order import spread_long_tests


@dataclass(frozen=True)
class Item:
    name: str
    seconds: float = 0.0

    def get_closest_marker(self, name):
        return pytest.mark.long(self.seconds).mark if self.seconds else None


def runs(items: list, workers: int) -> list[list[str]]:
    """The runs worksteal hands out at start: ``remaining // workers_left`` each, in order."""
    out, start, remaining = [], 0, len(items)
    for k in range(workers):
        size = remaining // (workers - k)
        out.append([i.name for i in items[start : start + size]])
        start, remaining = start + size, remaining - size
    return out


def test_long_tests_head_the_runs_longest_first_and_the_rest_keep_their_order():
    items = [Item(f"t{i}") for i in range(40)]
    items[30] = Item("smol", 210)
    items[35] = Item("trl", 200)
    items[5] = Item("mypy", 100)
    items[20] = Item("learn", 65)
    items[21] = Item("ray", 75)
    ordered = spread_long_tests(items, 4)
    assert sorted(i.name for i in ordered) == sorted(i.name for i in items)
    heads = runs(ordered, 4)
    assert [run[0] for run in heads] == ["smol", "trl", "mypy", "ray"]
    assert heads[3][1] == "learn"  # the run with the least long work takes the next one
    rest = [i.name for i in ordered if not i.seconds]
    assert rest == [i.name for i in items if not i.seconds]


def test_one_process_or_no_long_tests_keep_the_collection_order():
    items = [Item("a"), Item("b", 50), Item("c")]
    assert spread_long_tests(items, 0) == items
    assert spread_long_tests(items, 1) == items
    plain = [Item(f"t{i}") for i in range(9)]
    assert spread_long_tests(plain, 4) == plain


def test_the_runs_are_cut_after_m_has_deselected(tmp_path):
    """A real collection under ``-m "not chaos"``: the long tests head the runs worksteal cuts
    from what is left, however many deselected tests came before them."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(here)!r})\n"
        "from suite_order import pytest_collection_modifyitems  # noqa: F401\n"
    )
    deselected = "".join(f"@pytest.mark.chaos\ndef test_a{i}():\n    pass\n\n" for i in range(6))
    plain = "".join(f"def test_p{i}():\n    pass\n\n" for i in range(6))
    (tmp_path / "test_order.py").write_text(
        "import pytest\n\n" + deselected + plain
        + "@pytest.mark.long(50)\ndef test_long1():\n    pass\n\n"
        + "@pytest.mark.long(60)\ndef test_long2():\n    pass\n"
    )  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", "not chaos", "-W", "ignore::pytest.PytestUnknownMarkWarning"],
        cwd=tmp_path, capture_output=True, text=True,
        env={**os.environ, "PYTEST_XDIST_WORKER_COUNT": "2"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    names = [line.split("::")[1] for line in result.stdout.splitlines() if "::" in line]
    assert len(names) == 8, names
    assert [names[0], names[4]] == ["test_long2", "test_long1"], names
