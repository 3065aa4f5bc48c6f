#!/usr/bin/env bash
# Launch an axonmpi script on N local ranks with the MPI found on PATH (the venv's MPICH after `make install`).
#   jobs/local.sh -n 4 examples/train_gpt.py --steps 300
# axonmpi.init() gives each rank one BLAS/OpenMP thread when ranks share the machine (unless you set
# OMP_NUM_THREADS yourself).
set -euo pipefail
NP=4
if [[ "${1:-}" == "-n" ]]; then NP="$2"; shift 2; fi
if [[ $# -lt 1 ]]; then
  echo "usage: $0 [-n RANKS] SCRIPT.py [ARGS...]" >&2; exit 2
fi
if ! [[ "$NP" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: -n expects a number of ranks >= 1, got '$NP'" >&2; exit 2
fi
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python}"
MPIEXEC="${MPIEXEC:-mpiexec}"
command -v "$MPIEXEC" >/dev/null || { echo "error: $MPIEXEC not found; run 'make install' or load your MPI module" >&2; exit 127; }
exec "$MPIEXEC" -n "$NP" "$PY" "$@"
