"""The weight syncer: runs beside an engine fleet, on its disk, and keeps every engine on a
run's latest policy version (``agentarium sync``; see syncer.py). It lives with the engines it
serves; the trainer only publishes."""

from .config import SyncConfig
from .service import run_sync
from .syncer import EngineResult, SyncRefused, SyncResult, WeightSyncer, reload_engine

__all__ = [
    "EngineResult",
    "SyncConfig",
    "SyncRefused",
    "SyncResult",
    "WeightSyncer",
    "reload_engine",
    "run_sync",
]
