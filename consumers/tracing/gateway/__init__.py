"""The gateway's APIs: what the tracing proxy (``consumers/tracing/proxy.py``) speaks to agents.

One module per API, each turning a request into one ``llm.chat`` on the rollout's
``TracingLLM`` and its result into that API's reply: ``chat`` (OpenAI Chat Completions),
``responses`` (OpenAI Responses), ``anthropic`` (Anthropic Messages and count_tokens),
``models`` (model listing in both shapes); ``sse`` streams a finished call as an API's events,
``errors`` renders refusals in each API's error shape, ``route`` is a rollout's endpoint state.
"""
