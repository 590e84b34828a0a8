"""The seed README's LangChain agent, as a Ray remote function, with the one change Ray forces.

Ray 2.60 raises at decoration time on ``async def`` under ``@ray.remote``, so the rollout is a
plain ``def``; everything else is the seed's code. ``endpoint`` is the consumer's tracing
proxy scoped to this rollout (``http://<host>:<port>/r/<secret>/v1``, the secret the
rollout's own): every call ``ChatOpenAI`` makes is recorded with its token ids, and since the
URL names the rollout the API key is not used (any value works).

    orch = AgentOrchestrator(server_addresses=[...], ray_config={"num_actors": 4})
    orch.register_agent_type("langchain", rollout)

Needs ``pip install langchain-openai ray``. Tasks look like ``{"prompt": ..., "answer": ...}``.
"""

from __future__ import annotations

import ray


def get_agent(llm):
    """The seed's ``get_agent(llm)``: here the smallest LangChain runnable, prompt | llm."""
    from langchain_core.prompts import ChatPromptTemplate

    prompt = ChatPromptTemplate.from_messages([("user", "{prompt}")])
    return prompt | llm


@ray.remote(num_cpus=0.1)
def rollout(task: dict, endpoint: str, model: str) -> dict:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=model,
        openai_api_base=endpoint,
        openai_api_key="unused",  # the endpoint names the rollout; the key is ignored
        max_tokens=task.get("max_new_tokens", 8),
        temperature=1.0,
        max_retries=0,  # the consumer retries failed rollouts itself
    )
    agent = get_agent(llm)
    result = agent.invoke({"prompt": task["prompt"]})
    text = str(result.content).strip()
    reward = 1.0 if text.startswith(str(task.get("answer", ""))) else 0.0
    return {"reward": reward, "metrics": {"reply_chars": float(len(text))}, "answer": text}
