"""The rule between the packages, enforced on the source (docs/design.md, "Components").

- Components never import each other: ``schemas`` imports no project package, ``broker`` only
  ``schemas``, and ``producers``, ``consumers``, ``environments``, ``trainer`` only ``schemas`` and
  ``broker``.
  They meet on the wire.
- ``agentarium`` (the face and composition root) may use every component, and no component
  imports ``agentarium``.
- Across packages, only faces are imported: a package's ``__init__`` (``from consumers import
  ConsumerService``, ``from consumers.engine import serve``), and only names in its ``__all__``;
  never a module (``consumers.worker``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = ("schemas", "broker", "producers", "consumers", "environments", "trainer")
ALLOWED = {
    "schemas": set(),
    "broker": {"schemas"},
    "producers": {"schemas", "broker"},
    "consumers": {"schemas", "broker"},
    "environments": {"schemas", "broker"},
    "trainer": {"schemas", "broker"},
    "agentarium": set(COMPONENTS),
}


def _public_names(package_dir: Path) -> set[str] | None:
    """The names in a package's ``__all__`` (None when it declares none)."""
    tree = ast.parse((package_dir / "__init__.py").read_text())
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Name) and target.id == "__all__":
                value = ast.literal_eval(node.value)  # type: ignore[arg-type]
                return {str(v) for v in value}
    return None


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) for every absolute import in a file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


def violations(root: Path) -> list[str]:
    """Every import in ``root``'s packages that breaks the rule, as 'file:line: why'."""
    found = []
    for package, allowed in ALLOWED.items():
        for path in sorted((root / package).rglob("*.py")):
            where = f"{path.relative_to(root)}"
            for line, module, names in _imports(path):
                top = module.split(".")[0]
                if top == package or top not in ALLOWED:
                    continue
                if top not in allowed:
                    found.append(f"{where}:{line}: {package} imports {top} ({module})")
                    continue
                target = root / Path(*module.split("."))
                if not (target / "__init__.py").is_file():
                    found.append(
                        f"{where}:{line}: {module} is a module inside {top}; import its "
                        "package's face instead"
                    )
                    continue
                public = _public_names(target)
                subpackages = {n for n in names if (target / n / "__init__.py").is_file()}
                hidden = sorted(set(names) - subpackages - (public or set()))
                if names and hidden:
                    found.append(
                        f"{where}:{line}: {', '.join(hidden)} not in {module}.__all__ "
                        f"(its public face)"
                    )
    return found


def test_components_meet_only_through_faces():
    assert violations(ROOT) == []


def test_every_component_declares_its_face():
    for package in (*COMPONENTS, "agentarium"):
        assert _public_names(ROOT / package), f"{package}/__init__.py has no __all__"


def test_the_checker_rejects_a_violating_tree(tmp_path):
    def write(relative: str, text: str) -> None:
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    for package in ALLOWED:
        write(f"{package}/__init__.py", "__all__ = ['Public']\nPublic = 1\n")
    write("consumers/worker.py", "Worker = 1\n")
    write("consumers/engine/__init__.py", "__all__ = ['serve']\nserve = 1\n")
    write("trainer/loop.py", "from consumers import Public\n")  # component -> component
    write("agentarium/a.py", "from consumers.worker import Worker\n")  # an internal module
    write("agentarium/b.py", "from consumers import Hidden\n")  # not in __all__
    write("broker/c.py", "import agentarium\n")  # component -> composition root
    write("agentarium/ok.py", "from consumers import Public\nfrom consumers.engine import serve\n")
    write("agentarium/ok2.py", "from consumers import engine\nimport consumers\n")
    found = violations(tmp_path)
    assert len(found) == 4, found
    assert any(f.startswith("trainer/loop.py:1: trainer imports consumers") for f in found)
    assert any(f.startswith("agentarium/a.py:1: consumers.worker is a module") for f in found)
    assert any(f.startswith("agentarium/b.py:1: Hidden not in consumers.__all__") for f in found)
    assert any(f.startswith("broker/c.py:1: broker imports agentarium") for f in found)
