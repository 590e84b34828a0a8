"""Agentarium: the rollout layer for agentic RL on NATS JetStream."""
