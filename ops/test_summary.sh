#!/usr/bin/env bash
# ops/test.sh's closing lines: one per tier (passed or FAILED with its status, pytest's counts
# where it printed them, its time), then the total as "suite: N passed, N failed"; exits 1 if
# any tier failed. Usage: ops/test_summary.sh LOGS_DIR TIER...
# Each tier left LOGS_DIR/TIER.log (its output), TIER.rc (its status) and TIER.s (seconds).
set -uo pipefail
logs=$1
shift
failed=0 passed_all=0 failed_all=0
echo "ops/test.sh: summary"
for name in "$@"; do
  rc=$(cat "$logs/$name.rc" 2>/dev/null || echo "?") s=$(cat "$logs/$name.s" 2>/dev/null || echo 0)
  # pytest's last counts line, e.g. "2 failed, 1064 passed, 12 warnings in 748.48s (0:12:28)"
  counts=$(grep -E "^(=+ )?[0-9]+ (passed|failed|errors?|skipped|deselected)" "$logs/$name.log" \
    2>/dev/null | tail -n 1 | sed -E 's/^=+ //; s/ in [0-9.]+s.*//; s/ =+$//')
  for n in $(grep -oE "[0-9]+ passed" <<<"$counts" | grep -oE "^[0-9]+"); do
    passed_all=$((passed_all + n))
  done
  for n in $(grep -oE "[0-9]+ (failed|errors?)" <<<"$counts" | grep -oE "^[0-9]+"); do
    failed_all=$((failed_all + n))
  done
  if [ "$rc" = 0 ]; then verdict=passed; else verdict="FAILED (rc $rc)" failed=1; fi
  printf 'ops/test.sh:   %-15s %-16s %-40s %dm%02ds\n' "$name" "$verdict" \
    "${counts:-no pytest counts}" $((s / 60)) $((s % 60))
done
echo "suite: $passed_all passed, $failed_all failed"
exit "$failed"
