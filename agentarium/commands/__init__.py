"""Subcommands of the ``agentarium`` command, one module each."""
