#!/usr/bin/env bash
# Claude Code (npm @anthropic-ai/claude-code) as a program agent, unchanged: ANTHROPIC_BASE_URL
# and ANTHROPIC_API_KEY (set by the consumer) point it at the rollout's gateway (its Anthropic
# Messages API), every model it would pick is the policy, and `claude -p` runs the task's prompt
# in the working directory. `claude` must be on PATH (ops/harnesses.sh installs it).
#   agentarium consumer --agent claude=exec:examples/harnesses/claude.sh --llm URL \
#     --program-env PATH=... --program-setup agentarium.examples.repo_task:setup --program-scorer agentarium.examples.repo_task:score
set -euo pipefail
prompt=$(node -e 'process.stdout.write(JSON.parse(require("fs").readFileSync(0, "utf8")).prompt)' \
  < "$AGENTARIUM_TASK_FILE")
export ANTHROPIC_MODEL="$AGENTARIUM_MODEL"
export ANTHROPIC_DEFAULT_OPUS_MODEL="$AGENTARIUM_MODEL" ANTHROPIC_DEFAULT_SONNET_MODEL="$AGENTARIUM_MODEL"
export ANTHROPIC_DEFAULT_HAIKU_MODEL="$AGENTARIUM_MODEL" ANTHROPIC_SMALL_FAST_MODEL="$AGENTARIUM_MODEL"
export CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1 DISABLE_TELEMETRY=1
# the policy does not think: no thinking, no effort, no context editing of thinking blocks
export CLAUDE_CODE_DISABLE_THINKING=1 CLAUDE_CODE_DISABLE_ADAPTIVE_THINKING=1 MAX_THINKING_TOKENS=0
# no beta request shapes (mid-conversation system messages, context editing)
export CLAUDE_CODE_DISABLE_EXPERIMENTAL_BETAS=1
export CLAUDE_CODE_EFFORT_LEVEL=auto CLAUDE_CODE_MAX_OUTPUT_TOKENS=${CLAUDE_CODE_MAX_OUTPUT_TOKENS:-4096}
exec claude -p "$prompt" --model "$AGENTARIUM_MODEL" --output-format json \
  --permission-mode "${CLAUDE_PERMISSION_MODE:-acceptEdits}" --allowedTools "Bash,Edit,Write,Read" < /dev/null
