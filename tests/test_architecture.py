"""The rule between the packages, enforced on the source (docs/design.md, "Components").

- One namespace: every component is imported as ``agentarium.<component>`` (the folders stay at
  the top of the repository; ``agentarium/<component>`` links to each). A bare ``import broker``
  would load a second copy of it, or a user's own ``broker``; it is refused everywhere.
- The layers: ``schemas`` and ``formats`` (model formats: chat templates, tokenizers, tool-call
  parsing) import no project package; ``broker`` only ``schemas``; ``inference`` (the engines'
  control client, registry and weight files, the local engine, the syncer) ``schemas``,
  ``broker`` and ``formats``; ``producers`` and ``environments`` ``schemas`` and ``broker``;
  ``consumers`` and ``trainer`` those and ``formats`` and ``inference``. The services inside
  ``inference`` (``inference.engine``, ``inference.sync``) are started by ``agentarium`` alone:
  the consumers and the trainer reach an engine over HTTP, through ``inference``'s face.
  Components otherwise meet on the wire.
- ``agentarium`` (the face and composition root) may use every component, and no component
  imports ``agentarium``'s own modules.
- Across packages, only faces are imported: a package's ``__init__`` (``from
  agentarium.consumers import ConsumerService``, ``from agentarium.inference.engine import
  serve``), and only names in its ``__all__``; never a module (``agentarium.consumers.service``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = (
    "schemas",
    "formats",
    "broker",
    "inference",
    "producers",
    "consumers",
    "environments",
    "trainer",
)
ALLOWED = {
    "schemas": set(),
    "formats": set(),
    "broker": {"schemas"},
    "inference": {"schemas", "broker", "formats"},
    "producers": {"schemas", "broker"},
    "environments": {"schemas", "broker"},
    "consumers": {"schemas", "broker", "formats", "inference"},
    "trainer": {"schemas", "broker", "formats", "inference"},
    "agentarium": set(COMPONENTS),
}
# services: only the composition root starts them
SERVICES = {"inference.engine", "inference.sync"}
# the other top-level packages: their imports are only checked for the namespace
NAMESPACE_ONLY = ("examples", "bench", "tests")
BARE = (*COMPONENTS, "examples")


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


def _sources(root: Path, package: str) -> list[Path]:
    """A top-level folder's Python files, not through the links agentarium/ holds."""
    return sorted(
        path
        for path in (root / package).rglob("*.py")
        if not any(p.is_symlink() for p in path.relative_to(root).parents if p != Path("."))
    )


def _component_of(module: str) -> tuple[str, list[str]] | None:
    """('consumers', ['tracing', 'llm']) for agentarium.consumers.tracing.llm; ('agentarium',
    [...]) for agentarium's own modules; None for anything else."""
    parts = module.split(".")
    if parts[0] != "agentarium":
        return None
    if len(parts) > 1 and parts[1] in COMPONENTS:
        return parts[1], parts[2:]
    return "agentarium", parts[1:]


def violations(root: Path) -> list[str]:
    """Every import in ``root``'s packages that breaks the rule, as 'file:line: why'."""
    found = []
    for package in (*ALLOWED, *NAMESPACE_ONLY):
        allowed = ALLOWED.get(package)
        for path in _sources(root, package):
            where = f"{path.relative_to(root)}"
            for line, module, names in _imports(path):
                top = module.split(".")[0]
                if top in BARE:
                    found.append(f"{where}:{line}: bare {module}; import agentarium.{module}")
                    continue
                target = _component_of(module)
                if allowed is None or target is None:
                    continue
                component, rest = target
                if component == package:
                    continue
                if component == "agentarium":
                    found.append(f"{where}:{line}: {package} imports agentarium ({module})")
                    continue
                if component not in allowed:
                    found.append(f"{where}:{line}: {package} imports {component} ({module})")
                    continue
                reached = {".".join([component, *rest[:1]])}
                if not rest:
                    reached |= {f"{component}.{n}" for n in names}
                service = next(iter(sorted(reached & SERVICES)), None)
                if package != "agentarium" and service:
                    found.append(
                        f"{where}:{line}: {package} imports the service {service}; only "
                        "agentarium starts it"
                    )
                    continue
                directory = root / component / Path(*rest)
                if not (directory / "__init__.py").is_file():
                    found.append(
                        f"{where}:{line}: {module} is a module inside {component}; import its "
                        "package's face instead"
                    )
                    continue
                public = _public_names(directory)
                subpackages = {n for n in names if (directory / n / "__init__.py").is_file()}
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


def test_every_component_is_in_the_namespace():
    for component in (*COMPONENTS, "examples"):
        link = ROOT / "agentarium" / component
        assert link.is_symlink(), f"agentarium/{component} is not a link to ../{component}"
        assert link.resolve() == (ROOT / component).resolve()


def test_every_top_level_package_is_covered():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages == {*ALLOWED, "examples"}, packages


def test_the_checker_rejects_a_violating_tree(tmp_path):
    def write(relative: str, text: str) -> None:
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    for package in ALLOWED:
        write(f"{package}/__init__.py", "__all__ = ['Public']\nPublic = 1\n")
    write("consumers/worker.py", "Worker = 1\n")
    write("inference/engine/__init__.py", "__all__ = ['serve']\nserve = 1\n")
    write("trainer/loop.py", "from agentarium.consumers import Public\n")  # component -> component
    write("agentarium/a.py", "from agentarium.consumers.worker import Worker\n")  # a module
    write("agentarium/b.py", "from agentarium.consumers import Hidden\n")  # not in __all__
    write("broker/c.py", "import agentarium.cli\n")  # component -> composition root
    write("agentarium/d.py", "from consumers import Public\n")  # outside the namespace
    write("consumers/e.py", "from agentarium.inference.engine import serve\n")  # a service
    write("consumers/f.py", "from agentarium.inference import engine\n")  # the same
    write("formats/g.py", "from agentarium.broker import Public\n")  # formats imports nothing
    write("tests/h.py", "import trainer\n")  # tests too stay in the namespace
    write(
        "agentarium/ok.py",
        "from agentarium.consumers import Public\nfrom agentarium.inference.engine import serve\n",
    )
    write(
        "agentarium/ok2.py",
        "from agentarium.inference import engine\nimport agentarium.consumers\n",
    )
    write("consumers/ok3.py", "from agentarium.inference import Public\nfrom . import worker\n")
    write("tests/ok4.py", "from agentarium.consumers.worker import Worker\n")
    found = violations(tmp_path)
    assert len(found) == 9, found
    expected = [
        "trainer/loop.py:1: trainer imports consumers",
        "agentarium/a.py:1: agentarium.consumers.worker is a module",
        "agentarium/b.py:1: Hidden not in agentarium.consumers.__all__",
        "broker/c.py:1: broker imports agentarium",
        "agentarium/d.py:1: bare consumers",
        "consumers/e.py:1: consumers imports the service inference.engine",
        "consumers/f.py:1: consumers imports the service inference.engine",
        "formats/g.py:1: formats imports broker",
        "tests/h.py:1: bare trainer",
    ]
    for prefix in expected:
        assert any(f.startswith(prefix) for f in found), (prefix, found)


def test_consumers_top_level_holds_at_most_a_dozen_modules():
    # the rest is grouped by what it does: worker/, agents/, tracing/, backends/
    modules = sorted(p.name for p in (ROOT / "consumers").glob("*.py"))
    assert len(modules) <= 12, modules
