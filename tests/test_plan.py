"""The planner's cost model (axonmpi/plan.py) against hand-computed cases, and the plan/plot commands."""
import os
import subprocess
import sys

import pytest

from axonmpi.plan import Hardware, Layout, Model, candidate_layouts, estimate, linear_volumes, plan

# 2 blocks, width 4, sequence 2, batch 4, vocabulary 8: Linears (4,12) (4,4) (4,16) (16,4), 192 weights
# a block, 2*192 + (2*8 + 2)*4 = 456 in all
M = Model(layers=2, width=4, seq=2, global_batch=4, vocab=8, dtype_bytes=4)
HW = Hardware(bw_intra=1e3, bw_inter=1e2, flops=1e3, gpus_per_node=4)


@pytest.mark.serial
def test_linear_volumes_are_axonns_closed_forms():
    assert linear_volumes(8, 16, 4, 2, 2, 2) == {"col": 4 * 16 / 2, "row": 4 * 8 / 2, "depth": 2 * 8 * 16 / 4}
    assert linear_volumes(8, 16, 4, 1, 1, 1) == {"col": 0.0, "row": 0.0, "depth": 0.0}
    assert M.block_params == 192 and M.params == 456


@pytest.mark.serial
def test_row_split_by_hand():
    e = estimate(M, Layout(G_intra_r=2), HW)
    # t = 4 rows * 2 tokens = 8; row all-reduce of t*in per Linear: 8*(4+4+4+16) = 224 per block, 2 blocks
    assert e.volumes == {"col": 0.0, "row": 448.0, "depth": 0.0, "inter": 0.0, "data": 0.0}
    assert e.comm_times["row"] == pytest.approx(2 * 1 / 2 * 448 * 4 / 1e3)          # intra-node ring all-reduce
    # 6 P B S + 12 L B S^2 H = 21888 + 1536 flops on 2 ranks at 1e3 flop/s, no bubble
    assert e.compute_time == pytest.approx(23424 / 2e3)
    assert e.step_time == pytest.approx(23424 / 2e3 + 1.792)
    # 4 x (2*192 + 2*8*4)/2 weights x 4 bytes + activations 34 * t * H * L * 4 bytes
    assert e.memory_bytes == pytest.approx(4 * 224 * 4 + 34 * 8 * 4 * 2 * 4)


@pytest.mark.serial
def test_depth_data_and_pipeline_by_hand():
    e = estimate(M, Layout(G_intra_d=2), HW)
    assert e.volumes["depth"] == 2 * 2 * 192                     # gather + scatter of each weight, 2 blocks
    assert e.comm_times["depth"] == pytest.approx(0.5 * 768 * 4 / 1e3)
    e = estimate(M, Layout(G_data=2), HW)
    assert e.volumes["data"] == 2 * 192 + 2 * 8 * 4              # the whole gradient
    assert e.comm_times["data"] == pytest.approx(1.0 * 448 * 4 / 1e3)
    e = estimate(M, Layout(G_inter=2), HW, microbatches=2)
    assert e.volumes["inter"] == 2 * 8 * 4                       # activations forward + gradients back
    assert e.compute_time == pytest.approx(23424 / 2e3 * (2 + 2 - 1) / 2)   # bubble (m + p - 1) / m


@pytest.mark.serial
def test_placement_picks_the_bandwidth():
    # grid order col, row, depth, inter, data: 4 columns fill a node of 4, the data pairs span two nodes
    e = estimate(M, Layout(G_data=2, G_intra_c=4), HW)
    assert e.comm_times["col"] == pytest.approx(2 * 3 / 4 * e.volumes["col"] * 4 / 1e3)
    assert e.comm_times["data"] == pytest.approx(1.0 * e.volumes["data"] * 4 / 1e2)


@pytest.mark.serial
def test_candidates_follow_the_rules_and_plan_is_sorted():
    assert len(list(candidate_layouts(M, 4))) == 15 - 1          # G_inter = 4 > 2 blocks is left out
    small = Model(layers=2, width=4, seq=2, global_batch=2, vocab=8)
    got = set(candidate_layouts(small, 4))
    assert Layout(G_data=4) not in got and Layout(G_data=2, G_intra_d=2) not in got and len(got) == 11
    est = plan(M, 4, HW)
    assert [e.step_time for e in est] == sorted(e.step_time for e in est) and len(est) == 14
    assert len(plan(M, 4, HW, memory_limit=0)) == 0


def _cli(*args, **kw):
    from axonmpi.testing import mpiexec_env
    return subprocess.run([sys.executable, "-m", "axonmpi", *args], capture_output=True, text=True, timeout=60,
                          env=mpiexec_env(), **kw)


@pytest.mark.serial
def test_plan_and_plot_commands(tmp_path):
    r = _cli("plan", "--world", "4", "--layers", "8", "--width", "512", "--seq", "128", "--global-batch", "32",
             "--top", "3")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "step ms" in lines[1] and len(lines) == 5 and lines[2].split()[0] == "1"
    from axonmpi.testing import run_mpiexec
    r = run_mpiexec(["-m", "axonmpi", "plan", "--world", "2", "--layers", "2", "--width", "64", "--seq", "8",
                     "--global-batch", "4", "--measure"], n=2, timeout=60)
    assert r.returncode == 0 and r.stdout.count("(measured)") == 1, r.stderr
    m = tmp_path / "m.json"
    m.write_text('{"step": 1, "loss": 2.0, "tokens_per_s": 10}\n{"step": 2, "loss": 1.5, "tokens_per_s": 11}\n')
    r = _cli("plot", str(m), "-o", str(tmp_path / "m.png"))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert r.returncode == 1 and "needs matplotlib: pip install matplotlib" in r.stderr and "Traceback" not in r.stderr
    else:
        assert r.returncode == 0 and os.path.getsize(tmp_path / "m.png") > 0
    (tmp_path / "bad.json").write_text("not json\n")
    r = _cli("plot", str(tmp_path / "bad.json"))
    assert r.returncode == 1 and "bad.json:1: not a JSON line" in r.stderr


@pytest.mark.serial
def test_slurm_3d_gpu_binds_one_gpu_per_task_and_checks_the_sizes(tmp_path):
    """The GPU 3-D job: sizes checked against SLURM_NTASKS, `axonmpi info` and the plan first, one GPU per task."""
    from axonmpi.testing import mpiexec_env
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/sh\necho srun \"$@\"\n")
    os.chmod(fake / "srun", 0o755)
    env = mpiexec_env({"PATH": f"{fake}:{os.environ['PATH']}", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4(x2)",
                       "SLURM_JOB_NAME": "t", "SLURM_JOB_NODELIST": "n[1-2]", "AXONMPI_SCRATCH": str(tmp_path),
                       "AXONMPI_SITE": os.path.join(root, "jobs", "site.sh"), "G_INTER": "2", "G_INTRA_C": "2",
                       "PLAN_ARGS": "--layers 8 --width 512 --seq 128 --global-batch 32"})
    job = os.path.join(root, "jobs", "slurm_3d_gpu.sbatch")
    r = subprocess.run(["bash", job, "--steps", "10"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[1] == "srun --gpus-per-task=1 --gpu-bind=closest python -m axonmpi info --ranks", r.stdout
    assert out[2] == ("srun --gpus-per-task=1 --gpu-bind=closest python -m axonmpi plan --world 8 --gpus-per-node 4 "
                      "--measure --layers 8 --width 512 --seq 128 --global-batch 32"), r.stdout
    assert ("--G-data 2 --G-inter 2 --G-intra-r 1 --G-intra-c 2 --G-intra-d 1 --tp-style axonn --schedule 1f1b "
            "--steps 10") in out[3] and out[3].startswith("srun --gpus-per-task=1 --gpu-bind=closest"), r.stdout
    r = subprocess.run(["bash", job], capture_output=True, text=True, timeout=60, env={**env, "G_INTER": "3"})
    assert r.returncode == 2 and "= 6 does not divide SLURM_NTASKS=8" in r.stderr, r.stderr
    r = subprocess.run(["bash", job], capture_output=True, text=True, timeout=60,
                       env={**env, "G_INTER": "1", "G_INTRA_C": "8", "PLAN_ARGS": ""})
    assert r.returncode == 0 and "tensor group (8 ranks) does not divide the 4 tasks per node" in r.stderr, r.stderr
