"""examples/train_gpt.py's log, summary and progress bar: the loss shown is the step's loss (the global batch's
mean, the value --metrics-json records), a moving average only beside it and labelled; rank 0's bar shows
under mpiexec when the launcher's stderr is a terminal, and --progress / --no-progress force it."""
import json
import os
import pty
import re
import select
import subprocess

import pytest

from axonmpi.testing import mpiexec_env, mpiexec_path, run_mpiexec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")
TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--corpus-bytes", "60000",
        "--eval-batches", "1", "--no-save", "--sample-chars", "0"]
LINE = re.compile(r"step (\d+)/(\d+) loss ([0-9.]+) \(moving average ([0-9.]+)\)")
DONE = re.compile(r"train loss ([0-9.]+) \(last step's; moving average ([0-9.]+)\)")


@pytest.mark.serial
def test_log_and_summary_show_the_steps_loss_and_label_the_moving_average(tmp_path):
    metrics = tmp_path / "m.jsonl"
    r = run_mpiexec([SCRIPT, *TINY, "--steps", "4", "--global-batch", "4", "--no-progress", "--log-every", "1",
                     "--metrics-json", str(metrics)], n=2, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    logged = {int(m.group(1)): (float(m.group(3)), float(m.group(4))) for m in LINE.finditer(r.stderr)}
    assert sorted(logged) == [1, 2, 3, 4], r.stderr[-3000:]
    ema = None
    for row in rows:
        loss, avg = logged[row["step"]]
        ema = row["loss"] if ema is None else 0.9 * ema + 0.1 * row["loss"]
        assert loss == pytest.approx(row["loss"], abs=6e-5), (row, loss)      # the step's loss, not the average
        assert avg == pytest.approx(ema, abs=6e-5)
    assert abs(logged[4][0] - logged[4][1]) > 1e-4, "the test needs the step's loss and its average to differ"
    done = DONE.search(r.stderr)
    assert done, r.stderr[-2000:]
    assert float(done.group(1)) == pytest.approx(rows[-1]["loss"], abs=6e-5)
    assert float(done.group(2)) == pytest.approx(ema, abs=6e-5)


def _run_on_a_terminal(args, n, cwd):
    """mpiexec with its stderr on a pseudo-terminal (stdout a pipe); returns (exit code, what the terminal got)."""
    master, slave = pty.openpty()
    p = subprocess.Popen([mpiexec_path(), "-n", str(n), *args], stdout=subprocess.PIPE, stderr=slave,
                         stdin=subprocess.DEVNULL, env=mpiexec_env({"AXONMPI_PROGRESS": ""}), cwd=cwd)
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 300)
        if not ready:
            p.kill()
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:            # the slave side closed: every writer has exited
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    p.stdout.read()
    return p.wait(timeout=60), out.decode("utf-8", "replace")


@pytest.mark.serial
def test_rank0_bar_under_mpiexec_when_its_stderr_is_a_terminal(tmp_path):
    import sys
    base = [sys.executable, SCRIPT, *TINY, "--steps", "3", "--global-batch", "4"]
    code, term = _run_on_a_terminal(base, 2, str(tmp_path))
    assert code == 0, term[-3000:]
    assert "train:" in term and "3/3" in term and "loss_ema=" in term, term[-3000:]
    # the bar's fields (issue 52): step time, tokens/s averaged and this step's, peak RSS, the data position; the
    # elapsed time and ETA are tqdm's own (MFU and the GPU's memory only with a peak / on a GPU)
    for field in ("step_s=", "tok_s=", "now=", "rss=", "data=e0:"):
        assert field in term, (field, term[-3000:])
    assert term.count("train:   0%") == 1, "one bar: rank 0's"
    code, term = _run_on_a_terminal(base + ["--no-progress"], 2, str(tmp_path))
    assert code == 0 and "train:" not in term and "step 3/3 loss" in term, term[-3000:]


@pytest.mark.serial
def test_stderr_is_terminal_answers_for_a_pipe_and_obeys_the_override(monkeypatch):
    from axonmpi.log import stderr_is_terminal
    r = subprocess.run([__import__("sys").executable, "-c", "from axonmpi.log import stderr_is_terminal as t; "
                        "print(t())"], capture_output=True, text=True, env=mpiexec_env({"AXONMPI_PROGRESS": ""}))
    assert r.stdout.strip() == "False", r.stderr
    monkeypatch.setenv("AXONMPI_PROGRESS", "1")
    assert stderr_is_terminal() is True
    monkeypatch.setenv("AXONMPI_PROGRESS", "0")
    assert stderr_is_terminal() is False


def test_eval_batches_0_runs_no_held_out_forward(monkeypatch, tmp_path):
    """``--eval-batches 0``: no held-out batch runs and the summary says so (the layout walks of
    tests/test_train_layouts.py take their one step without it); ``--eval-batches 2`` runs two."""
    import sys
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_gpt
    calls, real = [], train_gpt.evaluate
    monkeypatch.setattr(train_gpt, "evaluate", lambda *a: calls.append(a[3]) or real(*a))
    monkeypatch.chdir(tmp_path)
    for n in (0, 2):
        train_gpt.main([*TINY, "--steps", "1", "--global-batch", "2", "--no-progress", "--corpus-bytes", "6000",
                        "--eval-batches", str(n)])
    assert calls == [2]
