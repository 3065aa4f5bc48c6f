"""The GPU benches stop with a one-line reason (no traceback) where there is no GPU; the CPU bench still runs."""
import os
import subprocess
import sys

import pytest

from axonmpi.testing import mpiexec_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, **env):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=mpiexec_env({"AXONMPI_DISABLE_CUPY": "1", **env}))


@pytest.mark.serial
@pytest.mark.parametrize("args", [["bench/collectives.py", "--device", "cuda"], ["bench/gpu.py"],
                                  ["bench/gpu.py", "--worker"]])
def test_gpu_bench_without_a_gpu_is_a_clear_message(args):
    r = _run(args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert "GPU" in r.stderr or "CuPy" in r.stderr, r.stderr


@pytest.mark.serial
def test_collectives_bench_on_cpu_still_runs():
    r = _run(["bench/collectives.py", "--max-mib", "0", "--trials", "1", "--ops", "all_reduce"])
    assert r.returncode == 0, r.stderr
    assert "collectives vs raw mpi4py" in r.stdout


@pytest.mark.serial
def test_gpu_bench_mfu_uses_palm_flops_and_the_precision_peak():
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_gpu", os.path.join(ROOT, "bench", "gpu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    a = mod.parse(["--preset", "gpt2", "--precision", "bf16"])
    assert (a.n_layer, a.n_head, a.n_embd, a.block_size, a.vocab, a.batch) == (12, 12, 768, 1024, 50304, 8)
    assert mod.flops_per_token(124_000_000, a) == 6 * 124e6 + 12 * 12 * 768 * 1024
    assert mod.peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert mod.peak_flops("NVIDIA H100 80GB HBM3", "fp32") == 66.9e12
    assert mod.peak_flops("Tesla T4", "bf16") is None              # unknown GPU: MFU printed as nan
    assert mod.parse(["--n-layer", "2"]).n_layer == 2 and mod.parse([]).vocab == 96   # char preset by default
