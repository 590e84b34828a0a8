"""Agentarium inside the RL frameworks people train with.

- ``agentarium.integrations.trl``: TRL's ``GRPOTrainer`` with a ``rollout_func`` whose rollouts
  Agentarium runs, and a callback that publishes the weights after every optimizer step.
- ``agentarium.integrations.verl``: a verl agent loop (``agent_name: agentarium``) that sends
  each sample to Agentarium; imported in verl's own virtualenv, it loads only Agentarium's
  client side (``schemas``, ``broker``, ``producers`` and the torch-free ``trainer`` face).

Both publish jobs through ``RolloutClient`` (``client.py``) and turn each trajectory into one
sample by the trainer's own row rule (``samples.py``). Nothing is imported here: each module
loads its framework only when asked for.
"""

__all__: list[str] = []
