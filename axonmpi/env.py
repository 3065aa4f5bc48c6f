"""Every AXONMPI_* environment variable, parsed and validated in one place (imports nothing from axonmpi)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Dict, Optional

__all__ = ["EnvVar", "VARIABLES", "EnvError", "get_bool", "get_tribool", "get_float", "get_log_level", "get_str", "get",
           "describe"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class EnvError(ValueError):
    """An environment variable holds a value that cannot be parsed; the message names it and the valid forms."""


@dataclass(frozen=True)
class EnvVar:
    """One documented variable: its name, kind (``bool``, ``float``, ``level``), default and meaning."""
    name: str
    kind: str
    default: str
    help: str


VARIABLES: Dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("AXONMPI_DEBUG", "bool", "0",
           "check before each collective that all ranks call it with the same shapes and dtypes"),
    EnvVar("AXONMPI_DEBUG_TIMEOUT", "float", "300",
           "seconds (> 0) before a collective some ranks never reach is reported (debug mode)"),
    EnvVar("AXONMPI_TIMEOUT", "float", "600",
           "seconds (> 0) any collective or point-to-point wait may last before the watchdog ends the job "
           "with a root-cause report (init(timeout=) sets it too)"),
    EnvVar("AXONMPI_EARLY_SIGNAL_GRACE", "float", "30",
           "seconds a SIGTERM recorded before any PreemptionHandler exists waits for one to be made; then the "
           "rank ends as SIGTERM would (exit 143)"),
    EnvVar("AXONMPI_WATCHDOG", "bool", "1",
           "0 turns the watchdog's deadlines off (no monitor thread, no hang report, no exit announcements)"),
    EnvVar("AXONMPI_FLIGHT_RECORDER", "bool", "1",
           "0 turns the flight recorder off (no call sites, no flight-record files); with AXONMPI_WATCHDOG=0 "
           "too, MPI calls go straight to mpi4py"),
    EnvVar("AXONMPI_CHECK_COLLECTIVES", "bool", "1",
           "0 turns off the always-on check that every rank of a group calls each collective with the same op, "
           "dtype, shape, root and all-to-all counts (needs the watchdog or the flight recorder on)"),
    EnvVar("AXONMPI_CHECK_EVERY", "float", "64",
           "calls between two exchanges of the always-on check (also at every barrier and at exit); 1 checks "
           "each call before it returns (about 8 us more per call)"),
    EnvVar("AXONMPI_READY_DIR", "str", "",
           "set by jobs/requeue.sh: each rank writes a file there once it catches SIGTERM/SIGUSR1 (at import "
           "axonmpi); the template holds SIGUSR1 until every rank has"),
    EnvVar("AXONMPI_WATCHDOG_POLLING", "bool", "0",
           "1 makes the watchdog poll non-blocking calls (the fallback used below MPI THREAD_MULTIPLE)"),
    EnvVar("AXONMPI_FLIGHT_RECORDER_SIZE", "float", "2000", "calls kept per rank in the flight recorder's ring buffer"),
    EnvVar("AXONMPI_FLIGHT_DIR", "str", "axonmpi-flight",
           "folder the flight records (flight_rank<r>.json) are written to when the watchdog fires"),
    EnvVar("AXONMPI_MEMORY_DIR", "str", "/dev/shm",
           "node-local folder of in-memory checkpoints (<dir>/axonmpi-<run key>/node<k>)"),
    EnvVar("AXONMPI_MEMORY_CHECKPOINT_EVERY", "str", "",
           "examples/train_gpt.py's default --memory-checkpoint-every (jobs/requeue.sh sets 1; empty or 0: off)"),
    EnvVar("AXONMPI_MEMORY_NODE_SIZE", "str", "",
           "k: in-memory checkpoints take ranks k*i .. k*i+k-1 as one node (tests); empty: the real nodes"),
    EnvVar("AXONMPI_TRACE", "str", "",
           "a folder: write a Chrome/Perfetto timeline per rank there (trace_rank<r>.json); empty: no trace"),
    EnvVar("AXONMPI_LOG_LEVEL", "level", "INFO", "level of axonmpi loggers: " + ", ".join(_LOG_LEVELS)),
    EnvVar("AXONMPI_DISABLE_CUPY", "bool", "0", "use NumPy even where CuPy and a GPU are present"),
    EnvVar("AXONMPI_KERNELS", "str", "",
           "host kernel path: numba (fused loops, pip install axonmpi[fast]) or numpy (ufuncs in place); unset: "
           "numba where it imports, else numpy"),
    EnvVar("AXONMPI_CUDA_AWARE", "tribool", "auto",
           "1/0: declare the MPI library CUDA-aware or not (CuPy buffers go to MPI directly, or are staged "
           "through pinned host memory); auto asks MPI (Query_cuda_support / MPIX_Query_cuda_support)"),
    EnvVar("AXONMPI_CUDA_AWARE_MPI", "tribool", "auto", "older name of AXONMPI_CUDA_AWARE (used when that is unset)"),
    EnvVar("AXONMPI_FAKE_NCCL", "bool", "0",
           "tests only: run the NCCL backend on the registered stand-in (axonmpi.testing.fake_nccl registers itself "
           "when imported: NCCL's API over MPI on host arrays)"),
    EnvVar("AXONMPI_MPI_FLOAT16", "bool", "1",
           "0 forces the float16 path for MPI libraries without a half type (moved as 16-bit words, reduced in float32)"),
    EnvVar("AXONMPI_NO_THREAD_LIMIT", "bool", "0",
           "keep the BLAS/OpenMP thread pools as they are when several ranks share a node"),
    EnvVar("AXONMPI_KEEP_FREED_MEMORY", "bool", "1",
           "init() lets glibc keep freed arrays up to 32 MiB in the heap (mallopt M_MMAP_THRESHOLD, M_TRIM_THRESHOLD) "
           "so each step reuses them without page faults; 0 keeps glibc's defaults"),
)}


def _raw(name: str) -> Optional[str]:
    if name not in VARIABLES:
        raise KeyError(f"{name} is not an axonmpi environment variable; known: {sorted(VARIABLES)}")
    v = os.environ.get(name)
    return None if v is None else v.strip()


def get_bool(name: str) -> bool:
    """``1/true/yes/on`` -> True, ``0/false/no/off/''`` -> False (any case); anything else raises :class:`EnvError`.

    Example:
        >>> os.environ["AXONMPI_DEBUG"] = "false"; get_bool("AXONMPI_DEBUG")
        False
    """
    v = _raw(name)
    v = VARIABLES[name].default if v is None else v
    if v.lower() in _TRUE:
        return True
    if v.lower() in _FALSE:
        return False
    raise EnvError(f"{name}={v!r} is not a boolean; expected one of 1/true/yes/on or 0/false/no/off")


def get_tribool(name: str) -> Optional[bool]:
    """Like :func:`get_bool`, but unset, empty or ``auto`` gives ``None`` (decide automatically).

    Example:
        >>> os.environ["AXONMPI_CUDA_AWARE"] = "auto"; get_tribool("AXONMPI_CUDA_AWARE") is None
        True
    """
    v = _raw(name)
    if v is None or v.lower() in ("", "auto"):
        return None
    if v.lower() in _TRUE:
        return True
    if v.lower() in _FALSE:
        return False
    raise EnvError(f"{name}={v!r} is not a boolean; expected one of 1/true/yes/on, 0/false/no/off or auto")


def get_float(name: str, *, positive: bool = True) -> float:
    """A number of seconds etc.; a unit suffix (``5s``) or a non-positive value raises :class:`EnvError`."""
    v = _raw(name)
    v = VARIABLES[name].default if v is None or v == "" else v
    try:
        x = float(v)
    except ValueError:
        raise EnvError(f"{name}={v!r} is not a number; expected a plain number such as "
                       f"{VARIABLES[name].default} (no unit)") from None
    if positive and not x > 0:
        raise EnvError(f"{name}={v!r} must be a number > 0")
    return x


def get_str(name: str) -> str:
    """The stripped string value (the default when unset)."""
    v = _raw(name)
    return VARIABLES[name].default if v is None else v


def get_log_level(name: str = "AXONMPI_LOG_LEVEL") -> str:
    """The upper-cased level name; unknown names raise :class:`EnvError` listing the valid ones."""
    v = _raw(name)
    v = VARIABLES[name].default if v is None or v == "" else v.upper()
    if v not in _LOG_LEVELS:
        raise EnvError(f"{name}={v!r} is not a log level; expected one of {', '.join(_LOG_LEVELS)}")
    return v


_READERS: Dict[str, Callable[[str], object]] = {"bool": get_bool, "tribool": get_tribool, "float": get_float,
                                                 "level": get_log_level, "str": get_str}


def get(name: str):
    """The parsed value of any variable in :data:`VARIABLES`."""
    if name not in VARIABLES:
        _raw(name)
    return _READERS[VARIABLES[name].kind](name)


def describe() -> str:
    """A Markdown table of every variable (README.md holds it; tests/test_env.py checks it)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    rows += [f"| `{v.name}` | `{v.default}` | {v.help} |" for v in VARIABLES.values()]
    return "\n".join(rows)
