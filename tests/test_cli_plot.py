"""`axonmpi plot` without matplotlib: one error line saying how to install it (the `plot` extra), exit 1."""
import os
import subprocess
import sys

import pytest

from axonmpi.testing import mpiexec_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.serial
def test_plot_without_matplotlib_says_how_to_install_it(tmp_path):
    metrics = tmp_path / "m.json"
    metrics.write_text('{"step": 1, "loss": 2.0}\n')
    code = ("import sys; sys.modules['matplotlib'] = None\n"      # what an install without matplotlib sees
            "from axonmpi.cli import main\n"
            f"sys.exit(main(['plot', {str(metrics)!r}, '-o', {str(tmp_path / 'o.png')!r}]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=mpiexec_env())
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("error: axonmpi plot draws with matplotlib, which is not installed")
    assert "pip install 'axonmpi[plot]'" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "o.png").exists()


def test_the_plot_extra_is_declared():
    text = open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8").read()
    assert 'plot = ["matplotlib' in text
