#!/bin/sh
# A program agent that makes one LLM call (bench/program_rollouts.py) with sh, sed and curl:
# the task's prompt from stdin (the bench's prompts hold no quote or backslash), one chat
# completion of one token through the rollout's gateway, then the gateway's reply as it came
# (one JSON line) and the reward line.
set -eu
prompt=$(sed -n 's/.*"prompt": *"\([^"]*\)".*/\1/p')
curl -sS --fail-with-body "$OPENAI_BASE_URL/chat/completions" \
  -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
  -d "{\"model\": \"$AGENTARIUM_MODEL\", \"messages\": [{\"role\": \"user\", \"content\": \"$prompt\"}], \"max_tokens\": 1}"
echo
echo '{"reward": 0.0}'
