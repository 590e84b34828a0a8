"""A program agent that makes one LLM call (bench/program_rollouts.py), standard library only:
the task from stdin, one chat completion of one token through the rollout's gateway, then the
gateway's reply as it came (one JSON line) and the reward line."""

import json
import os
import sys
import urllib.request

task = json.load(sys.stdin)
body = {
    "model": os.environ["AGENTARIUM_MODEL"],
    "messages": [{"role": "user", "content": task["prompt"]}],
    "max_tokens": 1,
}
request = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"] + "/chat/completions",
    data=json.dumps(body).encode(),
    headers={
        "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
        "Content-Type": "application/json",
    },
)
with urllib.request.urlopen(request) as response:
    reply = json.loads(response.read())
print(json.dumps(reply))
print('{"reward": 0.0}')
