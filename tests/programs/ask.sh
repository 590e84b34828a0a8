#!/usr/bin/env bash
# A program agent in bash: the prompt the setup function left (programlib.setup: given.txt),
# one chat completion with curl through the rollout's gateway, and the reply left in
# response.json for the scorer (programlib.score); nothing printed.
set -euo pipefail
prompt=$(cat given.txt)
body=$(printf '{"model": "%s", "messages": [{"role": "user", "content": "%s"}], "max_tokens": 4}' \
  "$AGENTARIUM_MODEL" "$prompt")
curl -sS --fail-with-body "$OPENAI_BASE_URL/chat/completions" \
  -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
  -d "$body" -o response.json
