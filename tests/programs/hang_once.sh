#!/usr/bin/env bash
# A program agent whose first run of a job hangs and whose rerun answers, for the test that
# SIGKILLs the consumer mid-run. Every run appends "JOB PID PGID" to the file $RUNS. A first run
# (its job not in $RUNS yet) starts a child in its group and a process that left its session
# (setsid), writes "JOB PID PGID SUPERVISOR ESCAPED WORKDIR" to the FIFO $READY (the test's cue)
# and waits forever. A rerun makes one chat completion through the rollout's gateway with curl
# and prints its reward line.
set -euo pipefail
read -r pid _ _ ppid pgid _ < /proc/$$/stat
seen=$(grep -c "^$AGENTARIUM_JOB_ID " "$RUNS" || true)
echo "$AGENTARIUM_JOB_ID $pid $pgid" >> "$RUNS"
if [ "$seen" = 0 ]; then
  sleep 300 &
  setsid sleep 300 &
  echo "$AGENTARIUM_JOB_ID $pid $pgid $ppid $! $PWD" > "$READY"
  wait
fi
body=$(printf '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}' \
  "$AGENTARIUM_MODEL")
curl -sS --fail-with-body "$OPENAI_BASE_URL/chat/completions" \
  -H "Content-Type: application/json" -d "$body" -o /dev/null
echo '{"reward": 1.0}'
