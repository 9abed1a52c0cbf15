#!/usr/bin/env bash
# Train ragen_jax on several GPU hosts: one JAX process per host, all running the same program.
# Each process gets JAX_COORDINATOR_ADDRESS (host 0 : port), JAX_NUM_PROCESSES and JAX_PROCESS_ID, which
# ragen_jax.parallel.distributed.maybe_initialize passes to jax.distributed.initialize; the mesh then spans the
# GPUs of all hosts.
#
# SLURM (inside an allocation, e.g. `salloc -N 4 --gpus-per-node=8` or an sbatch script):
#   launch/gpu_multinode.sh slurm --config configs/sokoban.py -- --config.model.hf_path=/data/Qwen2.5-3B
# Plain ssh over a host list (the code and .venv at the same path on every host, passwordless ssh):
#   launch/gpu_multinode.sh ssh --hosts node1,node2 --dir /shared/ragen_jax --config configs/sokoban.py
#
# Flags: --config FILE  --port 12355  --python .venv/bin/python  --dir DIR (ssh: the checkout on the hosts;
#        default: this checkout's path)  --hosts h1,h2,... (ssh)  --nodes N (slurm; default: the
#        allocation's SLURM_JOB_NUM_NODES)  --dry-run (print the commands)  -- extra arguments for
#        python -m ragen_jax.main
# ssh mode prefixes each host's output with [host] and fails when any host fails.
set -euo pipefail

MODE=""
CONFIG="configs/sokoban.py"
PORT=12355
PYTHON=".venv/bin/python"
DIR="$(cd "$(dirname "$0")/.." && pwd)"
HOSTS=""
NODES=""
DRY_RUN=0
EXTRA_ARGS=()

usage() {
  sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
}

die() {
  echo "gpu_multinode.sh: $*" >&2
  exit 2
}

show() {
  local out="" arg
  for arg in "$@"; do
    if [[ "$arg" =~ ^[A-Za-z0-9_./:=@,+%-]+$ ]]; then
      out+="$arg "
    else
      out+="'${arg//\'/\'\\\'\'}' "
    fi
  done
  echo "${out% }"
}

parse_args() {
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --config) CONFIG="$2"; shift 2 ;;
      --port) PORT="$2"; shift 2 ;;
      --python) PYTHON="$2"; shift 2 ;;
      --dir) DIR="$2"; shift 2 ;;
      --hosts) HOSTS="$2"; shift 2 ;;
      --nodes) NODES="$2"; shift 2 ;;
      --dry-run) DRY_RUN=1; shift ;;
      -h|--help) usage; exit 0 ;;
      --) shift; EXTRA_ARGS=("$@"); break ;;
      *) die "unknown flag $1 (see --help)" ;;
    esac
  done
  [[ "$PORT" =~ ^[0-9]+$ ]] || die "--port takes a number, got $PORT"
}

# The training command (without the per-process environment), as one shell string.
train_command() {
  local cmd arg
  cmd="cd $(printf '%q' "$DIR") && $PYTHON -m ragen_jax.main --config=$CONFIG --config.mesh.distributed=on"
  for arg in "${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}"; do
    cmd+=" $(printf '%q' "$arg")"
  done
  echo "$cmd"
}

run_slurm() {
  [[ -n "${SLURM_JOB_ID:-}" || "$DRY_RUN" == 1 ]] || die "slurm mode runs inside an allocation (salloc / sbatch)"
  local nodes="${NODES:-${SLURM_JOB_NUM_NODES:-}}"
  [[ -n "$nodes" ]] || die "--nodes N is required outside an allocation"
  local head
  if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
    head="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
  else
    # shellcheck disable=SC2016  # dry run outside an allocation: each task's shell resolves the head node
    head='$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'
  fi
  # SLURM_PROCID is expanded by each task's own shell (single quotes keep it from this one).
  local per_task
  per_task="export JAX_COORDINATOR_ADDRESS=$head:$PORT JAX_NUM_PROCESSES=$nodes JAX_PROCESS_ID=\$SLURM_PROCID; $(train_command)"
  local cmd=(srun "--nodes=$nodes" --ntasks-per-node=1 bash -c "$per_task")
  if [[ "$DRY_RUN" == 1 ]]; then
    show "${cmd[@]}"
  else
    "${cmd[@]}"
  fi
}

run_ssh() {
  [[ -n "$HOSTS" ]] || die "ssh mode needs --hosts host1,host2,..."
  local hosts
  IFS=',' read -r -a hosts <<< "$HOSTS"
  local count="${#hosts[@]}"
  local coordinator="${hosts[0]}:$PORT"
  local pids=() i
  for i in "${!hosts[@]}"; do
    local host="${hosts[$i]}"
    local remote
    remote="export JAX_COORDINATOR_ADDRESS=$coordinator JAX_NUM_PROCESSES=$count JAX_PROCESS_ID=$i; $(train_command)"
    if [[ "$DRY_RUN" == 1 ]]; then
      show ssh "$host" "$remote"
    else
      # shellcheck disable=SC2029  # the command is built here on purpose: it carries this host's process id
      ssh "$host" "$remote" 2>&1 | sed "s/^/[$host] /" &
      pids+=("$!")
    fi
  done
  local failed=0 pid
  for pid in "${pids[@]+"${pids[@]}"}"; do
    wait "$pid" || failed=1
  done
  return "$failed"
}

main() {
  [[ $# -ge 1 ]] || { usage; exit 2; }
  MODE="$1"
  shift
  case "$MODE" in
    -h|--help) usage; exit 0 ;;
    slurm|ssh) ;;
    *) die "unknown mode $MODE (slurm | ssh)" ;;
  esac
  parse_args "$@"
  if [[ "$MODE" == slurm ]]; then
    run_slurm
  else
    run_ssh
  fi
}

main "$@"
