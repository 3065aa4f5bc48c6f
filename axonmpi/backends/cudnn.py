"""``torch.backends.cudnn``: ``allow_tf32``, ``benchmark`` and ``deterministic`` are accepted and change nothing
(axonmpi runs no cuDNN kernel: its convolutions are GEMMs, whose precision :mod:`axonmpi.backends.cuda` sets)."""
from __future__ import annotations

__all__ = ["allow_tf32", "benchmark", "deterministic", "enabled", "is_available"]

allow_tf32 = True          # torch's default; read and written by scripts, used by nothing here
benchmark = False
deterministic = False
enabled = True


def is_available() -> bool:
    """False: axonmpi does not use cuDNN."""
    return False
