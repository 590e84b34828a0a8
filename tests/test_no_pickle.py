"""Nothing that arrives on the wire or is read from disk is unpickled.

Messages are msgpack or JSON (``schemas.codec``), weights safetensors, checkpoints'
optimizer and RNG states ``torch.load(..., weights_only=True)``, config files
``yaml.safe_load``. A check over every shipped module's syntax tree refuses the calls that
would run code from bytes (pickle and its relatives, ``torch.load`` without
``weights_only=True``, ``numpy.load(allow_pickle=True)``, ``yaml.load`` without a safe
loader), and a checkpoint whose optimizer file carries a pickled payload is refused without
running it. (Ray pickles the arguments of its own remote calls inside the user's Ray cluster:
that is Ray's transport, not Agentarium's wire, and none of it is read from NATS or disk.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from agentarium.trainer.checkpoint import Checkpoints
from agentarium.trainer.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = (
    "schemas",
    "broker",
    "producers",
    "consumers",
    "environments",
    "trainer",
    "agentarium",
    "examples",
    "bench",
)
UNSAFE_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "cloudpickle",
    "dill",
    "shelve",
    "marshal",
    "joblib",
}
# What of those modules reads bytes back (their exception classes are harmless).
LOADERS = {"load", "loads", "load_all", "Unpickler", "open"}
# Where a banned name may appear, and why. Empty: nothing needs one.
ALLOWED: dict[str, str] = {}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _keyword(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_calls(source: str, filename: str = "<source>") -> list[str]:
    """Each place in ``source`` that could unpickle, as ``file:line: what``."""
    found = []
    tree = ast.parse(source, filename)
    aliases = {}  # local name -> unsafe module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in UNSAFE_MODULES:
                    aliases[alias.asname or alias.name] = alias.name
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in UNSAFE_MODULES:
                for alias in node.names:
                    if alias.name in LOADERS or alias.name == "*":
                        found.append(f"{where}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Attribute) and node.attr in LOADERS:
            owner = _dotted(node.value)
            if owner in aliases:
                found.append(f"{where}: {aliases[owner]}.{node.attr}")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name in ("torch.load",) and not _is_true(_keyword(node, "weights_only")):
                found.append(f"{where}: torch.load without weights_only=True")
            elif name in ("np.load", "numpy.load") and _is_true(_keyword(node, "allow_pickle")):
                found.append(f"{where}: {name}(allow_pickle=True)")
            elif name in ("yaml.unsafe_load", "yaml.full_load", "yaml.unsafe_load_all"):
                found.append(f"{where}: {name}")
            elif name in ("yaml.load", "yaml.load_all"):
                loader = _keyword(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
                if loader is None or "Safe" not in _dotted(loader):
                    found.append(f"{where}: {name} without a SafeLoader")
            elif name.endswith("read_pickle") or name.endswith(".from_pickle"):
                found.append(f"{where}: {name}")
    return found


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle\npickle.loads(data)",
        "import pickle\nreader = pickle.Unpickler(f)",
        "import cloudpickle as cp\ncp.loads(data)",
        "from dill import loads",
        "import shelve\nshelve.open(path)",
        "import marshal\nmarshal.loads(data)",
        "torch.load(path)",
        "torch.load(path, weights_only=False)",
        "np.load(path, allow_pickle=True)",
        "yaml.load(text)",
        "yaml.load(text, Loader=yaml.Loader)",
        "yaml.unsafe_load(text)",
        "pd.read_pickle(path)",
    ],
)
def test_the_check_finds_each_kind_of_unpickling(snippet):
    assert unsafe_calls(snippet), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "torch.load(path, weights_only=True)",
        "np.load(path, allow_pickle=False)",
        "np.load(path)",
        "yaml.safe_load(text)",
        "yaml.load(text, Loader=yaml.SafeLoader)",
        "msgpack.unpackb(data)",
        "import pickle\nrefused = pickle.UnpicklingError",
        "json.loads(text)",
    ],
)
def test_the_check_passes_safe_loading(snippet):
    assert not unsafe_calls(snippet), snippet


def test_no_shipped_module_unpickles():
    files = [p for d in SHIPPED for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 50, "the check must see the packages"
    found = []
    for path in files:
        rel = str(path.relative_to(ROOT))
        found += [f for f in unsafe_calls(path.read_text(), rel) if rel not in ALLOWED]
    assert not found, "unpickling of untrusted bytes:\n" + "\n".join(found)


class _RunsCode:
    """Unpickling this calls ``Path.touch`` on the marker: code run by loading a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_checkpoint_with_a_pickled_payload_is_refused_unrun(tmp_path):
    checkpoints = Checkpoints(tmp_path / "ckpt")
    linear = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(linear.parameters())
    path = checkpoints.save(
        step=1,
        version=1,
        model_state=linear.state_dict(),
        optimizer_state=optimizer.state_dict(),
        trained_job_ids=["j1"],
        consumed_job_ids=[],
    )
    assert checkpoints.load(path).step == 1  # a checkpoint as written loads
    marker = tmp_path / "code-ran"
    torch.save({"state": _RunsCode(marker)}, path / "optimizer.pt")
    with pytest.raises(CheckpointError, match="unreadable"):
        checkpoints.load(path)
    assert not marker.exists()
