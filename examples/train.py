"""The trainer under a model-neutral name: `examples/train.py` runs `examples/train_gpt.py` (GPT-2's shape, or
`--model llama`; `--init-from hf:DIR` picks the model from a Hugging Face directory), with the same flags:
`--data`, `--layout`, `--checkpoint-dir`, `--auto-resume`, `--no-progress` ... (`python examples/train.py --help`).
Preemption (SIGUSR1/SIGTERM) is caught by the trainer's checkpoint.PreemptionHandler, as under the old name.

    .venv/bin/mpiexec -n 4 .venv/bin/python examples/train.py --layout "tp=2,pp=2,dp=1" --steps 100
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import main  # noqa: E402

if __name__ == "__main__":
    main()
