"""The rollout worker loop: pull jobs for one agent (``puller.py``), keep deliveries in flight
(``intake.py``), handle each one (``handler.py``: decode, decide, run, settle), store its
trajectory exactly once (``store.py``), and the background loops (heartbeat, registry entry).
What to do with a delivery is ``consumers/delivery.py``'s policy, as data."""

from .background import BackgroundLoops, Heartbeat, RegistryEntry
from .counters import Counters
from .handler import DeliveryHandler, Handled
from .intake import Intake
from .puller import JobPuller
from .store import TrajectoryStore
from .worker import Worker

__all__ = [
    "BackgroundLoops",
    "Counters",
    "DeliveryHandler",
    "Handled",
    "Heartbeat",
    "Intake",
    "JobPuller",
    "RegistryEntry",
    "TrajectoryStore",
    "Worker",
]
