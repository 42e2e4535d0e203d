#!/usr/bin/env bash
# Creates the TPU VM (a single host or a pod slice).
#
# Usage: launch/create.sh [--spot | --preemptible] [shared flags, see launch/common.sh]
#   --spot         a Spot VM (cheaper; may be preempted at any time, the run resumes from its checkpoint)
#   --preemptible  a preemptible VM (the older kind of Spot VM)

# shellcheck source-path=SCRIPTDIR
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_common "$@"

capacity=()
for arg in "${ARGS[@]}"; do
  case "$arg" in
    --spot | --preemptible) capacity=("$arg") ;;
    *) die "unknown argument '$arg' (see --help)" ;;
  esac
done

location_flags
run gcloud compute tpus tpu-vm create "$TPU_NAME" "${LOCATION[@]}" --accelerator-type="$ACCELERATOR" \
  --version="$RUNTIME_VERSION" "${capacity[@]}"
