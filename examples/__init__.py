"""Runnable example agents and task files."""
