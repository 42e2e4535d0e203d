#!/usr/bin/env bash
# Serves TensorBoard for RUN_DIR on worker 0 and forwards it to http://localhost:PORT here (Ctrl-C to stop).
#
# Usage: launch/tensorboard.sh [--port=N] [shared flags, see launch/common.sh]
#   --port=N  local and remote port (default 6006)

# shellcheck source-path=SCRIPTDIR
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_common "$@"

port=6006
for arg in "${ARGS[@]}"; do
  case "$arg" in
    --port=*) port="${arg#*=}" ;;
    *) die "unknown argument '$arg' (see --help)" ;;
  esac
done
[[ "$port" =~ ^[0-9]+$ ]] || die "--port must be a number, got '$port'"
require RUN_DIR --run-dir

tpu_ssh 0 "python3 -m tensorboard.main --logdir=$(quote "$RUN_DIR/tensorboard") --port=$port" \
  --ssh-flag=-L"$port":localhost:"$port"
