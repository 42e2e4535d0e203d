#!/usr/bin/env bash
# Installs the project on every worker: `pip install -e '.[tpu]' -c constraints.txt` in REMOTE_DIR.
#
# Usage: launch/setup.sh [--repo=URL [--ref=REF]] [shared flags, see launch/common.sh]
#   (default)      copies the committed HEAD of this checkout (git archive) to every worker
#   --repo=URL     clones URL on every worker instead (or fetches, when REMOTE_DIR exists)
#   --ref=REF      branch, tag or commit to check out with --repo (default main)

# shellcheck source-path=SCRIPTDIR
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_common "$@"

repo=""
ref="main"
for arg in "${ARGS[@]}"; do
  case "$arg" in
    --repo=*) repo="${arg#*=}" ;;
    --ref=*) ref="${arg#*=}" ;;
    *) die "unknown argument '$arg' (see --help)" ;;
  esac
done

dir=$(quote "$REMOTE_DIR")
install="cd $dir && python3 -m pip install --upgrade pip && python3 -m pip install -e '.[tpu]' -c constraints.txt"
if [[ -n "$repo" ]]; then
  fetch="if [ -d $dir ]; then git -C $dir fetch --all --tags; else git clone $(quote "$repo") $dir; fi"
  tpu_ssh all "$fetch && git -C $dir checkout $(quote "$ref") && $install"
else
  repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  archive="/tmp/llds_jax-$TPU_NAME.tar.gz"
  run git -C "$repo_root" archive --format=tar.gz --output="$archive" HEAD
  location_flags
  run gcloud compute tpus tpu-vm scp "$archive" "$TPU_NAME:llds_jax.tar.gz" "${LOCATION[@]}" --worker=all
  tpu_ssh all "mkdir -p $dir && tar -xzf llds_jax.tar.gz -C $dir && rm llds_jax.tar.gz && $install"
fi
