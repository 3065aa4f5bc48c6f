#!/usr/bin/env bash
# Launch an axonmpi script on N local ranks with the MPI found on PATH (the venv's MPICH after `make install`).
#   jobs/local.sh -n 4 examples/train_gpt.py --steps 300
# axonmpi.init() gives each rank one BLAS/OpenMP thread when ranks share the machine (unless you set
# OMP_NUM_THREADS yourself).
# Layout flags pass through (jobs/local.sh -n 4 examples/train_gpt.py --G-inter 2 --G-intra-c 2), or come
# from the variables jobs/slurm_3d.sbatch reads (G_DATA G_INTER G_INTRA_R G_INTRA_C G_INTRA_D TP_STYLE
# SCHEDULE), checked against -n:   G_INTER=2 G_INTRA_C=2 jobs/local.sh -n 4 examples/train_gpt.py
set -euo pipefail
NP=4
if [[ "${1:-}" == "-n" ]]; then NP="$2"; shift 2; fi
if [[ $# -lt 1 ]]; then
  echo "usage: $0 [-n RANKS] SCRIPT.py [ARGS...]" >&2; exit 2
fi
if ! [[ "$NP" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: -n expects a number of ranks >= 1, got '$NP'" >&2; exit 2
fi
LAYOUT=()
if [[ -n "${G_DATA:-}${G_INTER:-}${G_INTRA_R:-}${G_INTRA_C:-}${G_INTRA_D:-}" ]]; then
  REST=$(( ${G_INTER:-1} * ${G_INTRA_R:-1} * ${G_INTRA_C:-1} * ${G_INTRA_D:-1} ))
  if (( NP % REST != 0 )); then
    echo "error: G_INTER*G_INTRA_R*G_INTRA_C*G_INTRA_D = $REST does not divide -n $NP" >&2; exit 2
  fi
  GD=${G_DATA:-$(( NP / REST ))}
  if (( GD * REST != NP )); then
    echo "error: G_DATA*G_INTER*G_INTRA_R*G_INTRA_C*G_INTRA_D = $(( GD * REST )) but -n $NP" >&2; exit 2
  fi
  LAYOUT=(--G-data "$GD" --G-inter "${G_INTER:-1}" --G-intra-r "${G_INTRA_R:-1}" --G-intra-c "${G_INTRA_C:-1}"
          --G-intra-d "${G_INTRA_D:-1}")
fi
[[ -n "${TP_STYLE:-}" ]] && LAYOUT+=(--tp-style "$TP_STYLE")
[[ -n "${SCHEDULE:-}" ]] && LAYOUT+=(--schedule "$SCHEDULE")
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python}"
MPIEXEC="${MPIEXEC:-mpiexec}"
command -v "$MPIEXEC" >/dev/null || { echo "error: $MPIEXEC not found; run 'make install' or load your MPI module" >&2; exit 127; }
exec "$MPIEXEC" -n "$NP" "$PY" "$@" ${LAYOUT[@]+"${LAYOUT[@]}"}
