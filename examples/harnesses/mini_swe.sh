#!/usr/bin/env bash
# mini-swe-agent (PyPI mini-swe-agent, on litellm) as a program agent, unchanged: litellm's
# OpenAI provider reads OPENAI_BASE_URL / OPENAI_API_KEY (set by the consumer: the rollout's
# gateway, its Chat Completions API), and `mini` runs the task's prompt in the working directory
# in yolo mode, at most MINI_STEP_LIMIT model calls. Its trajectory is printed last, as one JSON
# line ({"mini_trajectory": ...}). `mini` must be on PATH (ops/harnesses.sh installs it).
#   agentarium consumer --agent mini=exec:examples/harnesses/mini_swe.sh --llm URL \
#     --program-env PATH=... --program-setup agentarium.examples.repo_task:setup --program-scorer agentarium.examples.repo_task:score
set -euo pipefail
prompt=$(python3 -c 'import json, sys; print(json.load(sys.stdin)["prompt"])' < "$AGENTARIUM_TASK_FILE")
export MSWEA_CONFIGURED=true MSWEA_COST_TRACKING=ignore_errors
export LITELLM_LOCAL_MODEL_COST_MAP=True  # no fetch of its price list from the internet
status=0
mini --yolo --exit-immediately --task "$prompt" --model "openai/$AGENTARIUM_MODEL" \
  -c mini.yaml -c "agent.step_limit=${MINI_STEP_LIMIT:-4}" -c agent.cost_limit=0 \
  -o "$HOME/mini.traj.json" < /dev/null || status=$?
python3 -c 'import json, sys; print(json.dumps({"mini_trajectory": json.load(open(sys.argv[1]))}))' \
  "$HOME/mini.traj.json"
exit "$status"
