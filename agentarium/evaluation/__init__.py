"""Evaluation: ``eval run`` (every task K times, resumable, cross-sampling), ``eval summary``,
and trajectory export to JSON lines or parquet."""

from .config import EvalConfig
from .export import FORMATS, export_run
from .run import EvalError, EvalRun, print_summary, run_eval

__all__ = [
    "FORMATS",
    "EvalConfig",
    "EvalError",
    "EvalRun",
    "export_run",
    "print_summary",
    "run_eval",
]
