#!/usr/bin/env bash
# Deletes the TPU VM (RUN_DIR on GCS is kept).
#
# Usage: launch/delete.sh [--yes] [shared flags, see launch/common.sh]
#   --yes  do not ask for confirmation

# shellcheck source-path=SCRIPTDIR
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_common "$@"

confirm=()
for arg in "${ARGS[@]}"; do
  case "$arg" in
    --yes) confirm=(--quiet) ;;
    *) die "unknown argument '$arg' (see --help)" ;;
  esac
done

location_flags
run gcloud compute tpus tpu-vm delete "$TPU_NAME" "${LOCATION[@]}" "${confirm[@]}"
