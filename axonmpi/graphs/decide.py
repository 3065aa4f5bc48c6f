"""Whether a training step can be captured, and how: a static schedule, a CUDA graph on a GPU, or eager (and why)."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

__all__ = ["CaptureKind", "CaptureDecision", "decide_capture"]


class CaptureKind(enum.Enum):
    """How a compiled step runs after its warm-up."""

    STATIC = "static"            # CPU: the autograd bookkeeping recorded once, replayed (axonmpi.autograd.replay)
    CUDA_GRAPH = "cuda_graph"    # GPU: the step's kernels and NCCL calls captured into one CUDA graph
    EAGER = "eager"              # not captured: the reason says why


@dataclass(frozen=True)
class CaptureDecision:
    """A kind and, for ``EAGER``, the sentence that says why."""

    kind: CaptureKind
    reason: Optional[str] = None


def _pipeline_owner(fn: Callable) -> Any:
    owner = getattr(fn, "__self__", None)
    return owner if owner is not None and hasattr(owner, "pipeline") and hasattr(owner, "_stages") else None


def decide_capture(fn: Callable, *, device_type: str = "cpu", cuda_graph: bool = True,
                   collective_backends: Sequence[str] = (), cupy_graphs: bool = False,
                   host_scalars: Sequence[str] = ()) -> CaptureDecision:
    """Decide, before the first capture, how ``fn`` will run (pure logic: no device, no MPI).

    Args:
        fn: the step function (a pipelined model's ``pm.step`` is refused: its schedule needs the host between
            micro-batches).
        device_type: ``"cpu"`` (NumPy arrays) or ``"cuda"`` (CuPy arrays).
        cuda_graph: on a GPU, capture a CUDA graph (the caller vouches that the step reads no host value that
            changes per step); False: the static schedule, as on CPU (exact whatever the step reads).
        collective_backends: the backends of the groups the step's collectives use (``"mpi"``, ``"nccl"``); a
            CUDA graph can hold NCCL calls, never MPI ones.
        cupy_graphs: CuPy here can capture a stream (``cupy.cuda.Stream.begin_capture``, CuPy >= 10).
        host_scalars: what the step reads from the host each step and would bake into a CUDA graph (an
            optimizer's step count or learning rate when it is not ``capturable``); any refuses the graph.

    Returns:
        A :class:`CaptureDecision`.

    Example:
        >>> decide_capture(lambda: None).kind
        <CaptureKind.STATIC: 'static'>
        >>> decide_capture(lambda: None, device_type="cuda", collective_backends=["mpi"]).reason[:24]
        'collectives over MPI can'
    """
    if _pipeline_owner(fn) is not None:
        return CaptureDecision(CaptureKind.EAGER, "a pipeline schedule runs its micro-batches from the host (sends, "
                                                  "receives and stage order per action): the step runs eagerly")
    if device_type == "cpu":
        return CaptureDecision(CaptureKind.STATIC)
    if device_type != "cuda":
        raise ValueError(f"decide_capture: device_type must be 'cpu' or 'cuda', got {device_type!r}")
    if not cuda_graph:
        return CaptureDecision(CaptureKind.STATIC)
    if not cupy_graphs:
        return CaptureDecision(CaptureKind.EAGER, "this CuPy cannot capture a stream into a CUDA graph "
                                                  "(cupy.cuda.Stream.begin_capture needs CuPy >= 10)")
    mpi = [b for b in collective_backends if b != "nccl"]
    if mpi:
        return CaptureDecision(CaptureKind.EAGER, f"collectives over MPI cannot be captured into a CUDA graph "
                                                  f"(backends {sorted(set(mpi))}): init with NCCL "
                                                  "(axonmpi.init(device='cuda'))")
    if host_scalars:
        return CaptureDecision(CaptureKind.EAGER, "the step reads host values that change every step ("
                                                  + ", ".join(host_scalars) + "); a CUDA graph would replay the "
                                                  "captured ones: use a capturable optimizer (its step count and "
                                                  "learning rate on the device)")
    return CaptureDecision(CaptureKind.CUDA_GRAPH)
