#!/usr/bin/env bash
# The stack move, old against new (issue 53; docs/benchmarks.md): the same measurements from an older commit's tree
# and this one, each with its own .venv, alternated one run at a time on the same machine.
#
#   bench/stack_old_vs_new.sh OLD_COMMIT STEP...
#
# OLD_COMMIT is checked out as a detached worktree in $OLD_TREE (default /tmp/stack-old-<commit>) and installed
# with its own `make install` (timed; the time is in $OUT/old-install.log). This tree must be installed already.
# Each STEP runs the old side, then the new (`STEP:new-first` swaps them):
#   install        time `make install` in a fresh clone of this tree's HEAD (deleted after)
#   grpo-S         `make grpo` seed S (150 steps, held-out start -> end, steps/s, controller CPU per step)
#   vllm-S         the same job on the vLLM engine, $VLLM_STEPS steps (default 30)
#   async          python -m bench.async_vs_sync --steps 20 rollout.max_tokens=12
#   weightsync     python -m bench.weight_sync
#   parity         pytest tests/actors/engines/test_vllm.py (the vLLM engine's behaviour log-probs against
#                  teacher-forced ones, the kept sets' replay), with durations
#   summary        print the figures of every log in $OUT
# NEW_ARGS: config overrides for the new side's app runs (grpo, vllm, async), e.g. the old commit's values where
# the two configs differ, so that the comparison is the stack only. OLD_ARGS: the same for the old side.
# Every run holds $LOCK (default /tmp/forge-heavy.lock; empty: none) while it runs and only then; the load
# average and the date at its start are in its log.
set -euo pipefail

NEW_TREE=$(cd "$(dirname "$0")/.." && pwd)
OLD_COMMIT=${1:?usage: bench/stack_old_vs_new.sh OLD_COMMIT STEP...}
shift
OLD_TREE=${OLD_TREE:-/tmp/stack-old-${OLD_COMMIT}}
OUT=${OUT:-/tmp/stack_old_vs_new}
LOCK=${LOCK-/tmp/forge-heavy.lock}
VLLM_STEPS=${VLLM_STEPS:-30}
mkdir -p "$OUT/runs"

locked() {  # locked LOG TREE CMD...: run CMD in TREE under the lock, its output and a header/footer in LOG
  local log=$1 tree=$2
  shift 2
  local -a lock_cmd=()
  [[ -n $LOCK ]] && lock_cmd=(flock -o "$LOCK")
  "${lock_cmd[@]}" bash -c '
    log=$1 tree=$2; shift 2
    cd "$tree"
    { echo "# $(date -u +%FT%TZ) load $(cut -d" " -f1-3 /proc/loadavg) tree $tree ($(git rev-parse --short HEAD))"
      echo "# $*"; } > "$log"
    start=$(date +%s%N)
    rc=0
    "$@" >> "$log" 2>&1 || rc=$?
    ms=$(( ($(date +%s%N) - start) / 1000000 ))
    echo "# wall $((ms / 1000)).$(printf %03d $((ms % 1000))) s, rc $rc, load at end $(cut -d" " -f1-3 /proc/loadavg)" >> "$log"
  ' _ "$log" "$tree" "$@"
  tail -n 1 "$log"
}

if [[ ! -x $OLD_TREE/.venv/bin/python ]]; then
  [[ -d $OLD_TREE ]] || git -C "$NEW_TREE" worktree add --detach "$OLD_TREE" "$OLD_COMMIT"
  locked "$OUT/old-install.log" "$OLD_TREE" make install
fi

side() {  # side NAME STEP SEED: run one side of STEP
  local name=$1 step=$2 seed=$3 tree args
  if [[ $name == old ]]; then tree=$OLD_TREE args=${OLD_ARGS:-}; else tree=$NEW_TREE args=${NEW_ARGS:-}; fi
  local log="$OUT/$name-$step.log" py="$tree/.venv/bin/python" run="$OUT/runs/$name-$step"
  rm -rf "$run"
  echo "== $name $step"
  case $step in
    install)
      [[ $name == new ]] || { echo "(the old side's install is timed when its tree is made)"; return; }
      rm -rf "$OUT/fresh-clone" && git clone -q "$NEW_TREE" "$OUT/fresh-clone"
      locked "$log" "$OUT/fresh-clone" make install
      du -sh "$OUT/fresh-clone/.venv" >> "$log"
      rm -rf "$OUT/fresh-clone" ;;
    grpo-*)
      # shellcheck disable=SC2086
      locked "$log" "$tree" "$py" -m apps.grpo --config configs/grpo_tiny.yaml seed="$seed" run_dir="$run" \
        checkpoint.interval=0 $args ;;
    vllm-*)
      # shellcheck disable=SC2086
      locked "$log" "$tree" "$py" -m apps.grpo --config configs/grpo_tiny.yaml seed="$seed" run_dir="$run" \
        checkpoint.interval=0 steps="$VLLM_STEPS" generator.engine=vllm generator.engine_args.enforce_eager=true \
        generator.engine_args.max_model_len=64 $args ;;
    async)
      # shellcheck disable=SC2086
      locked "$log" "$tree" "$py" -m bench.async_vs_sync --steps 20 rollout.max_tokens=12 $args ;;
    weightsync)
      locked "$log" "$tree" "$py" -m bench.weight_sync ;;
    parity)
      locked "$log" "$tree" "$py" -m pytest -q -p no:cacheprovider --durations=0 tests/actors/engines/test_vllm.py ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
}

summary() {
  local log
  for log in "$OUT"/old-*.log "$OUT"/new-*.log; do
    [[ -f $log ]] || continue
    echo "== $(basename "$log" .log)"
    head -n 1 "$log"
    grep -E "^held-out|^throughput:|^max_policy_age|^ +[0-9]+ +[0-9.]+ +[0-9.]+x|^(bf16|fp32):|^  \((a|a2|b|c)\)|^  forge/|[0-9]+ (passed|failed)|^# wall" "$log" || true
  done
}

for arg in "$@"; do
  step=${arg%%:*}
  order=(old new)
  [[ $arg == *:new-first ]] && order=(new old)
  [[ $step == summary ]] && { summary; continue; }
  seed=0
  [[ $step =~ -([0-9]+)$ ]] && seed=${BASH_REMATCH[1]}
  for name in "${order[@]}"; do side "$name" "$step" "$seed"; done
done
