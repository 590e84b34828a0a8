#!/usr/bin/env bash
# Codex CLI (npm @openai/codex) as a program agent, unchanged: a custom model provider pointed
# at the rollout's gateway (its Responses API), then `codex exec` on the task's prompt in the
# working directory. `codex` must be on PATH (ops/harnesses.sh installs it and says which PATH).
#   agentarium consumer --agent codex=exec:examples/harnesses/codex.sh --llm URL \
#     --program-env PATH=... --program-setup agentarium.examples.repo_task:setup --program-scorer agentarium.examples.repo_task:score
set -euo pipefail
prompt=$(node -e 'process.stdout.write(JSON.parse(require("fs").readFileSync(0, "utf8")).prompt)' \
  < "$AGENTARIUM_TASK_FILE")
mkdir -p "$HOME/.codex"
cat > "$HOME/.codex/config.toml" <<TOML
model = "$AGENTARIUM_MODEL"
model_provider = "agentarium"
approval_policy = "never"
sandbox_mode = "${CODEX_SANDBOX:-danger-full-access}"
model_reasoning_summary = "none"
web_search = "disabled"

[model_providers.agentarium]
name = "agentarium"
base_url = "$OPENAI_BASE_URL"
env_key = "OPENAI_API_KEY"
wire_api = "responses"

[agents]
enabled = false
TOML
exec codex exec --skip-git-repo-check --json "$prompt" < /dev/null
