# Sourced by the slurm/ job templates (sbatch runs a copy of the template, so they find this
# file through AAM_SLURM_DIR, default $SLURM_SUBMIT_DIR/slurm: submit from the repository root,
# or set AAM_SLURM_DIR). Settings are environment variables exported at submission
# (`AAM_TABLE=... sbatch slurm/pretrain_single.sh`); slurm/README.md lists them.

# Checks the binary, makes the job's node-local scratch folder (removed at the end) with a
# cubecl.toml pointing at a shared kernel cache when AAM_KERNEL_CACHE is set, and works there.
aam_init() {
  AAM_RS=${AAM_RS:-aam-rs}
  AAM_BACKEND=${AAM_BACKEND:-cuda}
  # Relative paths are the submission folder's (where a job starts): made absolute before the
  # job moves to its scratch folder. (A bare AAM_RS name is looked up on PATH.)
  local name
  for name in AAM_TABLE AAM_MATRIX AAM_TREE AAM_METADATA AAM_PRETRAINED AAM_MODEL AAM_OUT \
    AAM_OUTPUT AAM_KERNEL_CACHE; do
    case "${!name:-}" in "" | /*) ;; *) printf -v "$name" '%s/%s' "$PWD" "${!name}" ;; esac
  done
  case "$AAM_RS" in /*) ;; */*) AAM_RS="$PWD/$AAM_RS" ;; esac
  if ! command -v "$AAM_RS" >/dev/null 2>&1; then
    echo "aam-rs not found: put it on PATH or set AAM_RS=/path/to/aam-rs" >&2
    exit 1
  fi
  AAM_RS=$(command -v "$AAM_RS")
  JOB_SCRATCH="${AAM_SCRATCH:-${TMPDIR:-/tmp}}/aam-${SLURM_JOB_ID:-$$}"
  mkdir -p "$JOB_SCRATCH"
  trap 'rm -rf "$JOB_SCRATCH"' EXIT
  if [ -n "${AAM_KERNEL_CACHE:-}" ]; then
    # One compiled-kernel cache for every job on the same GPU model (docs/backends.md).
    mkdir -p "$AAM_KERNEL_CACHE"
    printf '[autotune]\ncache = { file = "%s" }\n' "$AAM_KERNEL_CACHE" > "$JOB_SCRATCH/cubecl.toml"
  fi
  cd "$JOB_SCRATCH"
  echo "job ${SLURM_JOB_ID:-none} (start $((${SLURM_RESTART_COUNT:-0} + 1))) on $(hostname): $AAM_RS, backend $AAM_BACKEND, $(date -Is)"
}

# Fails the job when a required setting is empty: aam_require AAM_TABLE AAM_OUT ...
aam_require() {
  local name
  for name in "$@"; do
    if [ -z "${!name:-}" ]; then
      echo "set $name (see slurm/README.md)" >&2
      exit 1
    fi
  done
}

# Copies an input from the shared filesystem to node-local scratch; prints the copy's path.
# With AAM_ALL_NODES=1 (pretrain_multi.sh) the copy is made on every node of the job (sbcast).
aam_stage() {
  if [ ! -f "$1" ]; then
    echo "input not found: $1" >&2
    exit 1
  fi
  # A folder each, so that two inputs of the same name do not overwrite each other.
  local dir
  dir=$(mktemp -d "$JOB_SCRATCH/input.XXXXXX")
  if [ "${AAM_ALL_NODES:-0}" = 1 ]; then
    $AAM_PER_NODE mkdir -p "$dir" >&2 && sbcast -f "$1" "$dir/$(basename "$1")" >&2 \
      && echo "$dir/$(basename "$1")"
  else
    cp "$1" "$dir/" && echo "$dir/$(basename "$1")"
  fi
}

# The UniFrac input of pretrain and train, staged: `--unifrac-matrix` from AAM_MATRIX, else
# `--tree` from AAM_TREE (the matrix is then computed in the job). Sets the array UNIFRAC_ARGS.
aam_unifrac_args() {
  if [ -n "${AAM_MATRIX:-}" ]; then
    UNIFRAC_ARGS=(--unifrac-matrix "$(aam_stage "$AAM_MATRIX")")
  else
    aam_require AAM_TREE
    UNIFRAC_ARGS=(--tree "$(aam_stage "$AAM_TREE")")
  fi
}

# The body of pretrain_single.sh and pretrain_node.sh: `aam-rs pretrain` on AAM_DEVICES
# (default: $1), step checkpoints, and --resume-from auto for the job's later starts.
aam_pretrain() {
  aam_require AAM_TABLE AAM_OUT
  aam_init
  local table
  table=$(aam_stage "$AAM_TABLE")
  aam_unifrac_args
  aam_gate
  # shellcheck disable=SC2086 # AAM_ARGS holds several flags
  aam_run pretrain --backend "$AAM_BACKEND" --devices "${AAM_DEVICES:-$1}" --table "$table" \
    "${UNIFRAC_ARGS[@]}" --output-dir "$AAM_OUT" --checkpoint-every-steps "${AAM_CHECKPOINT_EVERY:-500}" \
    --resume-from auto ${AAM_ARGS:-}
}

# The body of pretrain_multi.sh: one aam-rs process per task (srun; one task per node by
# default), each training on AAM_DEVICES (default: $1) of its node; the processes take their
# ranks and the rendezvous (the job's first node) from SLURM's variables, and sum through NCCL
# (CUDA) or burn-collective (the other backends). The scratch folder, the staged inputs and the
# GPU check are on every node, once.
aam_pretrain_multi() {
  aam_require AAM_TABLE AAM_OUT
  aam_init
  AAM_ALL_NODES=1
  # Once on each node, also when a node runs several tasks (one per GPU).
  AAM_PER_NODE="srun --nodes=$SLURM_JOB_NUM_NODES --ntasks=$SLURM_JOB_NUM_NODES --ntasks-per-node=1"
  $AAM_PER_NODE mkdir -p "$JOB_SCRATCH"
  trap '$AAM_PER_NODE rm -rf "$JOB_SCRATCH"' EXIT
  if [ -f "$JOB_SCRATCH/cubecl.toml" ]; then
    sbcast -f "$JOB_SCRATCH/cubecl.toml" "$JOB_SCRATCH/cubecl.toml"
  fi
  local table
  table=$(aam_stage "$AAM_TABLE")
  aam_unifrac_args
  AAM_GATE_LAUNCH="$AAM_PER_NODE" aam_gate
  # shellcheck disable=SC2086 # AAM_ARGS holds several flags
  AAM_LAUNCH="srun --kill-on-bad-exit=1" aam_run pretrain --backend "$AAM_BACKEND" \
    --devices "${AAM_DEVICES:-$1}" --table "$table" "${UNIFRAC_ARGS[@]}" --output-dir "$AAM_OUT" \
    --checkpoint-every-steps "${AAM_CHECKPOINT_EVERY:-500}" --resume-from auto ${AAM_ARGS:-}
}

# Stops the job before training when this node's GPU computes attention wrong (AAM_DIAGNOSE=0
# skips the check). AAM_GATE_LAUNCH runs the check on every node (srun).
aam_gate() {
  [ "${AAM_DIAGNOSE:-1}" = 0 ] && return 0
  # shellcheck disable=SC2086 # a launcher and its flags
  if ! ${AAM_GATE_LAUNCH:-} "$AAM_RS" diagnose attention --backend "$AAM_BACKEND" --quick; then
    echo "attention is computed wrong on $(hostname) (${AAM_BACKEND}): not training here" >&2
    exit 1
  fi
}

# Runs `aam-rs "$@"` (through AAM_LAUNCH, e.g. srun, when set). SLURM's warning before the time
# limit (#SBATCH --signal=B:USR1@...) and a SIGTERM reach aam-rs (srun forwards them to its
# tasks), which writes a checkpoint and exits with status 75. After the warning the job requeues
# itself, and its next start resumes (--resume-from auto); after a SIGTERM (scancel, preemption)
# it ends, and SLURM requeues it if the preemption says so.
aam_run() {
  local pid rc requeue=0
  # shellcheck disable=SC2086 # a launcher and its flags
  ${AAM_LAUNCH:-} "$AAM_RS" "$@" &
  pid=$!
  trap 'requeue=1; kill -USR1 "$pid" 2>/dev/null' USR1
  trap 'kill -TERM "$pid" 2>/dev/null' TERM
  while :; do
    wait "$pid" && rc=0 || rc=$?
    kill -0 "$pid" 2>/dev/null || break # wait returned for a signal: aam-rs still runs
  done
  trap - USR1 TERM
  if [ "$rc" = 75 ] && [ "$requeue" = 1 ] && [ -n "${SLURM_JOB_ID:-}" ]; then
    echo "checkpoint written before the time limit: requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
  fi
  return "$rc"
}
