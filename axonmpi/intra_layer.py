"""AxoNN's import path ``axonn.intra_layer``: ``from axonmpi.intra_layer import auto_parallelize, Linear, ...``.

The same objects as :mod:`axonmpi.parallel.intra_layer` plus :func:`axonmpi.parallel.auto_parallelize`
(which AxoNN keeps in ``axonn.intra_layer``), so an AxoNN script ports by its imports:

    from axonn.intra_layer import auto_parallelize, sync_gradients   # AxoNN
    from axonmpi.intra_layer import auto_parallelize, sync_gradients # axonmpi
"""
from .parallel.auto_parallelize import auto_parallelize
from .parallel.intra_layer import (Embedding, Linear, clip_grad_norm_, no_grad_sync, optimize_communication,
                                   sync_gradients)

__all__ = ["Embedding", "Linear", "auto_parallelize", "clip_grad_norm_", "no_grad_sync", "optimize_communication",
           "sync_gradients"]
