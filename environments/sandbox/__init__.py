"""The shell environment's sandbox: one per session, one ``bash -c`` per command.

``session.py`` (``Sandbox``: open, run, close), ``limits.py`` (``SandboxLimits``,
``CommandResult``), ``host.py`` (what this host lets it enforce, ``isolation()``, and the sweep
at worker start), ``namespaces.py`` (a session's own namespaces and root file system, held by
bubblewrap), ``cgroups.py`` (a session's cgroup, v1 or v2), ``uids.py`` (a uid per session).
docs/design.md, "The sandbox", says what it isolates, on which hosts, and what it does not.
"""

from .host import Isolation, isolation, sweep
from .limits import HITS, CommandResult, SandboxError, SandboxLimits, human_bytes
from .session import Sandbox

__all__ = [
    "HITS",
    "CommandResult",
    "Isolation",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "human_bytes",
    "isolation",
    "sweep",
]
