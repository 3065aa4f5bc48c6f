#!/usr/bin/env bash
# The GPU proof in one command on a GPU node: versions, the GPU tests at 1 rank and with several
# ranks sharing the GPUs, the NCCL collective bench and the GPT step bench (fp32, tf32, bf16, fp16).
#
#   bash bench/gpu_proof.sh [LOGDIR]            # logs and tables under LOGDIR (default gpu-proof-logs/)
#   STAGES="env tests bench" TEST_RANKS="1 2 4" PRECISIONS="fp32 bf16" bash bench/gpu_proof.sh
#   STAGES="... cpu_bench" adds the host-side bench on the node's CPU (bench/gpu.py --cpu, beside torch);
#   the bench stage also runs COMPILE_PRECISIONS (default bf16) with --compile (axonmpi.compile: a CUDA graph)
#   CPU_CHECKS=0 GPU_TESTS="tests/test_gpu_parity.py ..." narrow the tests stage when device time is short
#
# Without .venv (a node with no registry), WHEELS=DIR installs mpi4py, mpich and pytest-mpi from wheels
# into a venv that sees the system's CuPy, NumPy and h5py. Each stage has a time limit, so one stuck
# stage cannot eat the rest; the last lines printed are the summary.
set -u
cd "$(dirname "$0")/.."
LOG=${1:-gpu-proof-logs}
mkdir -p "$LOG"
STAGES=${STAGES:-"env tests bench"}
TEST_RANKS=${TEST_RANKS:-"1 2 4"}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} AXONMPI_TEST_TIMEOUT=${AXONMPI_TEST_TIMEOUT:-120}
summary=()
note() { summary+=("$*"); echo ">>> $*"; }

if [ -n "${WHEELS:-}" ]; then
  python3 -m venv --system-site-packages /tmp/axonmpi-venv >/dev/null
  /tmp/axonmpi-venv/bin/python -m pip install -q --no-index --no-deps "$WHEELS"/*.whl || exit 1
  PY=/tmp/axonmpi-venv/bin/python; MPIEXEC=/tmp/axonmpi-venv/bin/mpiexec
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  PY=${PY:-.venv/bin/python}; MPIEXEC=${MPIEXEC:-.venv/bin/mpiexec}
fi
# CuPy finds NCCL from the nvidia-nccl wheel through the loader path
nccl_lib=$($PY -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
[ -n "$nccl_lib" ] && export LD_LIBRARY_PATH=$nccl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

stage() { case " $STAGES " in *" $1 "*) return 0;; esac; return 1; }

if stage env; then
  { nvidia-smi; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    $PY -c "import cupy; cupy.show_config()"
    $PY -m axonmpi info; } > "$LOG/env.txt" 2>&1
  note "env: $($PY - <<'EOF' 2>&1 | tail -1
import cupy as cp
from axonmpi.distributed.backends import nccl_version
from mpi4py import MPI
d = cp.cuda.runtime.getDeviceProperties(0)
print(f"{d['name'].decode()}, driver {cp.cuda.runtime.driverGetVersion()}, CUDA runtime "
      f"{cp.cuda.runtime.runtimeGetVersion()}, CuPy {cp.__version__}, NCCL {nccl_version()}, "
      f"{MPI.Get_library_version().splitlines()[0].strip()}")
EOF
)"
fi

if stage tests; then
  if [ "${CPU_CHECKS:-1}" = 1 ]; then     # CPU_CHECKS=0: they also run in make test-gpu / make test on the CPU
    timeout 300 $MPIEXEC -n 1 $PY -m pytest --with-mpi -p no:cacheprovider -q -rs \
      tests/test_cupy_api.py tests/test_nccl_fake.py > "$LOG/cpu_checks.txt" 2>&1
    note "cpu checks of the GPU code: exit $? ($(tail -1 "$LOG/cpu_checks.txt"))"
  fi
  for n in $TEST_RANKS; do
    rm -rf .test-logs
    timeout ${TEST_LIMIT:-300} $MPIEXEC -n "$n" $PY -m pytest --with-mpi -m gpu -p no:cacheprovider -q -rs \
      --durations=15 ${GPU_TESTS:-tests/} > "$LOG/gpu_tests_np$n.txt" 2>&1
    rc=$?
    for f in .test-logs/np$n-rank*.log; do [ -f "$f" ] && cp "$f" "$LOG/"; done
    note "gpu tests on $n rank(s) sharing the GPU(s): exit $rc ($(grep -E 'passed|failed|error|skipped' "$LOG/gpu_tests_np$n.txt" | tail -1))"
  done
fi

if stage bench; then
  timeout ${COLL_LIMIT:-90} $MPIEXEC -n 1 $PY bench/collectives.py --device cuda > "$LOG/bench_collectives.txt" 2>&1
  note "bench/collectives.py --device cuda: exit $?"
  cat "$LOG/bench_collectives.txt"
  for prec in ${PRECISIONS:-fp32 tf32 bf16 fp16}; do
    timeout ${BENCH_LIMIT:-150} $PY bench/gpu.py --ranks 1 --preset gpt2 --precision "$prec" --steps 10 --warmup 3 \
      --profile "$LOG/profile_gpt2_$prec.txt" > "$LOG/bench_gpt2_$prec.txt" 2>&1
    note "bench/gpu.py gpt2 $prec: exit $? $(grep -E '^ +1 ' "$LOG/bench_gpt2_$prec.txt" | head -1)"
    cat "$LOG/bench_gpt2_$prec.txt"
  done
  # the same step captured (axonmpi.compile: a CUDA graph where it can be, else eager with the reason printed)
  for prec in ${COMPILE_PRECISIONS:-bf16}; do
    timeout ${BENCH_LIMIT:-150} $PY bench/gpu.py --ranks 1 --preset gpt2 --precision "$prec" --steps 10 --warmup 3 \
      --compile > "$LOG/bench_gpt2_${prec}_compile.txt" 2>&1
    note "bench/gpu.py gpt2 $prec --compile: exit $? $(grep -E '^ +1 |COMPILE' "$LOG/bench_gpt2_${prec}_compile.txt" | tr '\n' ' ')"
    cat "$LOG/bench_gpt2_${prec}_compile.txt"
  done
fi
if stage cpu_bench; then      # the host side on this node's CPU, beside torch (no GPU used)
  timeout ${BENCH_LIMIT:-150} $PY bench/gpu.py --cpu --preset overhead --steps 20 > "$LOG/bench_cpu_overhead.txt" 2>&1
  note "bench/gpu.py --cpu --preset overhead: exit $?"
  cat "$LOG/bench_cpu_overhead.txt"
fi
echo "=================== summary"
printf '%s\n' "${summary[@]}"
