"""Ring attention (Megatron CP): K/V blocks passed around the context group, an online-softmax merge, a causal mask by global positions.

[Note: the ring]  Rank ``r`` of a ``P``-rank group holds the queries, keys and values of its
tokens (:class:`ContextLayout`, ring: chunks ``r`` and ``2P-1-r``).  Forward, step ``s = 0..P-1``:
attend the local queries to the K/V block of rank ``(r - s) mod P`` while that block is sent on to
rank ``r + 1`` and the next one is received from ``r - 1`` (``isend``/``irecv`` posted before the
block's compute, waited after it).  Each block's scores are masked by global position (key after
query: ``-inf``) and merged into the running max ``m``, normaliser ``l`` and unnormalised output
``o`` (the online softmax of FlashAttention); step 0 is the rank's own block, which holds every
query's own position, so ``m`` is finite from then on.  Only the rows and columns a block can
touch are computed: with the load-balanced layout a block from a lower rank is seen whole by all
local queries through half its keys, one from a higher rank by half the queries, so every rank
does the same work.  Backward (FlashAttention's, with the saved log-sum-exp) sends each block's
``(K, V)`` on before the step's compute and its accumulating ``(dK, dV)`` after it; after ``P``
steps one more hop brings ``(dK, dV)`` home.

Bytes sent per rank and layer (even split, ``kv`` = bytes of the local K and V): forward
``(P-1) kv`` = ``(P-1)/P`` of the whole sequence's K/V bytes; backward ``(2P-1) kv``.
"""
from __future__ import annotations

import math
from typing import Optional

from ... import kernels as K
from ...autograd.function import Function
from ...autograd.tensor import Tensor
from ...backend import get_array_module
from ...distributed import ProcessGroup, irecv, isend
from .layout import CPAlgo, ContextLayout

__all__ = ["ring_attention", "format_ring_schedule"]

_KV, _DKV = 11, 12      # tags: K/V blocks, their gradients


def _visible(qpos, kpos):
    """``(q0, k1)``: the queries ``[q0:]`` that see some key of the block and the keys ``[:k1]`` some query sees.

    Positions are ascending on every rank, so both are a suffix / prefix."""
    xp = get_array_module(qpos)
    q0 = int(xp.searchsorted(qpos, kpos[0], side="left"))
    k1 = int(xp.searchsorted(kpos, qpos[-1], side="right"))
    return q0, k1


def _sum_groups(a):
    """Sum over the query-head group axis (2) of ``(B, Hk, G, T, D)``, kept: the key/value heads' gradient."""
    return a if a.shape[2] == 1 else a.sum(axis=2, keepdims=True)


def _exchange(buf_send, shape, dtype, group, tag, xp):
    """Post the receive of the next block (from ``r - 1``) and the send of this one (to ``r + 1``)."""
    p, r = group.size, group.rank
    nxt = xp.empty(shape, dtype)
    wr = irecv(nxt, (r - 1) % p, group=group, tag=tag)
    ws = isend(buf_send, (r + 1) % p, group=group, tag=tag)
    return nxt, wr, ws


class _RingAttention(Function):
    """[Note: grouped-query heads in the ring]  ``q`` has ``H`` heads and ``k`` / ``v`` ``Hk`` (``H`` a multiple:
    grouped-query attention; ``Hk = H``: multi-head).  Internally ``q`` is ``(B, Hk, G, T, D)`` (the ``G = H / Hk``
    query heads of each key/value head) and ``k`` / ``v`` ``(B, Hk, 1, T, D)``, broadcast over ``G`` in the
    products, so the ring carries the ``Hk`` key/value heads only (not repeated) and their gradients are
    summed over each group."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout, scale):
        xp = get_array_module(q)
        p, r = group.size, group.rank
        pos = [xp.asarray(layout.positions(j)) for j in range(p)]
        qpos = pos[r]
        B, H, T, D = q.shape
        Hk = k.shape[1]
        q = q.reshape(B, Hk, H // Hk, T, D)
        m = xp.full(q.shape[:-1], -xp.inf, dtype=q.dtype)
        lsum = xp.zeros(q.shape[:-1], dtype=q.dtype)
        R = B * H
        m2, l2 = m.reshape(R, T), lsum.reshape(R, T)      # views: the kernel layer's (rows, queries) form
        o = xp.zeros(q.shape, dtype=q.dtype)
        kv = xp.ascontiguousarray(xp.stack([k, v])[:, :, :, None])          # (2, B, Hk, 1, T, D)
        for s in range(p):
            owner = (r - s) % p
            pending = None
            if s < p - 1:                       # the next block travels while this one is computed
                nshape = (2, B, Hk, 1, len(pos[(owner - 1) % p]), D)
                pending = _exchange(kv, nshape, kv.dtype, group, _KV, xp)
            kpos = pos[owner]
            q0, k1 = _visible(qpos, kpos)
            if q0 < T and k1 > 0:
                e = xp.matmul(q[..., q0:, :], xp.swapaxes(kv[0][..., :k1, :], -1, -2))
                alpha = K.online_softmax_block(e.reshape((R,) + e.shape[-2:]), scale,
                                               K.prefix_lengths(qpos[q0:], kpos[:k1]), m2, l2, q0)
                ob = o[..., q0:, :]
                ob *= alpha.reshape(e.shape[:-1] + (1,))
                ob += xp.matmul(e, kv[1][..., :k1, :])
            if pending is not None:
                nxt, wr, ws = pending
                wr.wait()
                ws.wait()
                kv = nxt
        out = o
        out /= lsum[..., None]
        xp.log(lsum, out=lsum)
        lsum += m
        ctx.save_for_backward(q, k, v, out, lsum)         # lsum is now the log-sum-exp
        ctx.group, ctx.layout, ctx.scale = group, layout, scale
        return out.reshape(B, H, T, D)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, layout, scale = ctx.group, ctx.layout, ctx.scale
        xp = get_array_module(q)
        p, r = group.size, group.rank
        pos = [xp.asarray(layout.positions(j)) for j in range(p)]
        qpos = pos[r]
        B, Hk, G, T, D = q.shape
        dout = dout.reshape(q.shape)
        delta = (dout * out).sum(axis=-1)
        R = B * Hk * G
        lse2, delta2 = lse.reshape(R, T), delta.reshape(R, T)
        dq = xp.zeros_like(q)
        kv = xp.ascontiguousarray(xp.stack([k, v])[:, :, :, None])
        dkv = xp.zeros_like(kv)
        for s in range(p):
            owner = (r - s) % p
            pending = None
            if s < p - 1:
                nshape = (2, B, Hk, 1, len(pos[(owner - 1) % p]), D)
                pending = _exchange(kv, nshape, kv.dtype, group, _KV, xp)
            kpos = pos[owner]
            q0, k1 = _visible(qpos, kpos)
            if q0 < T and k1 > 0:
                kb, vb, qb = kv[0][..., :k1, :], kv[1][..., :k1, :], q[..., q0:, :]
                ncols = K.prefix_lengths(qpos[q0:], kpos[:k1])
                pr = xp.matmul(qb, xp.swapaxes(kb, -1, -2))
                rows = (R,) + pr.shape[-2:]
                K.exp_minus_lse(pr.reshape(rows), scale, ncols, lse2, q0)
                do = dout[..., q0:, :]
                dkv[1][..., :k1, :] += _sum_groups(xp.matmul(xp.swapaxes(pr, -1, -2), do))
                ds = xp.matmul(do, xp.swapaxes(vb, -1, -2))
                K.lse_softmax_backward(pr.reshape(rows), ds.reshape(rows), delta2, q0, scale)   # scale included
                dq[..., q0:, :] += xp.matmul(ds, kb)
                dkv[0][..., :k1, :] += _sum_groups(xp.matmul(xp.swapaxes(ds, -1, -2), qb))
            if p == 1:
                break
            # this block's gradient goes on with it (after the last step: home to its owner, r + 1)
            nd, wdr, wds = _exchange(dkv, (2, B, Hk, 1, len(pos[(owner - 1) % p]), D), dkv.dtype, group, _DKV, xp)
            if pending is not None:
                nxt, wr, ws = pending
                wr.wait()
                ws.wait()
                kv = nxt
            wdr.wait()
            wds.wait()
            dkv = nd
        return dq.reshape(B, Hk * G, T, D), dkv[0][:, :, 0], dkv[1][:, :, 0], None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup, seq_len: Optional[int] = None, *,
                   scale: Optional[float] = None) -> Tensor:
    """Causal attention of this rank's tokens against the whole sequence, K/V passed around ``group``.

    Args:
        q, k, v: ``(B, H, T_local, head_dim)``, this rank's tokens in the ring layout
            (:class:`ContextLayout` ``(seq_len, group.size, "ring")``: chunks ``r`` and ``2P-1-r``); ``k`` and
            ``v`` may have fewer heads ``Hk`` (grouped-query attention: query head ``h`` reads key/value head
            ``h // (H / Hk)``; only the ``Hk`` heads travel, [Note: grouped-query heads in the ring]).
        group: the context-parallel group.
        seq_len: the whole sequence length (default ``T_local * P``: an even split).
        scale: score scale (default ``1/sqrt(head_dim)``).

    Returns:
        ``(B, H, T_local, head_dim)``: this rank's rows of serial causal attention.

    Example:
        >>> y = ring_attention(q, k, v, grid.context_group, seq_len=T)
    """
    p = group.size
    t = q.shape[2]
    layout = ContextLayout(int(seq_len) if seq_len is not None else t * p, p, CPAlgo.RING)
    want = layout.local_len(group.rank)
    if t != want or k.shape[2] != want or v.shape[2] != want:
        raise ValueError(f"rank {group.world.rank}: ring_attention over {p} ranks with seq_len={layout.seq_len} "
                         f"needs {want} local tokens on context rank {group.rank}, got q/k/v lengths "
                         f"{(q.shape[2], k.shape[2], v.shape[2])}; split the sequence with ContextLayout.split")
    if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
        raise ValueError(f"rank {group.world.rank}: ring_attention needs as many key as value heads, dividing the "
                         f"query heads; got q/k/v heads {(q.shape[1], k.shape[1], v.shape[1])}")
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, group, layout, sc)


def format_ring_schedule(size: int) -> str:
    """The ring schedule over ``size`` ranks as a table (data, no MPI): which K/V block each rank attends
    to at each step and which part of it the causal mask leaves (the load-balanced layout).

    Example:
        >>> print(format_ring_schedule(2))
        ring attention over 2 ranks: 4 chunks, rank r holds chunks r and 3-r
        step  rank 0             rank 1
           0  own 0+3: causal    own 1+2: causal
           1  1+2 from r1: q[3]  0+3 from r0: k[0]
    """
    p = int(size)
    cells = []
    for s in range(p):
        row = []
        for r in range(p):
            o = (r - s) % p
            blk = f"{o}+{2 * p - 1 - o}"
            if o == r:
                row.append(f"own {blk}: causal")
            elif o < r:                       # lower rank's block: every query, its first chunk of keys
                row.append(f"{blk} from r{o}: k[{o}]")
            else:                             # higher rank's block: the second chunk of queries, every key
                row.append(f"{blk} from r{o}: q[{2 * p - 1 - r}]")
        cells.append(row)
    w = max(len(c) for row in cells for c in row) + 2
    lines = [f"ring attention over {p} ranks: {2 * p} chunks, rank r holds chunks r and {2 * p - 1}-r",
             "step  " + "".join(f"rank {r}".ljust(w) for r in range(p)).rstrip()]
    for s, row in enumerate(cells):
        lines.append(f"{s:>4}  " + "".join(c.ljust(w) for c in row).rstrip())
    return "\n".join(lines)
