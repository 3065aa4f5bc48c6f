"""The transforms :func:`~axonmpi.parallel.parallelize` composes, one module per axis, in its order.

``tensor`` (Megatron plan or AxoNN 3-D, and sequence parallelism), ``context``, ``experts``, ``checkpointing``,
``data`` (DDP / FSDP / ZeRO's groups) and ``pipeline`` (cuts the model, then runs the region, checkpointing and
data transforms on each stage).  Each takes the model (or a stage) and the :class:`Composition` record.
"""
from .record import Composition

__all__ = ["Composition"]
