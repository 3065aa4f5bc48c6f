"""The demo job, its resume path and the axonmpi command line, end to end at small sizes."""
import os
import subprocess
import sys

import numpy as np
import pytest

import axonmpi

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--corpus-bytes", "60000",
        "--eval-batches", "1", "--no-progress"]


@pytest.mark.mpi(min_size=1)
def test_train_gpt_trains_saves_and_resumes(world, tmp_path_factory, capsys):
    import train_gpt

    d = axonmpi.broadcast_object(str(tmp_path_factory.mktemp("gpt")) if world.rank == 0 else None)
    gb = 2 * world.world_size
    train_gpt.main(TINY + ["--steps", "4", "--global-batch", str(gb), "--checkpoint-dir", d, "--sample-chars", "5"])
    from axonmpi import checkpoint as ckpt

    mgr = ckpt.CheckpointManager(d)
    assert mgr.latest_step() == 4
    first = ckpt.load(mgr.latest())
    train_gpt.main(TINY + ["--steps", "6", "--global-batch", str(gb), "--checkpoint-dir", d, "--resume",
                           "--sample-chars", "0"])
    assert mgr.latest_step() == 6
    second = ckpt.load(mgr.latest())
    moved = [k for k in first["model"] if not np.array_equal(first["model"][k], second["model"][k])]
    assert moved, "resumed training did not change the weights"
    assert second["meta"]["step"] == 6
    if world.rank == 0:
        out = capsys.readouterr().out
        assert "---- sample ----" in out


@pytest.mark.serial
def test_train_gpt_help_and_bad_batch():
    from axonmpi.testing import mpiexec_env

    script = os.path.join(ROOT, "examples", "train_gpt.py")
    r = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60,
                       env=mpiexec_env())
    assert r.returncode == 0 and "--global-batch" in r.stdout and "--resume" in r.stdout
    from axonmpi.testing import run_mpiexec

    r = run_mpiexec([script, "--global-batch", "7", "--no-save"], n=2, timeout=60)
    assert r.returncode != 0 and r.stderr.count("--global-batch 7 must divide by the 2 ranks") == 1, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.serial
def test_cli_info_and_help():
    from axonmpi.testing import mpiexec_env

    r = subprocess.run([sys.executable, "-m", "axonmpi.cli", "info"], capture_output=True, text=True, timeout=60,
                       env=mpiexec_env())
    assert r.returncode == 0, r.stderr
    assert f"axonmpi      {axonmpi.__version__}" in r.stdout and "world        1 rank(s) on 1 node(s)" in r.stdout
    r = subprocess.run([sys.executable, "-m", "axonmpi.cli", "--help"], capture_output=True, text=True, timeout=60,
                       env=mpiexec_env())
    assert r.returncode == 0 and "info" in r.stdout and "run" in r.stdout


def _cli(*args, module="axonmpi", **kw):
    from axonmpi.testing import mpiexec_env
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=60,
                          env=mpiexec_env(), **kw)


@pytest.mark.serial
@pytest.mark.parametrize("module", ["axonmpi", "axonmpi.checkpoint"])
def test_cli_error_is_one_line_without_traceback(tmp_path, module):
    pre = ["ckpt"] if module == "axonmpi" else []
    r = _cli(*pre, "inspect", str(tmp_path / "missing"), module=module)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("error: "), r.stderr
    os.makedirs(tmp_path / "empty")
    r = _cli(*pre, "inspect", str(tmp_path / "empty"), module=module)   # on main: a traceback under `axonmpi`
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.startswith("error: "), r.stderr


@pytest.mark.serial
def test_cli_inspect_run_folder_and_closed_pipe(tmp_path):
    from axonmpi import checkpoint as ckpt
    from axonmpi.testing import mpiexec_env
    mgr = ckpt.CheckpointManager(tmp_path / "run", keep_last=None)
    for s in (5, 10):
        mgr.save(s, {"w": np.arange(4.0)})
    os.makedirs(tmp_path / "run" / "step-00000015.tmp-x")
    r = _cli("ckpt", "inspect", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    assert "2 complete checkpoint(s)" in r.stdout and "step-00000010" in r.stdout and "incomplete" in r.stdout
    # a closed pipe (| head) ends quietly: no BrokenPipeError traceback
    p = subprocess.Popen([sys.executable, "-m", "axonmpi", "ckpt", "inspect", str(mgr.path_for(10))],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=mpiexec_env())
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.serial
def test_cli_run_rejects_zero_ranks_and_python_m_works():
    r = _cli("run", "-n", "0", "x.py")
    assert r.returncode == 2 and "expected a whole number >= 1, got 0" in r.stderr
    r = _cli("--version")
    assert r.returncode == 0 and axonmpi.__version__ in r.stdout


@pytest.mark.serial
def test_cli_jobs_write(tmp_path):
    r = _cli("jobs", "write", str(tmp_path / "site"), "--examples")
    assert r.returncode == 0, r.stderr
    jobs = sorted(os.listdir(tmp_path / "site" / "jobs"))
    assert {"site.sh", "local.sh", "slurm_ddp_1node.sbatch", "slurm_ddp_multinode.sbatch", "slurm_3d.sbatch",
            "slurm_fsdp.sbatch", "slurm_3d_gpu.sbatch"} <= set(jobs)
    assert os.path.exists(tmp_path / "site" / "examples" / "train_gpt.py")
    r = _cli("jobs", "write", str(tmp_path / "site"))
    assert r.returncode == 1 and "exists (pass --force" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.serial
def test_slurm_templates_have_the_batch_essentials():
    for name in ("slurm_ddp_1node.sbatch", "slurm_ddp_multinode.sbatch", "slurm_3d.sbatch", "slurm_fsdp.sbatch",
                 "slurm_3d_gpu.sbatch"):
        text = open(os.path.join(ROOT, "jobs", name)).read()
        for needle in ("SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK", "--auto-resume", "--no-progress",
                       "$AXONMPI_SCRATCH", 'source "${AXONMPI_SITE:-jobs/site.sh}"'):
            assert needle in text, (name, needle)
        assert "module load" not in text and "activate" not in text  # edited once, in jobs/site.sh


@pytest.mark.serial
def test_train_gpt_no_tqdm_when_not_a_terminal(tmp_path):
    from axonmpi.testing import mpiexec_env
    script = os.path.join(ROOT, "examples", "train_gpt.py")
    r = subprocess.run([sys.executable, script, *TINY[:-1], "--steps", "4", "--global-batch", "2", "--no-save",
                        "--sample-chars", "0", "--log-every", "2"], capture_output=True, text=True, timeout=120,
                       env=mpiexec_env(), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stdout + r.stderr and "step 2/4 loss" in r.stderr and "step 4/4 loss" in r.stderr


@pytest.mark.serial
def test_train_mlp_data_parallel_matches_one_rank_and_shows_defaults():
    from axonmpi.testing import mpiexec_env, run_mpiexec
    script = os.path.join(ROOT, "examples", "train_mlp.py")
    args = [script, "--samples", "1200", "--epochs", "2", "--hidden", "16", "--batch-size", "32"]
    one = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, env=mpiexec_env())
    two = run_mpiexec(args, n=2, timeout=120)
    assert one.returncode == 0 and two.returncode == 0, (one.stderr, two.stderr)
    last = [[ln for ln in r.stdout.splitlines() if ln.startswith("epoch  2")] for r in (one, two)]
    assert len(last[1]) == 1 and last[0] == last[1], (one.stdout, two.stdout)   # same trajectory, printed once
    wide = mpiexec_env({"COLUMNS": "400"})
    h = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60, env=wide)
    assert "(default: 64)" in h.stdout and "(default: 0.6)" in h.stdout
    g = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), "--help"],
                       capture_output=True, text=True, timeout=60, env=wide)
    assert "(default: 300)" in g.stdout and "(default 300)" not in g.stdout


@pytest.mark.serial
def test_slurm_3d_checks_the_sizes_against_ntasks_and_passes_them(slurm_env):
    """The five sizes are variables checked against SLURM_NTASKS before srun; srun gets them as flags."""
    env = slurm_env(SLURM_NTASKS="8", G_INTER="2", G_INTRA_C="2")
    job = os.path.join(ROOT, "jobs", "slurm_3d.sbatch")
    r = subprocess.run(["bash", job, "--steps", "10"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert ("--G-data 2 --G-inter 2 --G-intra-r 1 --G-intra-c 2 --G-intra-d 1 --tp-style axonn --schedule 1f1b "
            "--steps 10") in r.stdout, r.stdout
    r = subprocess.run(["bash", job], capture_output=True, text=True, timeout=60, env={**env, "G_INTER": "3"})
    assert r.returncode == 2 and "= 6 does not divide SLURM_NTASKS=8" in r.stderr, r.stderr
    r = subprocess.run(["bash", job], capture_output=True, text=True, timeout=60, env={**env, "G_DATA": "3"})
    assert r.returncode == 2 and "= 12 but SLURM_NTASKS=8" in r.stderr, r.stderr


@pytest.mark.serial
def test_slurm_fsdp_passes_the_strategy_and_shards_hybrid_per_node(slurm_env):
    """FSDP options are variables; hybrid_shard's shard group defaults to the tasks of one node."""
    env = slurm_env(SLURM_NTASKS="8", SLURM_JOB_NUM_NODES="2")
    job = os.path.join(ROOT, "jobs", "slurm_fsdp.sbatch")

    def run(**kw):
        return subprocess.run(["bash", job, "--steps", "10"], capture_output=True, text=True, timeout=60,
                              env={**env, **kw})

    r = run()
    assert r.returncode == 0, r.stderr
    assert "srun python -m axonmpi info --ranks" in r.stdout, r.stdout
    assert "--fsdp full_shard --mixed-precision none --steps 10" in r.stdout, r.stdout
    r = run(FSDP="hybrid_shard", CPU_OFFLOAD="1", MIXED_PRECISION="fp16")
    assert r.returncode == 0, r.stderr
    assert "--fsdp hybrid_shard --mixed-precision fp16 --cpu-offload --hybrid-shard-size 4 --steps 10" in r.stdout
    r = run(FSDP="hybrid_shard", HYBRID_SHARD_SIZE="3")
    assert r.returncode == 2 and "HYBRID_SHARD_SIZE=3 does not divide SLURM_NTASKS=8" in r.stderr, r.stderr
    r = run(FSDP="zero4")
    assert r.returncode == 2 and "FSDP=zero4; expected" in r.stderr, r.stderr
    r = run(HYBRID_SHARD_SIZE="2")
    assert r.returncode == 2 and "needs FSDP=hybrid_shard" in r.stderr, r.stderr


@pytest.mark.serial
def test_local_sh_takes_the_layout_flags_and_variables(tmp_path):
    from axonmpi.testing import mpiexec_env
    env = mpiexec_env({"PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "PYTHON": sys.executable})
    job = os.path.join(ROOT, "jobs", "local.sh")
    common = ["-n", "2", os.path.join(ROOT, "examples", "train_gpt.py"), *TINY, "--steps", "1", "--global-batch", "2",
              "--no-save", "--sample-chars", "0"]
    r = subprocess.run(["bash", job, *common, "--G-inter", "2"], capture_output=True, text=True, timeout=120, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0 and "G_inter=2" in r.stderr, r.stderr[-2000:]
    r = subprocess.run(["bash", job, *common], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**env, "G_INTRA_C": "2", "TP_STYLE": "megatron"})
    assert r.returncode == 0 and "G_intra_c=2 G_intra_d=1 | tp-style megatron" in r.stderr, r.stderr[-2000:]
    r = subprocess.run(["bash", job, *common], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                       env={**env, "G_INTER": "3"})
    assert r.returncode == 2 and "= 3 does not divide -n 2" in r.stderr, r.stderr


@pytest.mark.serial
def test_train_gpt_progress_forces_rank0_bar_on_the_launchers_stderr(tmp_path):
    """--progress: one tqdm bar (rank 0) on mpiexec's stderr, a pipe; without it, log lines as before."""
    from axonmpi.testing import run_mpiexec

    script = os.path.join(ROOT, "examples", "train_gpt.py")
    base = [a for a in TINY if a != "--no-progress"] + ["--steps", "3", "--global-batch", "4", "--no-save",
                                                        "--sample-chars", "0"]
    r = run_mpiexec([script, *base, "--progress"], n=2, timeout=120, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "train: 100%" in r.stderr and "3/3" in r.stderr, r.stderr
    assert r.stderr.count("train:   0%") == 1 and "train:" not in r.stdout   # rank 0 only, on stderr
    r = run_mpiexec([script, *base], n=2, timeout=120, cwd=str(tmp_path))
    assert r.returncode == 0 and "train:" not in r.stderr + r.stdout, r.stderr
    r = run_mpiexec([script, *base, "--progress", "--no-progress"], n=1, timeout=60, cwd=str(tmp_path))
    assert r.returncode != 0 and "not allowed with argument" in r.stderr
