#!/usr/bin/env bash
# Settings and helpers shared by the TPU VM scripts (sourced by them, not run).
#
# Every setting comes from an environment variable and can be overridden by a flag (flags take the
# --name=value form):
#   PROJECT          --project=...          GCP project (empty: gcloud's configured project)
#   ZONE             --zone=...             default us-central2-b
#   TPU_NAME         --tpu-name=...         default llds
#   ACCELERATOR      --accelerator=...      default v4-32 (a pod slice of 4 hosts)
#   RUNTIME_VERSION  --runtime-version=...  TPU VM image, default tpu-ubuntu2204-base
#   RUN_DIR          --run-dir=gs://...     the run's folder: checkpoints, metrics, TensorBoard events
#   REMOTE_DIR       --remote-dir=...       checkout folder on every worker, relative to home; default llds_jax
# and --dry-run prints every command (one line each, shell-quoted) instead of running it.
set -euo pipefail

if ((BASH_VERSINFO[0] < 4 || (BASH_VERSINFO[0] == 4 && BASH_VERSINFO[1] < 4))); then
  echo "$(basename "$0"): needs bash >= 4.4, this is $BASH_VERSION (macOS: brew install bash)" >&2
  exit 2
fi

PROJECT="${PROJECT:-}"
ZONE="${ZONE:-us-central2-b}"
TPU_NAME="${TPU_NAME:-llds}"
ACCELERATOR="${ACCELERATOR:-v4-32}"
RUNTIME_VERSION="${RUNTIME_VERSION:-tpu-ubuntu2204-base}"
RUN_DIR="${RUN_DIR:-}"
REMOTE_DIR="${REMOTE_DIR:-llds_jax}"
DRY_RUN=0
# Logs and pid files of runs on every worker; $HOME is expanded there. Used by run.sh, logs.sh and stop.sh.
# shellcheck disable=SC2016,SC2034
REMOTE_LOG_DIR='$HOME/llds_logs'
# Arguments parse_common did not consume, for the script's own flags.
ARGS=()

# Prints the comment block at the top of the calling script.
usage() {
  sed -n '2,/^$/s/^# \{0,1\}//p' "$0"
}

die() {
  echo "$(basename "$0"): $*" >&2
  exit 2
}

# Consumes the shared flags; everything else is left in ARGS.
parse_common() {
  ARGS=()
  while (($#)); do
    case "$1" in
      --project=*) PROJECT="${1#*=}" ;;
      --zone=*) ZONE="${1#*=}" ;;
      --tpu-name=*) TPU_NAME="${1#*=}" ;;
      --accelerator=*) ACCELERATOR="${1#*=}" ;;
      --runtime-version=*) RUNTIME_VERSION="${1#*=}" ;;
      --run-dir=*) RUN_DIR="${1#*=}" ;;
      --remote-dir=*) REMOTE_DIR="${1#*=}" ;;
      --dry-run) DRY_RUN=1 ;;
      -h | --help) usage; exit 0 ;;
      *) ARGS+=("$1") ;;
    esac
    shift
  done
  [[ -n "$TPU_NAME" ]] || die "TPU_NAME is empty"
  [[ -n "$ZONE" ]] || die "ZONE is empty"
}

# Fails unless the named setting is non-empty.
require() {
  [[ -n "${!1}" ]] || die "$1 is not set (export $1=... or pass $2=...)"
}

# One argument quoted for a POSIX shell (unchanged when it needs no quotes), like Python's shlex.quote.
quote() {
  if [[ "$1" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
    printf '%s' "$1"
  else
    local squote="'"
    printf "'%s'" "${1//$squote/$squote\\$squote$squote}"
  fi
}

# Arguments quoted and joined by spaces (a command line for a remote shell).
join_quoted() {
  local out=() arg
  for arg in "$@"; do
    out+=("$(quote "$arg")")
  done
  echo "${out[*]}"
}

# Runs a command, or prints it under --dry-run.
run() {
  if ((DRY_RUN)); then
    join_quoted "$@"
  else
    "$@"
  fi
}

# gcloud's location flags.
location_flags() {
  LOCATION=(--zone="$ZONE")
  if [[ -n "$PROJECT" ]]; then
    LOCATION+=(--project="$PROJECT")
  fi
}

# Runs a shell command on the TPU VM's workers: tpu_ssh WORKER COMMAND [extra gcloud flags...]
tpu_ssh() {
  local worker=$1 command=$2
  shift 2
  [[ "$worker" =~ ^([0-9]+|all)$ ]] || die "worker must be a number or 'all', got '$worker'"
  location_flags
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${LOCATION[@]}" --worker="$worker" "$@" --command="$command"
}
