"""Every jobs/slurm_*.sbatch under stub sbatch / srun / scontrol (tests/test_job_templates.py's stubs set the SLURM_*
variables a real allocation sets, from the template's #SBATCH lines, and honour --output and --open-mode): the
command lines srun gets, the per-experiment checkpoint folder (RUN_NAME), the log appended across a requeue, and
the requeue path (exit 75 -> scontrol requeue, the requeued job resumes its own folder)."""
import glob
import os
import re
import subprocess
import sys

import pytest

from axonmpi.testing import mpiexec_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "jobs", "slurm_*.sbatch")))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")

SBATCH = r'''#!PYTHON
"""Stub sbatch: runs the batch script at once, in the environment a Slurm allocation gives it."""
import os, re, subprocess, sys
args = sys.argv[1:]
path, rest = args[0], args[1:]
opts = {}
for line in open(path):
    m = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line)
    if m:
        opts[m.group(1)] = m.group(2) or ""
name = opts.get("job-name", os.path.basename(path))
job = os.environ.get("STUB_JOB_ID", "4242")
nodes = int(opts.get("nodes", "1"))
per_node = int(opts.get("ntasks-per-node", "0")) or None
ntasks = int(opts["ntasks"]) if "ntasks" in opts else nodes * (per_node or 1)
env = dict(os.environ, SLURM_JOB_ID=job, SLURM_JOBID=job, SLURM_JOB_NAME=name, SLURM_NNODES=str(nodes),
           SLURM_JOB_NUM_NODES=str(nodes), SLURM_NTASKS=str(ntasks), SLURM_NPROCS=str(ntasks),
           SLURM_NTASKS_PER_NODE=f"{per_node or ntasks // nodes}(x{nodes})" if nodes > 1 else str(per_node or ntasks),
           SLURM_CPUS_PER_TASK=opts.get("cpus-per-task", "1"), SLURM_JOB_NODELIST=f"n[1-{nodes}]" if nodes > 1 else "n1",
           SLURM_SUBMIT_DIR=os.getcwd(), SLURM_RESTART_COUNT=os.environ.get("STUB_RESTART", "0"),
           SLURM_JOB_PARTITION="stub")
out = opts.get("output", "slurm-%j.out").replace("%x", name).replace("%j", job)
mode = "a" if opts.get("open-mode") == "append" else "w"
with open(out, mode) as f:
    rc = subprocess.call(["bash", path, *rest], stdout=f, stderr=subprocess.STDOUT, env=env)
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(f"sbatch {path} -> {out} ({'append' if mode == 'a' else 'truncate'}) exit {rc}\n")
print(f"Submitted batch job {job}")
sys.exit(rc)
'''
SRUN = r'''#!/bin/bash
echo "srun $*" >> "$STUB_LOG"
echo "srun $*"
if [[ " $* " == *" --auto-resume "* ]]; then       # the training step: "saves" a checkpoint, exits as asked
  args=("$@")
  for i in "${!args[@]}"; do
    if [[ "${args[$i]}" == --checkpoint-dir ]]; then mkdir -p "${args[$((i+1))]}/step_1"; fi
  done
  if [[ -n "${STUB_SRUN_EXITS:-}" ]]; then           # one exit code per training step run: "3 0" fails, then works
    n=$(cat "$STUB_LOG.count" 2>/dev/null || echo 0); echo $((n + 1)) > "$STUB_LOG.count"
    codes=($STUB_SRUN_EXITS); exit "${codes[$n]:-0}"
  fi
  exit "${STUB_SRUN_EXIT:-0}"
fi
'''
SCONTROL = '#!/bin/bash\necho "scontrol $*" >> "$STUB_LOG"\n'


@pytest.fixture
def slurm(tmp_path):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, text in (("sbatch", SBATCH.replace("PYTHON", sys.executable)), ("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_ / name).write_text(text)
        os.chmod(bin_ / name, 0o755)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    log = tmp_path / "stub.log"

    def submit(template, *args, **env):
        log.write_text("")
        e = mpiexec_env({"PATH": f"{bin_}:{os.environ['PATH']}", "STUB_LOG": str(log), "SCRIPT": SCRIPT,
                         "AXONMPI_SCRATCH": str(scratch), "AXONMPI_SITE": os.path.join(ROOT, "jobs", "site.sh"),
                         **env})
        for k in [k for k in e if k.startswith("SLURM_")]:
            del e[k]
        r = subprocess.run(["sbatch", os.path.join(ROOT, "jobs", template), *args], capture_output=True, text=True,
                           timeout=120, env=e, cwd=str(tmp_path))
        return r, log.read_text()

    submit.tmp, submit.scratch = tmp_path, scratch
    return submit


def _train_line(log):
    lines = [ln for ln in log.splitlines() if ln.startswith("srun ") and "--auto-resume" in ln]
    assert len(lines) == 1, log
    return lines[0]


def _ckpt(line):
    return re.search(r"--checkpoint-dir (\S+)", line).group(1)


@pytest.mark.serial
@pytest.mark.parametrize("template", TEMPLATES)
def test_template_command_line_and_per_experiment_folder(slurm, template):
    text = open(os.path.join(ROOT, "jobs", template)).read()
    assert "#SBATCH --open-mode=append" in text and "${SLURM_JOB_NAME}\"" not in text
    r, log = slurm(template, "--steps", "7")
    assert r.returncode == 0, r.stdout + r.stderr + log
    line = _train_line(log)
    name = re.search(r"#SBATCH --job-name=(\S+)", text).group(1)
    ckpt = _ckpt(line)
    assert re.fullmatch(re.escape(str(slurm.scratch)) + rf"/axonmpi/{re.escape(name)}-[0-9a-f]{{8}}", ckpt), ckpt
    assert f"python {SCRIPT} --checkpoint-dir {ckpt} --auto-resume --no-progress" in line and line.endswith("--steps 7")
    out = (slurm.tmp / f"{name}-4242.out").read_text()
    assert f"new checkpoint folder {ckpt}" in out and "NEW run" in out, out
    assert f"new checkpoint folder {ckpt}" in open(os.path.join(ckpt, "slurm-4242.out")).read()  # a copy in the run
    r, log2 = slurm(template, "--steps", "8")                # a longer run of the same experiment: the same folder
    assert r.returncode == 0 and _ckpt(_train_line(log2)) == ckpt
    r, log3 = slurm(template, "--steps", "7")                # the same script and arguments: the same run, said so
    assert r.returncode == 0 and _ckpt(_train_line(log3)) == ckpt
    assert "holds a run" in (slurm.tmp / f"{name}-4242.out").read_text()
    r, log4 = slurm(template, "--steps", "7", RUN_NAME="ablation-a")
    assert r.returncode == 0 and _ckpt(_train_line(log4)) == f"{slurm.scratch}/axonmpi/ablation-a"
    r, _ = slurm(template, RUN_NAME="../escape")
    assert r.returncode == 2 and "RUN_NAME=../escape: one folder name" in (slurm.tmp / f"{name}-4242.out").read_text()
    r, log5 = slurm(template, "--steps", "7", SCRIPT_ARGS="--lr 1e-3")
    assert r.returncode == 0 and _ckpt(_train_line(log5)) != ckpt and "--lr 1e-3 --steps 7" in _train_line(log5)


@pytest.mark.serial
@pytest.mark.parametrize("template", TEMPLATES)
def test_requeue_path_appends_the_log_and_resumes_the_same_folder(slurm, template):
    name = re.search(r"#SBATCH --job-name=(\S+)", open(os.path.join(ROOT, "jobs", template)).read()).group(1)
    r, log = slurm(template, "--steps", "9", STUB_SRUN_EXIT="75")     # the ranks saved at SIGUSR1, exited 75
    assert r.returncode == 0, log
    assert "scontrol requeue 4242" in log, log
    first = _ckpt(_train_line(log))
    out = (slurm.tmp / f"{name}-4242.out").read_text()
    assert "requeueing job 4242" in out
    r, log = slurm(template, "--steps", "9", STUB_RESTART="1")         # Slurm starts the same job id again
    assert r.returncode == 0 and "scontrol" not in log
    assert _ckpt(_train_line(log)) == first and "(append)" in log
    out2 = (slurm.tmp / f"{name}-4242.out").read_text()
    assert out2.startswith(out) and "holds a run" in out2[len(out):], "the requeued job's log was truncated"
    r, log = slurm(template, "--steps", "9", STUB_SRUN_EXIT="3")       # a failure is not requeued
    assert r.returncode == 3 and "scontrol" not in log
    assert sum(1 for ln in log.splitlines() if ln.startswith("srun ") and "--auto-resume" in ln) == 3   # 2 restarts


@pytest.mark.serial
@pytest.mark.parametrize("template", ["slurm_ddp_1node.sbatch", "slurm_3d.sbatch"])
def test_a_failed_job_step_restarts_inside_the_allocation_up_to_a_limit(slurm, template):
    """Issue 53 item 3: the batch script reruns srun with --auto-resume (same folder) instead of ending the job."""
    name = re.search(r"#SBATCH --job-name=(\S+)", open(os.path.join(ROOT, "jobs", template)).read()).group(1)
    r, log = slurm(template, "--steps", "9", STUB_SRUN_EXITS="3 0")
    assert r.returncode == 0 and "scontrol" not in log, log
    runs = [ln for ln in log.splitlines() if ln.startswith("srun ") and "--auto-resume" in ln]
    assert len(runs) == 2 and _ckpt(runs[0]) == _ckpt(runs[1]), log     # the restart resumes the same run
    out = (slurm.tmp / f"{name}-4242.out").read_text()
    assert "the job step failed (exit 3): restart 1 of 2 inside allocation 4242 with --auto-resume" in out, out
    (slurm.tmp / "stub.log.count").unlink()
    r, log = slurm(template, "--steps", "9", STUB_SRUN_EXITS="3 0", AXONMPI_RESTARTS="0")
    assert r.returncode == 3 and len([ln for ln in log.splitlines() if "--auto-resume" in ln]) == 1


# One folder per experiment: what picks the layout or the precision is part of the run name (AXONMPI_EXPERIMENT_VARS)
SWEEPS = {
    "slurm_3d.sbatch": [{"G_INTER": "1"}, {"G_INTER": "2"}, {"G_INTRA_C": "2"}, {"TP_STYLE": "megatron"},
                        {"SCHEDULE": "gpipe"}],
    "slurm_3d_gpu.sbatch": [{"G_INTER": "1"}, {"G_INTER": "2"}, {"G_INTRA_C": "2"}],
    "slurm_fsdp.sbatch": [{"FSDP": "full_shard"}, {"FSDP": "shard_grad_op"}, {"MIXED_PRECISION": "fp16"},
                          {"CPU_OFFLOAD": "1"}],
}


@pytest.mark.serial
@pytest.mark.parametrize("template", sorted(SWEEPS))
def test_a_layout_sweep_gives_each_point_its_own_folder(slurm, template):
    name = re.search(r"#SBATCH --job-name=(\S+)", open(os.path.join(ROOT, "jobs", template)).read()).group(1)
    folders = []
    for point in SWEEPS[template]:
        r, log = slurm(template, "--steps", "5", **point)
        assert r.returncode == 0, r.stdout + r.stderr + log
        folders.append(_ckpt(_train_line(log)))
        out = (slurm.tmp / f"{name}-4242.out").read_text()
        assert f"new checkpoint folder {folders[-1]}" in out, (point, out)   # never --auto-resume of another point
        assert "=".join(next(iter(point.items()))) in out, f"the run name does not say {point} went into it"
    assert len(set(folders)) == len(folders), dict(zip(map(str, SWEEPS[template]), folders))
    r, log = slurm(template, "--steps", "5", **SWEEPS[template][1])         # the same point again: its own run
    assert _ckpt(_train_line(log)) == folders[1]
    assert "holds a run" in (slurm.tmp / f"{name}-4242.out").read_text()


@pytest.mark.serial
def test_run_name_leaves_out_steps_and_the_data_parallel_size(tmp_path):
    """--steps N and a --layout's dp=N (what grows with the node count) are not part of the run name; the task
    count is in no template's AXONMPI_EXPERIMENT_VARS; another learning rate is another run."""
    def name(*args, **env):
        cmd = 'source jobs/requeue.sh; axonmpi_run_name "$@" 2>/dev/null; echo "$RUN_NAME"'
        r = subprocess.run(["bash", "-c", cmd, "bash", "train.py", *args], capture_output=True, text=True, cwd=ROOT,
                           env=mpiexec_env({"AXONMPI_SCRATCH": str(tmp_path), "SLURM_JOB_NAME": "j", **env}),
                           timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()
    base = name("--steps", "5", "--layout", "tp=2,pp=2,dp=4", "--lr", "1e-3")
    assert base.startswith("j-") and len(base) == 10
    assert name("--steps", "10", "--layout", "tp=2,pp=2,dp=8", "--lr", "1e-3", SLURM_NTASKS="32") == base
    assert name("--steps=7", "--layout=tp=2,pp=2,dp=2", "--lr", "1e-3") == name("--layout=tp=2,pp=2", "--lr", "1e-3")
    assert name("--steps", "5", "--layout", "tp=2,pp=2,dp=4", "--lr", "2e-3") != base
    assert name("--steps", "5", "--layout", "tp=4,pp=1,dp=4", "--lr", "1e-3") != base
    for t in TEMPLATES:
        line = next(ln for ln in open(os.path.join(ROOT, "jobs", t)) if ln.startswith("AXONMPI_EXPERIMENT_VARS="))
        assert "NTASKS" not in line and "G_DATA" not in line, (t, line)
