# axonmpi preemption and requeue, sourced by every jobs/slurm_*.sbatch (docs/cluster.md "Preemption and requeue").
#
# The templates ask Slurm for `#SBATCH --signal=B:USR1@120` (SIGUSR1 to this batch shell 120 s before the
# time limit) and `#SBATCH --requeue`. axonmpi_run forwards SIGUSR1/SIGTERM to srun, which passes them to
# every rank; the training script saves at its next step and exits with code 75; axonmpi_run then requeues
# the job (`scontrol requeue`), and the requeued job continues with --auto-resume.
#
# The script contract (docs/cluster.md "What the templates pass to your script"): the templates run
#     python "$SCRIPT" [template flags] $SCRIPT_ARGS [arguments given to sbatch after the template]
# SCRIPT_ARGS (split as a shell would, quotes honoured, nothing executed) and the sbatch arguments are
# passed verbatim. The template flags (--checkpoint-dir DIR --auto-resume --no-progress, and the
# template's layout flags such as --G-data ... or --fsdp ...) are added only
#   - for the package's own examples that take them (examples/train_gpt.py), or
#   - when AXONMPI_TEMPLATE_FLAGS=1 (then the script must take the three resume flags: checked before
#     srun); AXONMPI_TEMPLATE_FLAGS=0 never adds them.
# Otherwise the script gets only what you pass it; the layout and the checkpoint folder are in the
# environment (AXONMPI_CHECKPOINT_DIR, G_DATA ...). To lose nothing at a time limit the script catches
# SIGUSR1/SIGTERM (axonmpi.checkpoint.PreemptionHandler), saves and exits with code 75.

AXONMPI_PREEMPTED_EXIT=75   # = axonmpi.checkpoint.PREEMPTED_EXIT_CODE (EX_TEMPFAIL)
AXONMPI_JOBS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
AXONMPI_RESUME_FLAGS=(--checkpoint-dir --auto-resume --no-progress)

# axonmpi_wants_flags SCRIPT: true when the template adds its flags to SCRIPT's command line.
axonmpi_wants_flags() {
  local script=$1 examples dir
  case "${AXONMPI_TEMPLATE_FLAGS:-}" in
    1) return 0 ;;
    0) return 1 ;;
    "") ;;
    *) echo "error: AXONMPI_TEMPLATE_FLAGS=$AXONMPI_TEMPLATE_FLAGS; expected 1 (add the template flags), 0 (never) or unset (only for the package's examples)" >&2
       exit 2 ;;
  esac
  examples=$(cd "$AXONMPI_JOBS_DIR/../examples" 2>/dev/null && pwd -P) || return 1
  dir=$(cd "$(dirname "$script")" && pwd -P)
  [[ "$dir" == "$examples" ]] && grep -q -- "--auto-resume" "$script"
}

# axonmpi_check_script SCRIPT: the file exists; with template flags, it takes the resume flags.
axonmpi_check_script() {
  local script=$1 flag missing=()
  [[ -f "$script" ]] || { echo "error: SCRIPT=$script: no such file (submit from the folder that holds it, or give a full path)" >&2; exit 2; }
  if axonmpi_wants_flags "$script"; then
    for flag in "${AXONMPI_RESUME_FLAGS[@]}"; do
      grep -q -- "$flag" "$script" || missing+=("$flag")
    done
    if (( ${#missing[@]} )); then
      echo "error: SCRIPT=$script does not take ${missing[*]}, which AXONMPI_TEMPLATE_FLAGS=1 passes (python SCRIPT --checkpoint-dir DIR --auto-resume --no-progress ...); add them (see examples/train_gpt.py and docs/cluster.md), or unset AXONMPI_TEMPLATE_FLAGS to pass only SCRIPT_ARGS" >&2
      exit 2
    fi
  fi
  if ! grep -q -e PreemptionHandler -e SIGUSR1 "$script"; then
    echo "warning: SCRIPT=$script does not seem to catch SIGUSR1 (axonmpi.checkpoint.PreemptionHandler): at the time limit the work since its last checkpoint is lost" >&2
  fi
}

# axonmpi_command SCRIPT [TEMPLATE FLAGS...] -- [ARGS...]: sets AXONMPI_CMD to
# (python SCRIPT [TEMPLATE FLAGS, when axonmpi_wants_flags] SCRIPT_ARGS... ARGS...).
axonmpi_command() {
  local script=$1 words=() flags=()
  shift
  while (( $# )) && [[ "$1" != -- ]]; do flags+=("$1"); shift; done
  (( $# )) && shift
  if [[ -n "${SCRIPT_ARGS:-}" ]]; then
    mapfile -d '' words < <(printf '%s' "$SCRIPT_ARGS" | xargs -r printf '%s\0') || {
      echo "error: SCRIPT_ARGS=$SCRIPT_ARGS: unbalanced quotes" >&2; exit 2; }
  fi
  AXONMPI_CMD=(python "$script")
  if axonmpi_wants_flags "$script"; then AXONMPI_CMD+=("${flags[@]}"); fi
  AXONMPI_CMD+=("${words[@]}")
  while (( $# )); do      # --spare-nodes K is the template's (SPARE_NODES), not the script's
    case "$1" in
      --spare-nodes) SPARE_NODES=${2:-}; shift 2 || shift ;;
      --spare-nodes=*) SPARE_NODES=${1#*=}; shift ;;
      *) AXONMPI_CMD+=("$1"); shift ;;
    esac
  done
}

# axonmpi_run_name SCRIPT [ARGS...]: sets and exports RUN_NAME, the experiment's name and so its run folder
# ($AXONMPI_SCRATCH/axonmpi/$RUN_NAME: checkpoints, train.log, metrics.jsonl and this job's Slurm output).
# Default: <job name>-<8 hex digits of the SHA-256 of the script's path, SCRIPT_ARGS, the arguments given to sbatch
# and NAME=value of every variable named in AXONMPI_EXPERIMENT_VARS>, leaving out what only says how long or how
# wide a run is: --steps N (a resubmission with more steps continues the run) and a --layout's dp=N (more nodes
# continue it too; checkpoints reshard on load). Each template names in AXONMPI_EXPERIMENT_VARS the variables that
# pick its layout and precision (G_INTER ..., FSDP, MIXED_PRECISION ...; not the task count), so a sweep (G_INTER=2
# then G_INTER=4, same script) gives each point its own folder, a requeued or resubmitted job (more steps, more
# nodes) resumes its own run, and --auto-resume never continues another experiment.
# RUN_NAME=name chooses it (resubmit with the same RUN_NAME to continue a run under changed arguments or layout).
# Its first line says which, what went into the name, and whether it resumes or starts a NEW run folder.
axonmpi_name_words() {   # AXONMPI_NAME_WORDS: the words minus --steps N / --steps=N, a --layout's dp=N removed
  local skip=0 layout=0 a
  AXONMPI_NAME_WORDS=()
  for a in "$@"; do
    if (( skip )); then skip=0; continue; fi
    if (( layout )); then a=$(printf '%s' "$a" | sed -E 's/(^|,)dp=[0-9]+//; s/^,//'); layout=0; fi
    case "$a" in
      --steps|--spare-nodes) skip=1; continue ;;
      --steps=*|--spare-nodes=*) continue ;;
      --layout) layout=1 ;;
      --layout=*) a=$(printf '%s' "$a" | sed -E 's/([=,])dp=[0-9]+,?/\1/; s/,$//') ;;
    esac
    AXONMPI_NAME_WORDS+=("$a")
  done
}
axonmpi_run_name() {
  local how key var vars=() words=()
  for var in ${AXONMPI_EXPERIMENT_VARS:-}; do vars+=("$var=${!var:-}"); done
  if [[ -n "${RUN_NAME:-}" ]]; then
    how="set by RUN_NAME"
  else
    if [[ -n "${SCRIPT_ARGS:-}" ]]; then
      mapfile -d '' words < <(printf '%s' "$SCRIPT_ARGS" | xargs -r printf '%s\0') || {
        echo "error: SCRIPT_ARGS=$SCRIPT_ARGS: unbalanced quotes" >&2; exit 2; }
    fi
    axonmpi_name_words "$@" "SCRIPT_ARGS" "${words[@]}"
    key=$(printf '%s\0' "${AXONMPI_NAME_WORDS[@]}" "${vars[@]}" | sha256sum | cut -c1-8)
    RUN_NAME="${SLURM_JOB_NAME:-axonmpi}-$key"
    how="job name + hash of the script, its arguments but --steps${vars[*]:+ and ${vars[*]}}; RUN_NAME=... to choose"
  fi
  case "$RUN_NAME" in
    */*|.|..|-*) echo "error: RUN_NAME=$RUN_NAME: one folder name (no '/', not '.', '..' or starting with '-')" >&2; exit 2 ;;
  esac
  export RUN_NAME
  local dir="$AXONMPI_SCRATCH/axonmpi/$RUN_NAME" others msg
  if [[ -d "$dir" ]] && [[ -n "$(ls -A "$dir" 2>/dev/null)" ]]; then
    msg="axonmpi: run $RUN_NAME ($how): $dir holds a run (this job requeued, or the same script, arguments and layout submitted again): --auto-resume continues it; set RUN_NAME=<new name> for a fresh experiment"
  else
    others=$(cd "$AXONMPI_SCRATCH/axonmpi" 2>/dev/null && ls -d "${SLURM_JOB_NAME:-axonmpi}"-* 2>/dev/null | grep -vx "$RUN_NAME" | tr '\n' ' ' || true)
    msg="axonmpi: NEW run $RUN_NAME ($how): new checkpoint folder $dir${others:+; to continue one of the other runs of this job name ($others) resubmit with RUN_NAME=<its name>}"
  fi
  if [[ -n "${SLURM_JOB_ID:-}" ]]; then     # this job's output into the run folder too (the submit folder keeps its copy)
    mkdir -p "$dir"
    exec > >(tee -a "$dir/slurm-$SLURM_JOB_ID.out")
    AXONMPI_TEE_PIDS=$!
    exec 2> >(tee -a "$dir/slurm-$SLURM_JOB_ID.out" >&2)       # stdout and stderr stay two streams
    AXONMPI_TEE_PIDS="$AXONMPI_TEE_PIDS $!"
    trap 'exec >&- 2>&-; wait $AXONMPI_TEE_PIDS 2>/dev/null || true' EXIT    # the copy is whole when the job ends
  fi
  echo "$msg" >&2
}

# axonmpi_run_once COMMAND...: run srun in the background, forward SIGUSR1/SIGTERM to it, requeue on exit 75.
# The signal window: a rank catches SIGUSR1 from `import axonmpi` on (it is kept for its PreemptionHandler);
# before that the default action would end it. So each rank writes a file into AXONMPI_READY_DIR once it
# catches signals, and a SIGUSR1 that comes before every rank has is held here and forwarded as soon as
# they all have (or after AXONMPI_SIGNAL_HOLD_S seconds, default 90, for a script that never imports axonmpi).
axonmpi_ready() {   # true when SLURM_NTASKS ranks have written their file
  local n
  n=$(find "$AXONMPI_READY_DIR" -maxdepth 1 -name 'rank-*' 2>/dev/null | wc -l)
  (( n >= ${SLURM_NTASKS:-${SLURM_NPROCS:-1}} ))
}
# axonmpi_run COMMAND...: axonmpi_run_once; a job step that fails (exit not 0 nor 75) while the command resumes
# (--auto-resume) is run again inside the allocation, up to AXONMPI_RESTARTS times (default 2; 0: never), each
# restart said with the failure's exit code; AXONMPI_RESTART (the restart's number) and AXONMPI_FAILED_AT (epoch
# seconds of the failure) are exported to it, so the script can say how long the restart took. Out of restarts,
# the failure is the job's exit code (no requeue: a failure that repeats would requeue for ever).
# In-memory checkpoints (docs/checkpoints.md): the training step keeps a copy of its state every
# AXONMPI_MEMORY_CHECKPOINT_EVERY steps (default here 1; 0 turns them off) in node memory under AXONMPI_MEMORY_DIR
# (default here /dev/shm/axonmpi-slurm-<job id>), sent to a buddy node, so a restart loses at most a step; the
# folder is removed on every node when the job gives up (a clean end removes it from the script).
# Spare nodes (SPARE_NODES=K, or --spare-nodes K after the template): ask sbatch for K nodes more than the run
# uses; each job step runs on the first N-K nodes Slurm reports healthy (sinfo), so a restart after a lost node
# takes a spare one. With too few healthy nodes left the job is requeued (scontrol requeue).
export AXONMPI_MEMORY_CHECKPOINT_EVERY=${AXONMPI_MEMORY_CHECKPOINT_EVERY:-1}
export AXONMPI_MEMORY_DIR=${AXONMPI_MEMORY_DIR:-/dev/shm/axonmpi-slurm-${SLURM_JOB_ID:-$$}}
axonmpi_pick_nodes() {   # sets AXONMPI_SRUN_NODES (srun options: N-K healthy nodes); false when too few are left
  local spare=${SPARE_NODES:-0} all=() healthy=() node st n per
  AXONMPI_SRUN_NODES=()
  [[ "$spare" =~ ^[0-9]+$ ]] || { echo "error: SPARE_NODES=$spare: expected a number of nodes >= 0" >&2; exit 2; }
  (( spare > 0 )) || return 0
  mapfile -t all < <(scontrol show hostnames "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set: not inside a Slurm job}")
  n=$(( ${#all[@]} - spare ))
  (( n >= 1 )) || { echo "error: SPARE_NODES=$spare leaves no node of the ${#all[@]} in the job (sbatch --nodes=N+$spare)" >&2; exit 2; }
  per=$(( ${SLURM_NTASKS:-${#all[@]}} / ${#all[@]} ))
  for node in "${all[@]}"; do
    st=$(sinfo -h -n "$node" -o %T 2>/dev/null | head -1)
    case "$st" in
      down*|drain*|fail*|*'*') echo "axonmpi: $(date +%T) node $node is ${st}: left out of the job step" >&2 ;;
      *) healthy+=("$node") ;;
    esac
  done
  (( ${#healthy[@]} >= n )) || return 1
  AXONMPI_SRUN_NODES=(--nodes="$n" --ntasks="$(( n * per ))" --nodelist="$(IFS=,; echo "${healthy[*]:0:$n}")")
  echo "axonmpi: $(date +%T) job step on ${AXONMPI_SRUN_NODES[2]#--nodelist=} ($n of ${#all[@]} nodes, $spare spare)" >&2
}
axonmpi_run() {
  local rc tries=0 max=${AXONMPI_RESTARTS:-2} cmd
  [[ " $* " == *" --auto-resume "* ]] || max=0      # a command that does not resume would start over
  while :; do
    rc=0
    if ! axonmpi_pick_nodes; then
      echo "axonmpi: $(date +%T) fewer than the job step's nodes are healthy (SPARE_NODES=${SPARE_NODES:-0} used up): requeueing job ${SLURM_JOB_ID:-?}" >&2
      scontrol requeue "${SLURM_JOB_ID:?SLURM_JOB_ID is not set: not inside a Slurm job}"
      exit 0
    fi
    cmd=("$@")
    [[ "${1:-}" == srun ]] && cmd=(srun "${AXONMPI_SRUN_NODES[@]}" "${@:2}")
    axonmpi_run_once "${cmd[@]}" || rc=$?
    (( rc == 0 )) && return 0
    if (( tries >= max )); then
      (( tries )) && echo "axonmpi: $(date +%T) the job step failed again (exit $rc) after $tries restart(s) inside the allocation (AXONMPI_RESTARTS=$max): giving up" >&2
      if [[ "${1:-}" == srun && "$AXONMPI_MEMORY_DIR" == */axonmpi-slurm-* ]]; then   # the memory copies go
        srun --ntasks-per-node=1 --nodes="${SLURM_JOB_NUM_NODES:-1}" rm -rf "$AXONMPI_MEMORY_DIR" || true
      fi
      return "$rc"
    fi
    tries=$((tries + 1))
    export AXONMPI_RESTART=$tries AXONMPI_FAILED_AT
    AXONMPI_FAILED_AT=$(date +%s.%N)
    echo "axonmpi: $(date +%T) the job step failed (exit $rc): restart $tries of $max inside allocation ${SLURM_JOB_ID:-?} with --auto-resume (AXONMPI_RESTARTS=0 turns this off)" >&2
  done
}

# axonmpi_run_once COMMAND...: run it (srun) once, forwarding signals; exit 75 requeues the job.
axonmpi_run_once() {
  local pid rc held=0 since=0
  export AXONMPI_READY_DIR="${AXONMPI_SCRATCH:-${TMPDIR:-/tmp}}/axonmpi/.ready-${SLURM_JOB_ID:-$$}-${SLURM_RESTART_COUNT:-0}"
  rm -rf "$AXONMPI_READY_DIR"; mkdir -p "$AXONMPI_READY_DIR"   # on the shared scratch: ranks on every node write here
  "$@" &
  pid=$!
  trap 'if axonmpi_ready; then echo "axonmpi: $(date +%T) SIGUSR1 (time limit or preemption near): asking every rank to save and exit" >&2; kill -USR1 '"$pid"' 2>/dev/null || true; else held=1; since=$SECONDS; echo "axonmpi: $(date +%T) SIGUSR1 before every rank has imported axonmpi: held until they have" >&2; fi' USR1
  trap 'kill -TERM '"$pid"' 2>/dev/null || true' TERM
  while :; do
    rc=0; wait "$pid" || rc=$?
    kill -0 "$pid" 2>/dev/null || break   # still running: wait was cut short by a trapped signal
    while (( held )) && kill -0 "$pid" 2>/dev/null; do
      if axonmpi_ready || (( SECONDS - since >= ${AXONMPI_SIGNAL_HOLD_S:-90} )); then
        echo "axonmpi: $(date +%T) SIGUSR1 (time limit or preemption near): asking every rank to save and exit" >&2
        kill -USR1 "$pid" 2>/dev/null || true
        held=0
      else
        sleep 0.5
      fi
    done
  done
  trap - USR1 TERM
  rm -rf "$AXONMPI_READY_DIR"
  if (( rc == AXONMPI_PREEMPTED_EXIT )); then
    echo "axonmpi: $(date +%T) the ranks saved and exited with $rc: requeueing job ${SLURM_JOB_ID:-?}" >&2
    scontrol requeue "${SLURM_JOB_ID:?SLURM_JOB_ID is not set: not inside a Slurm job}"
    exit 0
  fi
  return "$rc"
}
