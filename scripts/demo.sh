#!/usr/bin/env bash
# `make demo`: train the default project, interrupt it the way a preempting scheduler does
# (SIGTERM), resume it to the end with `forge resume`, then generate text from the result.
set -euo pipefail

project=${1:-projects/tiny_lm}
steps=${DEMO_STEPS:-400}
stop_at=${DEMO_STOP_AT:-200}
forge=${FORGE:-.venv/bin/forge}
say() { printf '\n\033[1m== %s\033[0m\n' "$*" >&2; }

say "forge ls -p $project"
"$forge" ls -p "$project"

say "forge train -p $project -D max_steps=$steps   (stopped with SIGTERM after step $stop_at)"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$forge" train -p "$project" -D max_steps="$steps" >"$out" &
pid=$!
until [ -s "$out" ]; do sleep 0.2; done
run_dir=$(head -n 1 "$out")
stop_ckpt=$(printf '%s/checkpoints/checkpoint-%06d' "$run_dir" "$stop_at")
until [ -d "$stop_ckpt" ] || ! kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
kill -TERM "$pid" 2>/dev/null || true
status=0
wait "$pid" || status=$?
say "training stopped with exit code $status (143 = SIGTERM: a checkpoint was saved first)"

say "forge resume -p $project --run-dir $run_dir"
"$forge" resume -p "$project" --run-dir "$run_dir" >/dev/null

say "forge runs / forge checkpoints --verify"
"$forge" runs -p "$project"
"$forge" checkpoints -p "$project" --run-dir "$run_dir" --verify

say "forge generate $run_dir --prompt 'def '"
"$forge" generate "$run_dir" --prompt "def " --num 2 --max-new-tokens 60
