#!/usr/bin/env bash
# A program that never ends, with a child, a grandchild and a process that left its session
# (setsid): every one of them must be gone once its rollout is over. Each is `sleep $1`, so a
# test finds them by that command line; their pids go to stdout and, when $READY names a FIFO,
# there too, with the working directory last (the test's cue that all are running).
set -u
sleep "$1" &
child=$!
bash -c "sleep $1 & echo \$!; wait" > grandchild.pid &
setsid sleep "$1" &
escaped=$!
until [ -s grandchild.pid ]; do sleep 0.01; done
pids="$child $(cat grandchild.pid) $escaped"
echo "pids $pids"
if [ -n "${READY:-}" ]; then echo "$pids $PWD" > "$READY"; fi
wait
