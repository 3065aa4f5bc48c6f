"""A signal is never lost (issue 39 item 6): SIGUSR1/SIGTERM after ``import axonmpi`` is kept until init and acted
on; before the import, the job templates hold SIGUSR1 until every rank has imported axonmpi."""
import os
import signal
import subprocess
import sys
import time

import pytest

from axonmpi.testing import mpiexec_env, run_mpiexec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BETWEEN = """
import os, signal, sys, time
import axonmpi
from axonmpi.checkpoint import PreemptionHandler
sig = getattr(signal, sys.argv[1])
if int(os.environ.get("PMI_RANK", "0")) == 0:
    os.kill(os.getpid(), sig)              # after `import axonmpi`, before init: on main lost (exit 0)
    time.sleep(0.2)
w = axonmpi.init()
with PreemptionHandler() as pre:
    stop = pre.should_stop()
    print(f"rank {w.rank} should_stop {stop}", flush=True)
    if stop:
        pre.exit("saved nothing")
"""


@pytest.mark.serial
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGTERM"])
def test_a_signal_between_import_and_init_is_kept_and_acted_on(n, sig):
    r = run_mpiexec(["-c", BETWEEN, sig], n=n, timeout=120, env={"AXONMPI_EARLY_SIGNAL_GRACE": "60"})
    out = r.stdout + r.stderr
    assert r.returncode == 75, out                          # every rank stops and exits with the requeue code
    assert all(f"rank {k} should_stop True" in r.stdout for k in range(n)), out
    assert f"rank 0: {sig} arrived before axonmpi.init(); kept" in r.stderr, r.stderr


@pytest.mark.serial
def test_a_command_line_tool_keeps_the_default_action():
    """Outside a launcher nothing is recorded at import: `python -c 'import axonmpi'` still dies of SIGTERM."""
    code = "import os, signal, time, axonmpi; os.kill(os.getpid(), signal.SIGTERM); time.sleep(5); print('alive')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=mpiexec_env())
    assert r.returncode == -signal.SIGTERM and "alive" not in r.stdout, (r.returncode, r.stderr)


_LATE_RANK = """
import sys, time
open(sys.argv[1], "w").write("started")
time.sleep(2)                                # start-up before `import axonmpi`: the signal window
import axonmpi
from axonmpi.checkpoint import PreemptionHandler
axonmpi.init()
pre = PreemptionHandler()
while not pre.should_stop():
    time.sleep(0.01)
pre.exit("test rank")
"""


@pytest.mark.serial
def test_the_template_holds_usr1_until_every_rank_has_imported_axonmpi(slurm_env, tmp_path):
    """SIGUSR1 reaches the batch shell while the rank is still starting (before `import axonmpi`, where the
    default action would end it): the template holds it, forwards it once the rank is ready, the rank saves
    and exits 75 and the job is requeued."""
    bindir = tmp_path / "bin"
    (tmp_path / "rank.py").write_text(_LATE_RANK)
    (bindir / "srun").write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'rank.py'} {tmp_path / 'started'}\n")
    (bindir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'scontrol.txt'}\n")
    os.chmod(bindir / "scontrol", 0o755)
    env = slurm_env(SLURM_JOB_ID="4243", SLURM_NTASKS="1")
    p = subprocess.Popen(["bash", os.path.join(ROOT, "jobs", "slurm_ddp_1node.sbatch")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    deadline = time.monotonic() + 30
    while not (tmp_path / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    p.send_signal(signal.SIGUSR1)            # the rank has not imported axonmpi yet
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "SIGUSR1 before every rank has imported axonmpi: held until they have" in err, err
    assert "asking every rank to save and exit" in err and "requeueing job 4243" in err, err
    assert (tmp_path / "scontrol.txt").read_text().split() == ["requeue", "4243"]
    assert not [d for d in os.listdir(tmp_path / "axonmpi") if d.startswith(".ready-")]   # cleaned up


@pytest.mark.serial
def test_a_ready_folder_that_cannot_be_written_is_said(tmp_path, monkeypatch, capfd):
    """The template holds SIGUSR1 until every rank's file is there: a rank that cannot write its file says so
    (the signal would wait out AXONMPI_SIGNAL_HOLD_S) instead of staying silent."""
    from axonmpi.distributed import signals
    missing = tmp_path / "no-such-folder"
    monkeypatch.setenv("AXONMPI_READY_DIR", str(missing))
    monkeypatch.setenv("PMI_RANK", "3")
    signals.mark_ready()
    err = capfd.readouterr().err
    assert f"rank 3: could not write {missing}" in err and "AXONMPI_SIGNAL_HOLD_S" in err, err
    monkeypatch.setenv("AXONMPI_READY_DIR", str(tmp_path))
    signals.mark_ready()
    assert capfd.readouterr().err == ""
    assert [f for f in os.listdir(tmp_path) if f.startswith("rank-3.")]
