#!/usr/bin/env bash
# Train ragen_jax on a Cloud TPU VM or pod slice: create, set up every worker, run on all workers, stream
# logs, delete. Every step runs alone; --dry-run prints the exact gcloud commands instead of running them.
#
#   launch/tpu.sh all    --name ragen --zone us-central2-b --accelerator-type v4-32 --project my-proj \
#                        --config configs/sokoban.py -- --config.model.hf_path=/data/Qwen2.5-3B
#   launch/tpu.sh create --name ragen --zone us-central2-b --accelerator-type v4-32
#   launch/tpu.sh setup  --name ragen --zone us-central2-b --repo https://github.com/me/ragen_jax.git
#   launch/tpu.sh run    --name ragen --zone us-central2-b --config configs/sokoban.py   # detached
#   launch/tpu.sh logs   --name ragen --zone us-central2-b                               # tail -f, worker 0
#   launch/tpu.sh delete --name ragen --zone us-central2-b
#
# Subcommands:
#   create  gcloud compute tpus tpu-vm create (--spot for a preemptible slice)
#   setup   put the code on every worker (--repo URL [--branch B]: git clone; --copy (default): tar of the
#           files git tracks in this checkout, scp'd to all workers) and pip install -e ".[tpu]"
#   run     start training on all workers (--worker=all), detached with nohup, output in
#           ~/ragen_jax/logs/train.log on each worker; --foreground streams all workers' output instead
#   logs    tail -f the log of one worker (--log-worker N, default 0: process 0 prints the progress)
#   delete  delete the TPU VM (asks no question)
#   all     create, setup, run --foreground, then delete (unless --keep), also after a failure
# Every worker runs the same program; ragen_jax.parallel.distributed.maybe_initialize detects the TPU pod and calls
# jax.distributed.initialize(), and the mesh spans all chips of the slice.
set -euo pipefail

NAME=""
ZONE=""
PROJECT=""
ACCELERATOR_TYPE="v4-8"
VERSION="tpu-ubuntu2204-base"
REPO=""
BRANCH=""
COPY=1
CONFIG="configs/sokoban.py"
REMOTE_DIR="ragen_jax"
LOG_WORKER=0
FOREGROUND=0
SPOT=0
KEEP=0
DRY_RUN=0
EXTRA_ARGS=()

usage() {
  sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'
  cat <<'EOF'
Flags: --name NAME (required) --zone ZONE (required) [--project P] [--accelerator-type v4-32]
       [--version tpu-ubuntu2204-base] [--repo URL [--branch B] | --copy] [--config configs/X.py]
       [--remote-dir ragen_jax] [--log-worker N] [--foreground] [--spot] [--keep] [--dry-run]
       [-- extra arguments for python -m ragen_jax.main]
EOF
}

die() {
  echo "tpu.sh: $*" >&2
  exit 2
}

# Print a command the way a shell reads it back: plain words as they are, others in single quotes.
show() {
  local out="" arg
  for arg in "$@"; do
    if [[ "$arg" =~ ^[A-Za-z0-9_./:=@,+%-]+$ ]]; then
      out+="$arg "
    elif [[ "$arg" =~ ^(--[a-z-]+=)(.*)$ ]]; then
      local value="${BASH_REMATCH[2]}"
      out+="${BASH_REMATCH[1]}'${value//\'/\'\\\'\'}' "
    else
      out+="'${arg//\'/\'\\\'\'}' "
    fi
  done
  echo "${out% }"
}

run_cmd() {
  if [[ "$DRY_RUN" == 1 ]]; then
    show "$@"
  else
    echo "+ $(show "$@")" >&2
    "$@"
  fi
}

parse_args() {
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --name) NAME="$2"; shift 2 ;;
      --zone) ZONE="$2"; shift 2 ;;
      --project) PROJECT="$2"; shift 2 ;;
      --accelerator-type) ACCELERATOR_TYPE="$2"; shift 2 ;;
      --version) VERSION="$2"; shift 2 ;;
      --repo) REPO="$2"; COPY=0; shift 2 ;;
      --branch) BRANCH="$2"; shift 2 ;;
      --copy) COPY=1; REPO=""; shift ;;
      --config) CONFIG="$2"; shift 2 ;;
      --remote-dir) REMOTE_DIR="$2"; shift 2 ;;
      --log-worker) LOG_WORKER="$2"; shift 2 ;;
      --foreground) FOREGROUND=1; shift ;;
      --spot) SPOT=1; shift ;;
      --keep) KEEP=1; shift ;;
      --dry-run) DRY_RUN=1; shift ;;
      -h|--help) usage; exit 0 ;;
      --) shift; EXTRA_ARGS=("$@"); break ;;
      *) die "unknown flag $1 (see --help)" ;;
    esac
  done
  [[ -n "$NAME" ]] || die "--name is required"
  [[ -n "$ZONE" ]] || die "--zone is required"
  [[ "$LOG_WORKER" =~ ^[0-9]+$ ]] || die "--log-worker takes a worker number, got $LOG_WORKER"
}

# Flags every gcloud tpu-vm command takes.
common_flags() {
  COMMON=("--zone=$ZONE")
  if [[ -n "$PROJECT" ]]; then
    COMMON+=("--project=$PROJECT")
  fi
}

ssh_all() {
  run_cmd gcloud compute tpus tpu-vm ssh "$NAME" "${COMMON[@]}" --worker=all --command="$1"
}

do_create() {
  local spot=()
  if [[ "$SPOT" == 1 ]]; then
    spot=(--spot)
  fi
  run_cmd gcloud compute tpus tpu-vm create "$NAME" "${COMMON[@]}" \
    "--accelerator-type=$ACCELERATOR_TYPE" "--version=$VERSION" "${spot[@]}"
}

do_setup() {
  if [[ "$COPY" == 0 ]]; then
    [[ -n "$REPO" ]] || die "setup needs --repo URL or --copy"
    local branch=""
    if [[ -n "$BRANCH" ]]; then
      branch="--branch $BRANCH "
    fi
    ssh_all "rm -rf ~/$REMOTE_DIR && git clone --depth 1 ${branch}$REPO ~/$REMOTE_DIR"
  else
    local archive="/tmp/$NAME-code.tar.gz"
    local root
    root="$(cd "$(dirname "$0")/.." && pwd)"
    if [[ "$DRY_RUN" == 1 ]]; then
      echo "git -C $root ls-files -z | tar -C $root --null -T - -czf $archive"
    else
      git -C "$root" ls-files -z | tar -C "$root" --null -T - -czf "$archive"
    fi
    run_cmd gcloud compute tpus tpu-vm scp "$archive" "$NAME:/tmp/" "${COMMON[@]}" --worker=all
    ssh_all "rm -rf ~/$REMOTE_DIR && mkdir -p ~/$REMOTE_DIR && tar -C ~/$REMOTE_DIR -xzf /tmp/$(basename "$archive")"
  fi
  ssh_all "cd ~/$REMOTE_DIR && python3 -m venv .venv && .venv/bin/pip install -q -U pip && .venv/bin/pip install -q -e \".[tpu]\""
}

train_command() {
  local cmd="cd ~/$REMOTE_DIR && .venv/bin/python -m ragen_jax.main --config=$CONFIG --config.mesh.distributed=on"
  local arg
  for arg in "${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}"; do
    cmd+=" $(printf '%q' "$arg")"
  done
  echo "$cmd"
}

do_run() {
  local cmd
  cmd="$(train_command)"
  if [[ "$FOREGROUND" == 1 ]]; then
    ssh_all "$cmd"
  else
    ssh_all "mkdir -p ~/$REMOTE_DIR/logs && ($cmd) > ~/$REMOTE_DIR/logs/train.log 2>&1 < /dev/null & disown"
  fi
}

do_logs() {
  run_cmd gcloud compute tpus tpu-vm ssh "$NAME" "${COMMON[@]}" "--worker=$LOG_WORKER" \
    --command="tail -n +1 -F ~/$REMOTE_DIR/logs/train.log"
}

do_delete() {
  run_cmd gcloud compute tpus tpu-vm delete "$NAME" "${COMMON[@]}" --quiet
}

do_all() {
  do_create
  if [[ "$KEEP" == 0 && "$DRY_RUN" == 0 ]]; then
    trap do_delete EXIT
  fi
  do_setup
  FOREGROUND=1
  do_run
  if [[ "$KEEP" == 0 && "$DRY_RUN" == 1 ]]; then
    do_delete
  fi
}

main() {
  [[ $# -ge 1 ]] || { usage; exit 2; }
  local sub="$1"
  shift
  case "$sub" in
    -h|--help) usage; exit 0 ;;
    create|setup|run|logs|delete|all) ;;
    *) die "unknown subcommand $sub (create | setup | run | logs | delete | all)" ;;
  esac
  parse_args "$@"
  common_flags
  case "$sub" in
    create) do_create ;;
    setup) do_setup ;;
    run) do_run ;;
    logs) do_logs ;;
    delete) do_delete ;;
    all) do_all ;;
  esac
}

main "$@"
