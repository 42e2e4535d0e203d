#!/usr/bin/env bash
# Stops a run on every worker with SIGTERM (by the pid run.sh saved): the trainer saves a checkpoint and exits.
#
# Usage: launch/stop.sh [--run-name=NAME] [shared flags]
#   --run-name=NAME  as given to run.sh (default: the last part of RUN_DIR)

# shellcheck source-path=SCRIPTDIR
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_common "$@"

run_name=""
for arg in "${ARGS[@]}"; do
  case "$arg" in
    --run-name=*) run_name="${arg#*=}" ;;
    *) die "unknown argument '$arg' (see --help)" ;;
  esac
done
if [[ -z "$run_name" ]]; then
  require RUN_DIR --run-dir
  run_name=$(basename "$RUN_DIR")
fi

tpu_ssh all "kill -TERM \$(cat $REMOTE_LOG_DIR/$(quote "$run_name").pid)"
