"""The live dashboard: ``agentarium dashboard``, a page served from the package that shows a run
as it happens (queues, workers, rewards, trainer steps, engine versions, dead letters), read from
the broker alone."""

from .config import DEFAULT_PORT, DashboardConfig
from .server import DashboardServer, run_dashboard
from .view import LiveView

__all__ = ["DEFAULT_PORT", "DashboardConfig", "DashboardServer", "LiveView", "run_dashboard"]
