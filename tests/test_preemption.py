"""Preemption: SIGTERM/SIGUSR1 -> every rank stops at the same step, saves, exits 75; templates requeue on 75."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import axonmpi
from axonmpi import checkpoint as ckpt
from axonmpi.checkpoint import PREEMPTED_EXIT_CODE, PreemptionHandler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = os.path.join(ROOT, "examples", "train_gpt.py")
TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--corpus-bytes", "60000",
        "--eval-batches", "1", "--no-progress", "--sample-chars", "0", "--warmup", "2"]
TEMPLATES = ("slurm_ddp_1node.sbatch", "slurm_ddp_multinode.sbatch", "slurm_3d.sbatch", "slurm_fsdp.sbatch",
             "slurm_3d_gpu.sbatch", "slurm_gpu.sbatch")


def _descendants(pid):
    out = []
    for path in ("/proc/%d/task/%s/children" % (pid, t) for t in os.listdir(f"/proc/{pid}/task")):
        try:
            kids = [int(c) for c in open(path).read().split()]
        except OSError:
            continue
        for c in kids:
            out += [c] + _descendants(c)
    return out


def _ranks_of(proc, needle):
    """The pids of ``proc``'s descendants whose command line holds ``needle`` (the ranks under mpiexec)."""
    pids = []
    for p in _descendants(proc.pid):
        try:
            if needle in open(f"/proc/{p}/cmdline", "rb").read().decode(errors="replace"):
                pids.append(p)
        except OSError:
            pass
    return pids


def _rows(path):
    if not os.path.exists(path):
        return []
    return [json.loads(x)["step"] for x in open(path) if x.endswith("\n")]


@pytest.mark.mpi(min_size=1)
def test_all_ranks_stop_at_the_same_step_when_one_rank_is_signalled(world):
    stops = []
    with PreemptionHandler(("SIGUSR1", "SIGTERM")) as pre:
        for step in range(1, 8):
            if step == 3 and world.rank == world.world_size - 1:
                os.kill(os.getpid(), signal.SIGUSR1)     # only the last rank gets the signal
            if pre.should_stop():
                stops.append(step)
                break
        assert pre.signal_name == ("SIGUSR1" if world.rank == world.world_size - 1 else None)
    assert stops == [3]
    assert axonmpi.all_gather_object(stops) == [[3]] * world.world_size
    from axonmpi.distributed.signals import on_early_signal as _on_early_signal
    assert signal.getsignal(signal.SIGUSR1) is _on_early_signal   # close() restored init's recorder
    with PreemptionHandler() as pre, pytest.raises(SystemExit) as e:
        pre.exit("test")
    assert e.value.code == PREEMPTED_EXIT_CODE == 75


def test_bad_signal_names_the_value():
    with pytest.raises(ValueError, match="unknown signal 'SIGNOPE'"):
        PreemptionHandler(["SIGNOPE"])


@pytest.mark.serial
@pytest.mark.parametrize("which", ["one rank", "every rank"])
def test_train_gpt_saves_on_sigterm_exits_75_and_auto_resume_continues(tmp_path, which):
    """The issue's measurement: kill -TERM mid-run wrote nothing and the requeued job started at step 0."""
    from axonmpi.testing import mpiexec_env, mpiexec_path
    d, m = str(tmp_path / "ck"), str(tmp_path / "m.jsonl")
    args = [sys.executable, GPT, *TINY, "--global-batch", "4", "--checkpoint-dir", d, "--metrics-json", m,
            "--auto-resume"]
    p = subprocess.Popen([mpiexec_path(), "-n", "2", *args, "--steps", "100000"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=mpiexec_env(), cwd=tmp_path)
    deadline = time.monotonic() + 60
    while len(_rows(m)) < 20 and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.02)
    ranks = _ranks_of(p, "train_gpt.py")
    assert len(ranks) == 2, ranks
    for pid in (ranks[-1:] if which == "one rank" else ranks):
        os.kill(pid, signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == PREEMPTED_EXIT_CODE, out
    saved = ckpt.CheckpointManager(d).latest_step()
    assert saved is not None and saved >= 20, out
    assert _rows(m) == list(range(1, saved + 1))               # nothing trained after the save
    assert f"saved step {saved} of 100000" in out and "exiting with code 75" in out
    r = subprocess.run([mpiexec_path(), "-n", "2", *args, "--steps", str(saved + 3)], capture_output=True,
                       text=True, timeout=120, env=mpiexec_env(), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"--auto-resume: resumed from {d}/step-{saved:08d} at step {saved}" in r.stderr
    assert _rows(m) == list(range(1, saved + 4))


# -- job templates -------------------------------------------------------------------------------
@pytest.mark.serial
def test_every_template_asks_for_usr1_and_requeue_and_runs_through_axonmpi_run():
    for name in TEMPLATES:
        text = open(os.path.join(ROOT, "jobs", name)).read()
        for needle in ("#SBATCH --signal=B:USR1@120", "#SBATCH --requeue", "/requeue.sh", 'axonmpi_check_script "$SCRIPT"',
                       'axonmpi_run srun'):
            assert needle in text, (name, needle)
    assert "AXONMPI_PREEMPTED_EXIT=75" in open(os.path.join(ROOT, "jobs", "requeue.sh")).read()


_FAKE_RANK = """
import sys, time
import axonmpi
from axonmpi.checkpoint import PreemptionHandler
axonmpi.init()
pre = PreemptionHandler()
open(sys.argv[1], "w").write("ready")
while not pre.should_stop():
    time.sleep(0.01)
pre.exit("test rank")
"""


@pytest.mark.serial
def test_template_forwards_usr1_and_requeues_on_75(slurm_env, tmp_path):
    bindir = tmp_path / "bin"
    (tmp_path / "rank.py").write_text(_FAKE_RANK)
    # srun runs one "rank" that waits for the forwarded signal; scontrol records what it was asked
    (bindir / "srun").write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'rank.py'} {tmp_path / 'ready'}\n")
    (bindir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'scontrol.txt'}\n")
    os.chmod(bindir / "scontrol", 0o755)
    env = slurm_env(SLURM_JOB_ID="4242")
    p = subprocess.Popen(["bash", os.path.join(ROOT, "jobs", "slurm_ddp_1node.sbatch")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    deadline = time.monotonic() + 30
    while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    p.send_signal(signal.SIGUSR1)            # what --signal=B:USR1@120 does
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert (tmp_path / "scontrol.txt").read_text().split() == ["requeue", "4242"]
    assert "asking every rank to save and exit" in err and "requeueing job 4242" in err


_TEMPLATES = ["slurm_ddp_1node", "slurm_ddp_multinode", "slurm_gpu", "slurm_fsdp", "slurm_3d", "slurm_3d_gpu"]


def _template(slurm_env, tmp_path, name, args=(), **variables):
    """Run jobs/NAME.sbatch with an srun that prints each argument in [] and the layout it sees."""
    (tmp_path / "bin" / "srun").write_text(
        "#!/bin/bash\nprintf 'srun'; printf ' [%s]' \"$@\"; echo \" env=$AXONMPI_CHECKPOINT_DIR,${G_DATA:-},${FSDP:-}\"\n")
    env = slurm_env(SLURM_NTASKS="8", SLURM_JOB_NUM_NODES="2", **variables)
    return subprocess.run(["bash", os.path.join(ROOT, "jobs", name + ".sbatch"), *args], capture_output=True,
                          text=True, timeout=30, env=env, cwd=ROOT)


@pytest.mark.serial
@pytest.mark.parametrize("name", _TEMPLATES)
def test_template_passes_a_user_script_only_its_arguments(slurm_env, tmp_path, name):
    """SCRIPT_ARGS (shell quoting honoured, nothing executed) then the sbatch arguments; no template flags."""
    make = slurm_env
    slurm_env = lambda **kw: make(**{"RUN_NAME": "t", **kw})  # noqa: E731  the folder named below (RUN_NAME; its default: test_job_templates.py)
    mine = tmp_path / "my_train.py"
    mine.write_text("import argparse\np = argparse.ArgumentParser()\np.add_argument('--lr')\n")
    r = _template(slurm_env, tmp_path, name, ["--steps", "3"], SCRIPT=str(mine),
                  SCRIPT_ARGS=f"--lr 0.1 --name 'my run' $(touch {tmp_path}/ran)")
    assert r.returncode == 0, r.stderr
    last = r.stdout.splitlines()[-1]
    assert f"[python] [{mine}] [--lr] [0.1] [--name] [my run] [$(touch] [{tmp_path}/ran)] [--steps] [3] env=" in last
    assert "--checkpoint-dir" not in last and "--G-data" not in last and "--fsdp" not in last
    assert not (tmp_path / "ran").exists()
    ckpt = os.path.join(str(tmp_path), "axonmpi", "t")
    layout = {"slurm_3d": "8", "slurm_3d_gpu": "8"}.get(name, "")
    assert last.endswith(f" env={ckpt},{layout},{'full_shard' if name == 'slurm_fsdp' else ''}"), last
    assert "does not seem to catch SIGUSR1" in r.stderr


@pytest.mark.serial
@pytest.mark.parametrize("name", _TEMPLATES)
def test_template_flags_for_the_examples_and_on_request(slurm_env, tmp_path, name):
    make = slurm_env
    slurm_env = lambda **kw: make(**{"RUN_NAME": "t", **kw})  # noqa: E731  the folder named below (RUN_NAME; its default: test_job_templates.py)
    ckpt = os.path.join(str(tmp_path), "axonmpi", "t")
    r = _template(slurm_env, tmp_path, name)   # SCRIPT defaults to examples/train_gpt.py, which takes them
    assert r.returncode == 0, r.stderr
    assert f"[examples/train_gpt.py] [--checkpoint-dir] [{ckpt}] [--auto-resume] [--no-progress]" in r.stdout
    r = _template(slurm_env, tmp_path, name, SCRIPT="examples/train_mlp.py", SCRIPT_ARGS="--steps 2")
    assert r.returncode == 0 and r.stdout.splitlines()[-1].startswith(
        "srun") and "[examples/train_mlp.py] [--steps] [2] env=" in r.stdout, r.stdout + r.stderr
    r = _template(slurm_env, tmp_path, name, AXONMPI_TEMPLATE_FLAGS="0")
    assert r.returncode == 0 and "[examples/train_gpt.py] env=" in r.stdout, r.stdout
    mine = tmp_path / "my_train.py"
    mine.write_text("import argparse\nargparse.ArgumentParser().add_argument('--checkpoint-dir')\n")
    r = _template(slurm_env, tmp_path, name, SCRIPT=str(mine), AXONMPI_TEMPLATE_FLAGS="1")
    assert r.returncode == 2 and "does not take --auto-resume --no-progress, which AXONMPI_TEMPLATE_FLAGS=1" in r.stderr
    assert "my_train" not in r.stdout                                                    # nothing started
    mine.write_text("# --checkpoint-dir --auto-resume --no-progress PreemptionHandler\n")
    r = _template(slurm_env, tmp_path, name, ["--x"], SCRIPT=str(mine), AXONMPI_TEMPLATE_FLAGS="1",
                  SCRIPT_ARGS="--y")
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    assert f"[{mine}] [--checkpoint-dir] [{ckpt}] [--auto-resume] [--no-progress] " in r.stdout
    assert r.stdout.splitlines()[-1].split(" env=")[0].endswith("[--y] [--x]")
    r = _template(slurm_env, tmp_path, name, AXONMPI_TEMPLATE_FLAGS="yes")
    assert r.returncode == 2 and "AXONMPI_TEMPLATE_FLAGS=yes; expected 1" in r.stderr

@pytest.mark.mpi(min_size=2)
def test_a_signal_before_the_handler_exists_is_not_lost(world):
    """Issue 31 item 7: SIGUSR1 to one rank after init, before any PreemptionHandler: MPICH's C-level
    SIGUSR1 handler swallowed it; init now records it and the first handler acts on it."""
    if world.rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)                       # the Python-level handler runs in the main thread
    axonmpi.barrier()
    with PreemptionHandler() as pre:
        assert pre.should_stop() is True
        assert pre.signal_name == ("SIGUSR1" if world.rank == 1 else None)
    with PreemptionHandler() as pre:           # taken once: the next handler starts clean
        assert pre.should_stop() is False


@pytest.mark.serial
def test_an_early_sigterm_nobody_claims_still_ends_the_rank():
    from axonmpi.testing import mpiexec_env
    code = ("import os, signal, time, axonmpi; axonmpi.init(); os.kill(os.getpid(), signal.SIGTERM); "
            "time.sleep(30); print('still running')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=mpiexec_env({"AXONMPI_EARLY_SIGNAL_GRACE": "0.5"}))
    assert r.returncode == 143 and "still running" not in r.stdout, (r.returncode, r.stderr)
    assert "no PreemptionHandler was made within 0.5 s" in r.stderr, r.stderr
