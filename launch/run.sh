#!/usr/bin/env bash
# Starts training on every worker: the same `python3 -m llds_jax.launch` command, in the background (nohup), so
# it survives the ssh session. Each worker logs to $HOME/llds_logs/RUN_NAME.log and keeps the process id in
# $HOME/llds_logs/RUN_NAME.pid (see logs.sh, stop.sh). Running it again after a preemption resumes the run from
# the latest checkpoint in RUN_DIR.
#
# Usage: launch/run.sh --config=CONFIG [--run-name=NAME] [shared flags] [-- more llds_jax.launch flags]
#   --config=CONFIG   config file, relative to the checkout (e.g. configs/qwen3b_v4.py)
#   --run-name=NAME   names the log files (default: the last part of RUN_DIR)
# RUN_DIR (required) is passed on as --config.run_dir.

# shellcheck source-path=SCRIPTDIR
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_common "$@"

config=""
run_name=""
extra=()
for ((i = 0; i < ${#ARGS[@]}; i++)); do
  arg="${ARGS[i]}"
  case "$arg" in
    --config=*) config="${arg#*=}" ;;
    --run-name=*) run_name="${arg#*=}" ;;
    --) extra=("${ARGS[@]:i+1}"); break ;;
    *) die "unknown argument '$arg' (pass flags for llds_jax.launch after --)" ;;
  esac
done
[[ -n "$config" ]] || die "--config=CONFIG is required"
require RUN_DIR --run-dir
run_name="${run_name:-$(basename "$RUN_DIR")}"
[[ "$run_name" =~ ^[A-Za-z0-9_.-]+$ ]] || die "run name '$run_name' must be letters, digits, '_', '.' or '-'"

log="$REMOTE_LOG_DIR/$run_name"
train=$(join_quoted python3 -m llds_jax.launch --config="$config" --config.run_dir="$RUN_DIR" "${extra[@]}")
# The braces keep `&` to the python process alone, so the pid file holds its pid (nohup execs it).
start="{ nohup $train > $log.log 2>&1 < /dev/null & echo \$! > $log.pid; }"
tpu_ssh all "mkdir -p $REMOTE_LOG_DIR && cd $(quote "$REMOTE_DIR") && $start"
