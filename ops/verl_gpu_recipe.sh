#!/usr/bin/env bash
# verl 0.9.1 + SGLang on one GPU machine, every rollout run by Agentarium consumers on verl's own
# SGLang servers (agentarium.integrations.verl; docs/integrations.md). Prepared for a device
# run; the CPU tests (tests/test_verl_agent_loop.py) cover the loop inside verl's worker.
#   MODEL=/models/Qwen2.5-0.5B-Instruct ops/verl_gpu_recipe.sh [STEPS]
# Steps: Agentarium's .venv (ops/setup.sh), verl's GPU venv (verl[sglang], Agentarium's client
# packages, Agentarium without deps), a toy dataset in verl's parquet format, the broker, verl's
# trainer with the agentarium agent loop, then a consumer on the servers the loop announces.
set -euo pipefail
cd "$(dirname "$0")/.."

model=${MODEL:?set MODEL to a local model directory, e.g. /models/Qwen2.5-0.5B-Instruct}
steps=${1:-20}
work=${WORK:-/tmp/agentarium-verl-gpu}
venv=${AGENTARIUM_VERL_GPU_VENV:-$HOME/.cache/agentarium/verl-gpu-venv}
port=${NATS_PORT:-4222}
run=verl # examples/verl_agent_loop.yaml's run and agent (toy)
export AGENTARIUM_NATS_URL="nats://127.0.0.1:$port"
mkdir -p "$work"

./ops/setup.sh
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet "verl[sglang]==0.9.1" \
    "nats-py>=2.9,<3" "msgpack>=1.0" "aiohttp>=3.9" "structlog>=24.1" \
    "opentelemetry-api>=1.25" "opentelemetry-sdk>=1.25" "prometheus-client>=0.20"
  "$venv/bin/python" -m pip install --quiet --no-deps -e .
fi

.venv/bin/python - "$work" <<'EOF'
import sys
import pyarrow as pa, pyarrow.parquet as pq
def rows(n, offset):
    return [{"data_source": "toy", "ability": "digits",
             "prompt": [{"role": "user", "content": f"repeat {(i + offset) % 10}"}],
             "reward_model": {"style": "rule", "ground_truth": str((i + offset) % 10)},
             "extra_info": {"index": i}} for i in range(n)]
pq.write_table(pa.Table.from_pylist(rows(1024, 0)), f"{sys.argv[1]}/train.parquet")
pq.write_table(pa.Table.from_pylist(rows(64, 3)), f"{sys.argv[1]}/val.parquet")
EOF

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT
.venv/bin/agentarium broker up --port "$port" --store "$work/nats" >"$work/broker.log" 2>&1 &
pids+=($!)
until .venv/bin/agentarium broker status >/dev/null 2>&1; do sleep 1; done

"$venv/bin/python" -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  data.train_files="$work/train.parquet" data.val_files="$work/val.parquet" \
  data.train_batch_size=16 data.max_prompt_length=256 data.max_response_length=16 \
  actor_rollout_ref.model.path="$model" \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=16 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
  actor_rollout_ref.rollout.name=sglang \
  actor_rollout_ref.rollout.n=8 \
  actor_rollout_ref.rollout.calculate_log_probs=true \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
  actor_rollout_ref.rollout.agent.agent_loop_config_path="$PWD/examples/verl_agent_loop.yaml" \
  actor_rollout_ref.rollout.agent.default_agent_loop=agentarium \
  trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.total_training_steps="$steps" \
  trainer.val_before_train=false trainer.test_freq=-1 trainer.save_freq=-1 \
  trainer.logger='[console]' >"$work/verl.log" 2>&1 &
verl=$!
pids+=("$verl")

# verl's servers start, the first step's samples wait in the job queue, the loop announces the
# servers: then the consumer runs the rollouts on them.
until urls=$(.venv/bin/python -m agentarium.integrations.servers "$run" 2>/dev/null); do
  kill -0 "$verl" 2>/dev/null || { tail -n 50 "$work/verl.log"; exit 1; }
  sleep 5
done
llm=()
for url in $urls; do llm+=(--llm "$url"); done
.venv/bin/agentarium consumer --agent toy=agentarium.examples.toy:rollout --model "$model" \
  --concurrency 256 "${llm[@]}" >"$work/consumer.log" 2>&1 &
pids+=($!)
echo "verl servers: $urls; logs in $work"
wait "$verl"
grep -E "critic/score/mean|step:" "$work/verl.log" | tail -n "$steps"
