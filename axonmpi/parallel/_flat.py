"""FlatParameter: many parameters packed into one flat buffer of views, sharded over a group.

[Note: flat layout and padded shards]
The parameters of a FlatParameter lie back to back, in the order given, in one contiguous
1-D buffer of ``n`` elements; each parameter's ``.data`` (and, once :meth:`bind_grads` ran,
its ``.grad``) is a reshaped view of its slice. Sharding over ``k`` ranks follows the
project's one uneven rule: rank ``i`` owns elements ``chunk_bounds(n, k, i)`` (the first
``n % k`` chunks one larger). Collectives move equal counts, so each chunk travels padded to
``S = ceil(n / k)``: the padded buffer is ``k`` slots of ``S`` with chunk ``i`` at the start
of slot ``i``. ``unshard`` all-gathers the slots into a ``k * S`` buffer and compacts it in
place (chunk ``i`` moves left by ``max(0, i - n % k)``), so the full buffer is its first
``n`` elements and needs no second allocation; gradient reduce-scatter does the inverse
expansion in place before the call. A buffer handed to a non-blocking call is referenced by
its :class:`Work` and not touched until it completes.

[Note: the originals' gradients are views of the chunk]
Once :meth:`reduce_grad` has put this rank's chunk of the reduced gradient in ``self.grad``, each original
parameter's ``.grad`` is a 1-D view of its elements in that chunk (possibly empty), as FSDP1's
``use_orig_params=True`` does (``_use_sharded_grad_views``).  So whatever a user does to ``p.grad`` in place (a
``GradScaler``'s ``unscale_``, ``p.grad.mul_(...)``, clipping) lands in the chunk the optimizer steps and
:func:`~axonmpi.optim.clip.clip_grad_norm_` reads, and each element is touched once.  The original still reports
its serial ``shape`` / ``dim()`` (param groups by rule); :meth:`piece` is the same view.  The views are dropped
(``.grad`` ``None``; the chunk keeps the sum) before the next backward can accumulate into the originals: on a
gather with autograd on (:meth:`unshard`), and in :meth:`bind_grads` / the packing of :meth:`reduce_grad`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .. import trace as _trace
from ..autograd import Tensor
from ..autograd.grad_mode import is_grad_enabled
from ..backend import as_device, device_of, get_array_module, to_device, to_host
from ..distributed import ReduceOp, Work, all_gather, broadcast, chunk_bounds, reduce_scatter, resolve_group
from ..distributed.placement import Cut, Placement, Shard, ShardKind
from ..distributed.sharding import FlatLayout, FlatSegment, compact_slots as _compact, expand_slots as _expand
from ..nn.parameter import Parameter

__all__ = ["FlatLayout", "FlatSegment", "FlatParameter", "broadcast_flat"]


class FlatParameter(Parameter):
    """Several parameters packed into one flat buffer; optionally sharded over a process group.

    At construction the parameters' values are copied into one contiguous 1-D buffer and each
    parameter's ``.data`` becomes a view of its slice, so the model keeps working unchanged.
    The FlatParameter itself is a :class:`Parameter` whose ``.data`` is that whole buffer or,
    after :meth:`shard`, this rank's chunk: build an optimizer on it and its state is sharded.

    Lifecycle (FSDP's): ``shard(group)`` keeps this rank's chunk and frees the full buffer;
    ``unshard()`` all-gathers it back (``async_op=True`` for prefetch; ``dtype=`` for a
    low-precision compute copy; ``device=`` to gather on the compute device while
    ``move_shard("cpu")`` keeps the chunk on the host); ``reshard()`` frees it again. Gradients: ``bind_grads()``
    makes every parameter's ``.grad`` a view of one flat gradient buffer (backward then
    accumulates straight into it), ``reduce_grad()`` reduce-scatters it into ``self.grad``
    (this rank's chunk, accumulated across calls) and frees the full gradient.

    Args:
        params: leaf Tensors of one dtype and device, each listed once.
        names: their names (default ``"0"``, ``"1"``, ...), used in messages and segments.
        requires_grad: whether the flat (sharded) parameter is trainable.

    Attributes:
        params, names, layout (:class:`FlatLayout`), total_numel (``n``), group (after shard),
        world_size (``k``), rank, shard_range (``(start, stop)`` of this rank's chunk),
        padded_size (``S = ceil(n / k)``).

    Example:
        >>> lin = nn.Linear(3, 2)
        >>> flat = FlatParameter([lin.weight, lin.bias], ["weight", "bias"]).shard()
        >>> flat.unshard()              # lin.weight / lin.bias are views of the gathered buffer
        >>> y = lin(x); y.sum().backward()
        >>> flat.reduce_grad()          # flat.grad: the averaged gradient of my chunk
        >>> flat.reshard()
    """

    def __init__(self, params: Sequence[Tensor], names: Optional[Sequence[str]] = None, *,
                 requires_grad: bool = True):
        params = list(params)
        if not params:
            raise ValueError("FlatParameter needs at least one parameter, got none")
        names = [str(i) for i in range(len(params))] if names is None else [str(n) for n in names]
        if len(names) != len(params):
            raise ValueError(f"FlatParameter got {len(params)} parameters but {len(names)} names")
        seen = {}
        for nm, p in zip(names, params):
            if not isinstance(p, Tensor):
                raise TypeError(f"FlatParameter: {nm!r} is a {type(p).__name__}, expected a Tensor")
            if p.grad_fn is not None:
                raise ValueError(f"FlatParameter: {nm!r} is not a leaf tensor (it has grad_fn)")
            if isinstance(p, FlatParameter):
                raise TypeError(f"FlatParameter: {nm!r} is already a FlatParameter (nesting is not supported)")
            if id(p) in seen:
                raise ValueError(f"FlatParameter: {nm!r} and {seen[id(p)]!r} are the same tensor; list it once")
            seen[id(p)] = nm
        first = params[0].data
        xp = get_array_module(first)
        for nm, p in zip(names, params):
            if p.data.dtype != first.dtype or get_array_module(p.data) is not xp:
                raise TypeError(
                    f"FlatParameter: parameters must share one dtype and array module; {names[0]!r} is "
                    f"{first.dtype} ({xp.__name__}) but {nm!r} is {p.data.dtype} "
                    f"({get_array_module(p.data).__name__})")
        layout = FlatLayout([p.data.shape for p in params])
        flat = layout.pack([p.data for p in params], xp.empty(layout.numel, first.dtype))
        super().__init__(flat, requires_grad=requires_grad)
        self.params: List[Tensor] = params
        self.names: List[str] = names
        self.layout = layout
        self.total_numel = layout.numel
        self.group = None
        self.world_size, self.rank = 1, 0
        self.shard_range = (0, layout.numel)
        self.padded_size = layout.numel
        self._shard = None          # padded chunk buffer (S elements) once sharded
        self._full = flat           # the full flat buffer (n elements) while unsharded
        self._full_grad = None      # the flat gradient buffer behind the params' .grad views
        self._grad_views: List[Any] = []
        self._piece_grads: List[Any] = []    # the originals' .grad while they view the chunk's gradient
        self._gather: Optional[Work] = None   # an unshard in flight
        self._gather_token = None             # identifies it to its continuation
        self._bind(flat)
        for i, p in enumerate(params):            # [Note: a parameter keeps its identity]
            if isinstance(p, Parameter):
                if "_global_shape" not in p.__dict__:     # its serial shape, while .data is released
                    p.__dict__["_global_shape"] = tuple(layout.shapes[i])
                p.__dict__["_local_owner"] = (self, i)

    # -- state ---------------------------------------------------------------------------------
    @property
    def is_sharded(self) -> bool:
        """True after :meth:`shard`."""
        return self._shard is not None

    @property
    def full(self):
        """The full flat buffer (``n`` elements) while gathered, else ``None``."""
        return self._full

    @property
    def full_grad(self):
        """The flat gradient buffer behind the parameters' ``.grad`` views, or ``None``."""
        return self._full_grad

    @property
    def aliased(self) -> bool:
        """True while the parameters are bound to the shard itself (``unshard(alias=True)``)."""
        f = self._full
        return f is not None and self._shard is not None and (f is self._shard or f.base is self._shard)

    @property
    def gathered_nbytes(self) -> int:
        """Bytes held by the gathered full buffer beyond the shard (0 when not gathered or aliased)."""
        if self._full is None or self.aliased:
            return 0
        return int(self._full.nbytes)

    def _bind(self, flat) -> None:
        for p, v in zip(self.params, self.layout.views(flat)):
            p.data = v

    def _release(self) -> None:
        xp = get_array_module(self.data)
        for p in self.params:
            p.data = xp.empty((0,), self.data.dtype)
        self._full = None

    def _drop_full_grad(self) -> None:
        if self._full_grad is not None:
            for p in self.params:
                p.grad = None
            self._full_grad = None
            self._grad_views = []

    def _piece_bounds(self, i: int):
        lo, hi = self.shard_range
        o = self.layout.offsets[i]
        a = min(max(lo, o), hi)
        return a - lo, max(a, min(hi, o + self.layout.numels[i])) - lo

    def piece(self, i: int):
        """``(data, grad or None)``: parameter ``i``'s elements in this rank's chunk (1-D views, possibly
        empty): what an optimizer built on the original parameters steps ([Note: a parameter keeps its
        identity]; FSDP1's ``use_orig_params=True``: each piece gets its own parameter group's options)."""
        a, b = self._piece_bounds(i)
        g = self.grad
        return self.data[a:b], (None if g is None else g.data[a:b])

    def _use_piece_grads(self) -> None:
        """Point every trainable original's ``.grad`` at its elements of ``self.grad`` (1-D views; all ``None``
        without one): [Note: the originals' gradients are views of the chunk]."""
        self._piece_grads = []
        g = self.grad
        for i, p in enumerate(self.params):
            if g is None or not p.requires_grad:
                p.grad = None
                continue
            a, b = self._piece_bounds(i)
            p.grad = Tensor._wrap(g.data[a:b])
            self._piece_grads.append(p.grad)

    def _drop_piece_grads(self) -> None:
        """The originals' ``.grad`` that still view the chunk become ``None`` (the chunk keeps the gradient), so
        a backward accumulates full-shaped gradients into them again."""
        if not self._piece_grads:
            return
        views = {id(t) for t in self._piece_grads}
        self._piece_grads = []
        for p in self.params:
            if p.grad is not None and id(p.grad) in views:
                p.grad = None

    def zero_piece_grad(self, i: int) -> None:
        """Zero parameter ``i``'s elements of the chunk's gradient (an optimizer's ``zero_grad`` on it)."""
        if self.grad is not None:
            a, b = self._piece_bounds(i)
            self.grad.data[a:b] = 0

    def segments(self) -> List[FlatSegment]:
        """Which parameter elements this rank's chunk holds (all of them before :meth:`shard`)."""
        return self.layout.segments(self.shard_range[0], self.shard_range[1], self.names)

    # -- sharding ------------------------------------------------------------------------------
    def shard(self, group=None) -> "FlatParameter":
        """Keep this rank's chunk of the flat buffer (and of a bound gradient); free the rest.

        Afterwards ``self.data`` is the chunk ``chunk_bounds(n, k, rank)`` (a view of a buffer
        padded to ``ceil(n / k)``) and every parameter's ``.data`` is an empty array until
        :meth:`unshard`.

        Args:
            group: the process group to shard over (default: all ranks).

        Returns:
            ``self``.
        """
        if self.is_sharded:
            raise RuntimeError(f"FlatParameter({self.names[0]}, ...) is already sharded over {self.group.name}")
        g = resolve_group(group)
        k, r, n = g.size, g.rank, self.total_numel
        size = max(1, -(-n // k))
        lo, hi = chunk_bounds(n, k, r)
        xp = get_array_module(self.data)
        shard = xp.zeros(size, self.data.dtype)
        shard[:hi - lo] = self._full[lo:hi]
        self.group, self.world_size, self.rank = g, k, r
        self.shard_range, self.padded_size = (lo, hi), size
        self._shard = shard
        self.data = shard[:hi - lo]
        # its placement: the flat buffer's chunk over ``g`` (the uneven rule), so it is gathered by placement alone
        self.placement = Placement(shards=(Shard(g, ShardKind.FLAT),), full_shape=(n,), cuts=(Cut(g, None),))
        fg = self._full_grad
        self._drop_full_grad()
        if fg is not None:
            self.grad = Tensor(fg[lo:hi].copy())
        elif self.grad is not None:
            self.grad = Tensor(self.grad.data[lo:hi].copy())
        self._release()
        if self.grad is not None:
            self._use_piece_grads()
        return self

    def _require_sharded(self, what: str) -> None:
        if not self.is_sharded:
            raise RuntimeError(f"FlatParameter.{what}() needs shard(group) first")

    @_trace.traced("fsdp.unshard (all-gather)", "fsdp")
    def unshard(self, *, async_op: bool = False, dtype=None, device=None, out=None,
                alias: bool = False) -> Optional[Work]:
        """All-gather the chunks into the full buffer and point every parameter at its view.

        Args:
            async_op: return a :class:`Work` at once (prefetch); the parameters are bound to the
                gathered views when it completes (``wait()``). Until then they stay empty.
            dtype: gather a copy of the shard cast to this dtype (mixed-precision compute);
                the parameters then hold that dtype. Default: the shard's dtype.
            device: where the full buffer lives (CPU offload keeps the shard on the host and
                gathers on the compute device). Default: the shard's device.
            out: a 1-D buffer of ``world_size * padded_size`` elements of that dtype to gather
                into (FSDP reuses one per unit); the full buffer is then its first ``n``.
            alias: over a group of one, in the shard's own dtype and on its device, and without
                ``out``: bind the parameters to the shard itself instead of a gathered copy
                (nothing is communicated or copied; :meth:`reshard` then frees nothing, and an
                optimizer step on the shard is seen by the parameters at once). FSDP's fast path
                at shard group size 1; elsewhere it is ignored.

        Returns:
            The Work with ``async_op=True`` (its result is the full buffer), else ``None``.

        Already gathered in that dtype and on that device: nothing to do (the views are not
        refreshed; after the shard changed, e.g. an optimizer step, :meth:`reshard` first).
        """
        self._require_sharded("unshard")
        if self._piece_grads and is_grad_enabled():    # a forward that a backward may follow
            self._drop_piece_grads()
        dev = device_of(self._shard) if device is None else as_device(device)
        want = self._shard.dtype if dtype is None else np.dtype(dtype)
        if self._gather is not None:                      # already in flight: same handle
            work = self._gather
        elif alias and out is None and self.world_size == 1 and want == self._shard.dtype \
                and dev == device_of(self._shard):
            if self._full is None or not self.aliased:
                if self._full is not None:
                    self.reshard()
                self._full = self._shard[:self.total_numel]
                self._bind(self._full)
            return Work(result=self._full) if async_op else None
        elif self._full is not None and self._full.dtype == want and device_of(self._full) == dev:
            work = Work(result=self._full)                # already gathered (call reshard() to refresh)
        else:
            if self._full is not None:
                self.reshard()
            k, size, n = self.world_size, self.padded_size, self.total_numel
            send = to_device(self._shard, dev)
            if send.dtype != want:
                send = send.astype(want)
            xp = get_array_module(send)
            if out is None:         # a group of one: a cast or moved copy is the gathered buffer already
                padded = send if k == 1 and send is not self._shard else xp.empty(k * size, send.dtype)
            elif out.shape != (k * size,) or out.dtype != send.dtype:
                raise ValueError(f"rank {self.group.world.rank}: unshard out= must be 1-D of {k * size} "
                                 f"{send.dtype} elements, got {out.shape} {out.dtype}")
            else:
                padded = out
            inner = all_gather(send, group=self.group, out=padded, async_op=True)
            token = self._gather_token = object()

            def done(buf):
                _compact(buf, n, k, size)
                full = buf[:n]
                if self._gather_token is token:       # not cancelled by reshard()
                    self._gather_token = self._gather = None
                    self._full = full
                    self._bind(full)
                return full

            work = inner.then(done)
            self._gather = work if self._gather_token is token else None
        if async_op:
            return work
        work.wait()
        return None

    def gather_host(self, chunk) -> List[np.ndarray]:
        """Every parameter's full values from ``chunk``, an array shaped like this rank's chunk (the shard
        itself, or optimizer state of it), all-gathered over the group through host memory: one host
        array per parameter, in its shape.  Collective over :attr:`group`; the parameters are untouched.

        Example:
            >>> full_exp_avg = dict(zip(flat.names, flat.gather_host(opt.state[flat]["exp_avg"])))
        """
        chunk = np.asarray(to_host(chunk))
        k, size, n = self.world_size, self.padded_size, self.total_numel
        send = np.zeros(size, chunk.dtype)
        send[:chunk.size] = chunk
        buf = np.empty(k * size, chunk.dtype)
        if k > 1:
            all_gather(send, group=self.group, out=buf)
        else:
            buf[:] = send
        _compact(buf, n, k, size)
        return [np.array(v, copy=True) for v in self.layout.views(buf[:n])]

    @_trace.traced("fsdp.reshard", "fsdp")
    def reshard(self) -> None:
        """Free the full buffer (waiting for an unshard in flight); keep this rank's chunk."""
        self._require_sharded("reshard")
        if self._gather is not None:
            w, self._gather, self._gather_token = self._gather, None, None
            w.wait()                                # the request completes; nothing is bound
        self._release()

    def move_shard(self, device) -> "FlatParameter":
        """Move this rank's chunk (and its gradient) to ``device``, e.g. ``"cpu"`` for CPU offload.

        Build the optimizer after moving, so its state is allocated beside the shard.

        Returns:
            ``self``.
        """
        self._require_sharded("move_shard")
        dev = as_device(device)
        c = self.shard_range[1] - self.shard_range[0]
        self._shard = to_device(self._shard, dev)
        self.data = self._shard[:c]
        if self.grad is not None:
            self.grad.data = to_device(self.grad.data, dev)
            if self._piece_grads:
                self._use_piece_grads()
        return self

    # -- gradients -----------------------------------------------------------------------------
    def bind_grads(self):
        """Make every parameter's ``.grad`` a view of one flat gradient buffer; return it.

        Existing gradients are copied in (missing ones are zeros; views of the chunk's gradient are
        dropped first). Backward then accumulates straight into the buffer. Idempotent while the views
        are bound.
        """
        self._drop_piece_grads()
        if self._full_grad is not None and all(
                p.grad is not None and p.grad.data is v for p, v in zip(self.params, self._grad_views)):
            return self._full_grad
        like = self._full if self._full is not None else self.data    # the compute copy's dtype/device
        xp, dtype = get_array_module(like), like.dtype
        cap = self.world_size * self.padded_size if self.is_sharded else self.total_numel
        buf = xp.empty(cap, dtype)
        if cap > self.total_numel:
            buf[self.total_numel:] = 0
        self.layout.pack([None if p.grad is None else p.grad.data for p in self.params], buf)
        self._full_grad = buf
        self._grad_views = self.layout.views(buf)
        for p, v in zip(self.params, self._grad_views):
            if p.grad is None:
                p.grad = Tensor(v)
            else:
                p.grad.data = v
        return buf

    def _pack_grads(self, scale=None):
        """``(buf, scaled)``: the flat gradient (padded to ``world_size * padded_size``), detached
        from the parameters.

        The bound buffer when :meth:`bind_grads` ran and its views are intact (``scaled`` False),
        else a new buffer packed from the parameters' ``.grad`` in one pass, multiplied by
        ``scale`` on the way when given (``None`` gradients count as zero). Afterwards every
        parameter's ``.grad`` is ``None``.
        """
        self._drop_piece_grads()
        views = self._grad_views
        scaled = False
        if self._full_grad is not None and all(
                p.grad is not None and p.grad.data is v for p, v in zip(self.params, views)):
            buf = self._full_grad
        else:
            grads = [None if p.grad is None else p.grad.data for p in self.params]
            like = next((g for g in grads if g is not None), None)   # the compute copy's dtype/device
            if like is None:
                like = self._full if self._full is not None else self.data
            cap = self.world_size * self.padded_size if self.is_sharded else self.total_numel
            buf = get_array_module(like).empty(cap, like.dtype)
            if cap > self.total_numel:
                buf[self.total_numel:] = 0
            if scale is None:
                self.layout.pack(grads, buf)
            else:
                xp = get_array_module(buf)
                for g, o, c in zip(grads, self.layout.offsets, self.layout.numels):
                    if g is None:
                        buf[o:o + c] = 0
                    else:
                        xp.multiply(g.reshape(-1), scale, out=buf[o:o + c])
                scaled = True
        for p in self.params:
            p.grad = None
        self._full_grad = None
        self._grad_views = []
        return buf, scaled

    def reduce_grad(self, op: ReduceOp = ReduceOp.MEAN, *, async_op: bool = False,
                    reduce_dtype=None) -> Optional[Work]:
        """Reduce-scatter the parameters' gradients into ``self.grad`` (this rank's chunk).

        Gradients not yet in the flat buffer are packed first (``None`` counts as zero). The
        result is added to an existing ``self.grad`` (accumulation across steps, as PyTorch
        FSDP does) or becomes it. The full gradient is freed at once: the parameters' ``.grad``
        become ``None``, and the buffer lives on only inside the Work until it completes.

        Args:
            op: ``ReduceOp.MEAN`` (average over the group, default) or ``ReduceOp.SUM``.
            async_op: return a :class:`Work`; ``self.grad`` is updated when it completes.
            reduce_dtype: reduce in this dtype (e.g. float32 for float16 gradients); the result
                is cast to the shard's dtype.

        Returns:
            The Work with ``async_op=True`` (its result is ``self.grad``), else ``None``.
        """
        self._require_sharded("reduce_grad")
        op = ReduceOp.coerce(op)
        if op not in (ReduceOp.MEAN, ReduceOp.SUM):
            raise ValueError(f"rank {self.group.world.rank}: reduce_grad op must be MEAN or SUM, got {op.name}")
        k, size, n = self.world_size, self.padded_size, self.total_numel
        # MEAN as DDP does it: the 1/k is applied while packing (no pass over the result), except
        # with a reduce_dtype (low-precision gradients would lose their small terms to 1/k)
        prescale = op is ReduceOp.MEAN and k > 1 and reduce_dtype is None
        buf, scaled = self._pack_grads(1.0 / k if prescale else None)
        if scaled:
            op = ReduceOp.SUM
        _expand(buf, n, k, size)
        if reduce_dtype is not None and np.dtype(reduce_dtype) != buf.dtype:
            buf = buf.astype(reduce_dtype)
        c = self.shard_range[1] - self.shard_range[0]

        def done(slot):
            part = to_device(slot[:c], device_of(self._shard))     # the shard may live on the host
            if self.grad is None:
                self.grad = Tensor(part.astype(self.data.dtype, copy=part.dtype != self.data.dtype))
            else:
                self.grad.data += part
            self._use_piece_grads()         # [Note: the originals' gradients are views of the chunk]
            return self.grad

        if k == 1:                  # a group of one: the mean (and the sum) is the buffer itself
            done(buf)
            return Work(result=self.grad) if async_op else None
        work = reduce_scatter(buf, op, self.group, async_op=True).then(done)
        if async_op:
            return work
        work.wait()
        return None

    def __repr__(self) -> str:
        state = "sharded" if self.is_sharded else "flat"
        gathered = ", gathered" if (self.is_sharded and self._full is not None) else ""
        return (f"FlatParameter({len(self.params)} params, numel={self.total_numel}, {state}{gathered}, "
                f"chunk={self.shard_range}, dtype={self.data.dtype})")


def broadcast_flat(tensors: Sequence[Tensor], group, src: int = 0, cap_bytes: int = 64 << 20) -> None:
    """Broadcast many small arrays as few flat messages (grouped by dtype/device)."""
    groups: Dict[Any, List[Tensor]] = {}
    for t in tensors:
        groups.setdefault((str(t.data.dtype), str(t.device)), []).append(t)
    for ts in groups.values():
        xp = get_array_module(ts[0].data)
        start = 0
        while start < len(ts):
            chunk, size = [], 0
            while start < len(ts) and (not chunk or size + ts[start].data.nbytes <= cap_bytes):
                chunk.append(ts[start])
                size += ts[start].data.nbytes
                start += 1
            flat = xp.concatenate([xp.ravel(t.data) for t in chunk]) if len(chunk) > 1 else xp.ravel(
                chunk[0].data).copy()
            broadcast(flat, src=src, group=group)
            off = 0
            for t in chunk:
                n = int(t.data.size)
                t.data[...] = flat[off:off + n].reshape(t.data.shape)
                off += n
