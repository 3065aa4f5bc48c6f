# axonmpi preemption and requeue, sourced by every jobs/slurm_*.sbatch (docs/cluster.md "Preemption and requeue").
#
# The templates ask Slurm for `#SBATCH --signal=B:USR1@120` (SIGUSR1 to this batch shell 120 s before the
# time limit) and `#SBATCH --requeue`. axonmpi_run forwards SIGUSR1/SIGTERM to srun, which passes them to
# every rank; the training script saves at its next step and exits with code 75; axonmpi_run then requeues
# the job (`scontrol requeue`), and the requeued job continues with --auto-resume.
#
# The user-script contract (SCRIPT=my_train.py): the templates run
#     python "$SCRIPT" --checkpoint-dir DIR --auto-resume --no-progress [your arguments]
# so the script must accept those three flags (save into DIR; continue from its newest checkpoint when
# there is one, else start fresh; no \r progress bars), and, to lose nothing at a time limit, catch
# SIGUSR1/SIGTERM (axonmpi.checkpoint.PreemptionHandler), save and exit with code 75.

AXONMPI_PREEMPTED_EXIT=75   # = axonmpi.checkpoint.PREEMPTED_EXIT_CODE (EX_TEMPFAIL)

# axonmpi_check_script SCRIPT: refuse a script that does not take the flags the template passes.
axonmpi_check_script() {
  local script=$1 flag missing=()
  [[ -f "$script" ]] || { echo "error: SCRIPT=$script: no such file (submit from the folder that holds it, or give a full path)" >&2; exit 2; }
  for flag in --checkpoint-dir --auto-resume --no-progress; do
    grep -q -- "$flag" "$script" || missing+=("$flag")
  done
  if (( ${#missing[@]} )); then
    echo "error: SCRIPT=$script does not take ${missing[*]}, which this template passes (python SCRIPT --checkpoint-dir DIR --auto-resume --no-progress ...); add them (see examples/train_gpt.py and docs/cluster.md \"Preemption and requeue\")" >&2
    exit 2
  fi
  if ! grep -q -e PreemptionHandler -e SIGUSR1 "$script"; then
    echo "warning: SCRIPT=$script does not seem to catch SIGUSR1 (axonmpi.checkpoint.PreemptionHandler): at the time limit the work since its last checkpoint is lost" >&2
  fi
}

# axonmpi_run COMMAND...: run srun in the background, forward SIGUSR1/SIGTERM to it, requeue on exit 75.
axonmpi_run() {
  local pid rc
  "$@" &
  pid=$!
  trap 'echo "axonmpi: $(date +%T) SIGUSR1 (time limit or preemption near): asking every rank to save and exit" >&2; kill -USR1 '"$pid"' 2>/dev/null || true' USR1
  trap 'kill -TERM '"$pid"' 2>/dev/null || true' TERM
  while :; do
    rc=0; wait "$pid" || rc=$?
    kill -0 "$pid" 2>/dev/null || break   # still running: wait was cut short by a trapped signal
  done
  trap - USR1 TERM
  if (( rc == AXONMPI_PREEMPTED_EXIT )); then
    echo "axonmpi: $(date +%T) the ranks saved and exited with $rc: requeueing job ${SLURM_JOB_ID:-?}" >&2
    scontrol requeue "${SLURM_JOB_ID:?SLURM_JOB_ID is not set: not inside a Slurm job}"
    exit 0
  fi
  return "$rc"
}
