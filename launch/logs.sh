#!/usr/bin/env bash
# Follows a run's log on one worker (or all, interleaved).
#
# Usage: launch/logs.sh [--run-name=NAME] [--worker=N|all] [--lines=N] [shared flags]
#   --run-name=NAME  as given to run.sh (default: the last part of RUN_DIR)
#   --worker=N       worker to read (default 0: the one that prints metrics); 'all' for every worker
#   --lines=N        lines of history before following (default 100)

# shellcheck source-path=SCRIPTDIR
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_common "$@"

run_name=""
worker=0
lines=100
for arg in "${ARGS[@]}"; do
  case "$arg" in
    --run-name=*) run_name="${arg#*=}" ;;
    --worker=*) worker="${arg#*=}" ;;
    --lines=*) lines="${arg#*=}" ;;
    *) die "unknown argument '$arg' (see --help)" ;;
  esac
done
if [[ -z "$run_name" ]]; then
  require RUN_DIR --run-dir
  run_name=$(basename "$RUN_DIR")
fi
[[ "$lines" =~ ^[0-9]+$ ]] || die "--lines must be a number, got '$lines'"

tpu_ssh "$worker" "tail -n $lines -F $REMOTE_LOG_DIR/$(quote "$run_name").log"
