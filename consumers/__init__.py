"""Rollout consumers: the worker loop, agent adapters, the tracing LLM client and proxy, backends."""
