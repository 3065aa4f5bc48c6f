"""Neural-network ops as fused ``Function``s: activations, softmax, layer norm, embedding, dropout,
losses and ``linear`` (one fused matmul + bias with the weight in PyTorch's (out, in) layout)."""
from __future__ import annotations

import math
from typing import Sequence, Union

import numpy as np

from ..backend import get_array_module, matmul as _bmm
from . import replay as _replay
from .function import Function
from ._util import _dim, _on_one_device, _shape, _unbroadcast
from .. import kernels as K
from .tensor import Tensor

__all__ = [
    "DtypeMismatchError", "dtype_mismatch", "dtype_refused", "cross_entropy", "dropout", "dropout_add", "embedding", "gelu",
    "grouped_causal_attention", "layer_norm", "linear", "log_softmax",
    "masked_fill", "mse_loss", "relu", "scaled_dot_product_attention", "sigmoid", "silu", "softmax",
]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


# -- linear --------------------------------------------------------------------------------
class Linear(Function):
    """``y = x @ W.T + b`` with ``W`` of shape (out, in); leading dims of ``x`` are flattened."""

    _fresh_grads = True

    @staticmethod
    def forward(ctx, x, w, b):
        x2 = x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x
        y = x2 @ w.T
        if b is not None:
            y += b
        n = ctx.needs_input_grad
        ctx.save_for_backward(x2 if n[1] else None, w if n[0] else None)
        ctx.xshape = x.shape
        return y.reshape(x.shape[:-1] + (w.shape[0],)) if x.ndim != 2 else y

    @staticmethod
    def backward(ctx, g):
        x2, w = ctx.saved_tensors
        n = ctx.needs_input_grad
        g2 = g.reshape(-1, g.shape[-1]) if g.ndim != 2 else g
        gx = (g2 @ w).reshape(ctx.xshape) if n[0] else None
        gw = g2.T @ x2 if n[1] else None
        gb = None
        if n[2]:   # column sums: one BLAS matrix-vector product (2x NumPy's reduce over rows here)
            xp = get_array_module(g2)
            gb = xp.ones(g2.shape[0], g2.dtype) @ g2 if _inplace_ok(g2) and g2.shape[0] > 1 else g2.sum(axis=0)
        return gx, gw, gb


class DtypeMismatchError(TypeError, RuntimeError):
    """A layer's input dtype differs from its weight's (PyTorch raises a RuntimeError there; this is both
    a TypeError, as axonmpi's bad-input errors are, and a RuntimeError, as torch's).

    The rule (:func:`dtype_refused`), as PyTorch's: a float32 or float64 layer takes input of its
    weight's dtype only; given float64 (or float16) input a float32 layer raises, naming the layer
    and both dtypes; cast the input (``x.float()``) or the layer (``model.double()``). Integer input
    is refused by every layer. 16-bit layers (mixed precision: FSDP's ``param_dtype``, the recipe's
    bf16) take floating input of any width and compute in the wider dtype, where PyTorch's autocast
    would cast.
    """


def dtype_refused(xd, wd) -> bool:
    """The dtype rule: True when a layer with ``wd`` weights must refuse input of dtype ``xd``.

    Equal dtypes pass. Integer (and bool) input is always refused. Floating input of another width
    is refused by float32 / float64 layers, as PyTorch refuses it; 16-bit layers (float16 /
    bfloat16, what mixed precision makes) take floating input of any width and compute in the
    wider dtype, as they always have here (autocast's role in PyTorch).
    """
    if xd == wd:
        return False
    x_float = xd.kind in "fc" or xd.name == "bfloat16"
    w16 = wd.itemsize == 2 and (wd.kind == "f" or wd.name == "bfloat16")
    return not (x_float and w16)


def _rank_prefix() -> str:
    from ..distributed import world as _w
    return f"rank {_w._WORLD.rank}: " if _w._WORLD is not None and not _w._WORLD._destroyed else ""


def dtype_mismatch(layer, x, w) -> str:
    """The message of a :class:`DtypeMismatchError`: the layer (its repr, or ``what``), both dtypes, the fix."""
    name = layer if isinstance(layer, str) else repr(layer).split("\n")[0]
    if x.dtype.kind in "fc" or x.dtype.name == "bfloat16":
        fix = (f"cast the input (x.to({w.dtype.name}), x.float()) or the layer (layer.to({x.dtype.name}), "
               ".double())")
    else:
        fix = "integer input is never promoted: cast it (x.float()), or use nn.Embedding for indices"
    return (f"{_rank_prefix()}{name} has {w.dtype} weights but got input of dtype {x.dtype} (shape "
            f"{tuple(x.shape)}); the dtypes must match, as in PyTorch: {fix}")


def linear(input, weight, bias=None) -> Tensor:  # noqa: A002
    """Affine map ``input @ weight.T + bias`` (one fused op; ``weight`` is (out_features, in_features)).

    ``input`` must have ``weight``'s dtype (:class:`DtypeMismatchError` otherwise, as PyTorch's).

    Example:
        >>> linear(Tensor([[1.0, 2.0]]), Tensor([[1.0, 1.0], [0.0, 1.0]]), Tensor([0.5, 0.0])).tolist()
        [[3.5, 2.0]]
    """
    wd = weight.dtype if isinstance(weight, Tensor) else getattr(weight, "dtype", None)
    xd = input.dtype if isinstance(input, Tensor) else getattr(input, "dtype", None)
    if wd is not None and xd is not None and dtype_refused(xd, wd):
        raise DtypeMismatchError(dtype_mismatch("linear", input if isinstance(input, Tensor) else Tensor._wrap(input),
                                                weight))
    return Linear.apply(input, weight, bias)


# -- activations ---------------------------------------------------------------------------
class ReLU(Function):
    _fresh_grads = True

    @staticmethod
    def forward(ctx, x):
        out = K.relu_forward(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return K.relu_backward(out, g)


class Sigmoid(Function):
    _fresh_grads = True

    @staticmethod
    def forward(ctx, x):
        out = K.sigmoid_forward(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (s,) = ctx.saved_tensors
        return K.sigmoid_backward(s, g)


class SiLU(Function):
    _fresh_grads = True

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return K.silu_forward(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return K.silu_backward(x, g)


class GELU(Function):
    _fresh_grads = True

    @staticmethod
    def forward(ctx, x, approximate):
        ctx.approximate = approximate
        y = K.gelu_forward(x, approximate)
        ctx.save_for_backward(x, y if approximate == "none" else None)
        return y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return K.gelu_backward(x, g, ctx.approximate, y), None


def _inplace_ok(x) -> bool:
    return getattr(x, "dtype", None) is not None and x.dtype.kind == "f" and x.dtype.itemsize >= 4


def _no_inplace(name: str, inplace: bool) -> None:
    if inplace not in (False, True):
        raise TypeError(f"{name}: inplace must be a bool, got {inplace!r}")


def relu(input, inplace: bool = False) -> Tensor:  # noqa: A002
    """``max(input, 0)`` (gradient 0 at 0).

    ``inplace`` is accepted for PyTorch compatibility; the result is always a new tensor (there
    are no in-place autograd ops), which gives the same values and gradients.
    """
    _no_inplace("relu", inplace)
    return ReLU.apply(input)


def sigmoid(input) -> Tensor:  # noqa: A002
    """Logistic function ``1 / (1 + exp(-input))`` (overflow-free)."""
    return Sigmoid.apply(input)


def silu(input, inplace: bool = False) -> Tensor:  # noqa: A002
    """``input * sigmoid(input)`` (a.k.a. swish); ``inplace`` as in :func:`relu`."""
    _no_inplace("silu", inplace)
    return SiLU.apply(input)


def gelu(input, approximate: str = "none") -> Tensor:  # noqa: A002
    """Gaussian error linear unit: exact (``"none"``, via erf) or the ``"tanh"`` approximation."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu approximate must be 'none' or 'tanh', got {approximate!r}")
    return GELU.apply(input, approximate)


# -- softmax -------------------------------------------------------------------------------
class Softmax(Function):
    _fresh_grads = True

    @staticmethod
    def forward(ctx, x, axis):
        p = K.softmax_forward(x, axis)
        ctx.save_for_backward(p)
        ctx.axis = axis
        return p

    @staticmethod
    def backward(ctx, g):
        (p,) = ctx.saved_tensors
        return K.softmax_backward(p, g, ctx.axis), None


def _sum_keep(xp, a, axis):
    return K.sum_keep(xp, a, axis)


class LogSoftmax(Function):
    _fresh_grads = True

    @staticmethod
    def forward(ctx, x, axis):
        z = K.log_softmax_forward(x, axis)
        ctx.save_for_backward(z)
        ctx.axis = axis
        return z

    @staticmethod
    def backward(ctx, g):
        (logp,) = ctx.saved_tensors
        return K.log_softmax_backward(logp, g, ctx.axis), None


def _softmax_args(x, dim, axis, dtype):
    d = _dim(dim, axis, -1)
    if dtype is not None:
        x = x.to(dtype=dtype)
    return x, d


def softmax(input, dim: int = -1, dtype=None, *, axis=None) -> Tensor:  # noqa: A002
    """Softmax along ``dim`` (max-shifted for stability); ``dtype`` casts the input first.

    Example:
        >>> softmax(Tensor([0.0, 0.0]), dim=0).tolist()
        [0.5, 0.5]
    """
    x, d = _softmax_args(input, dim, axis, dtype)
    return Softmax.apply(x, d)


def log_softmax(input, dim: int = -1, dtype=None, *, axis=None) -> Tensor:  # noqa: A002
    """Log-softmax along ``dim`` (log-sum-exp stabilised); ``dtype`` casts the input first."""
    x, d = _softmax_args(input, dim, axis, dtype)
    return LogSoftmax.apply(x, d)


# -- attention -----------------------------------------------------------------------------
class ScaledDotProductAttention(Function):
    """``softmax(q k^T scale + mask) v`` over the last two axes as one op (torch's math backend).

    The scores are made, scaled, masked and turned into probabilities in one buffer, in place; the
    backward reuses the probabilities (no scaled, masked or shifted copies kept, as the unfused
    ``matmul -> mul -> masked_fill -> softmax -> matmul`` chain keeps). Causal attention without
    dropout runs by blocks of query rows, each against the keys up to its last row only: the
    masked half of the scores is never computed nor stored (about half the work and memory at long
    sequences). Attention dropout draws its mask exactly as :func:`dropout` on the probabilities
    would (same generator, shape and dtype).
    """

    _fresh_grads = True

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale, dropout_p, stack=1):
        xp = get_array_module(q)
        L, S = q.shape[-2], k.shape[-2]
        rows = 128 if L >= 512 else 64
        if stack > 1:   # [Note: stacked query groups] rows are ``stack`` copies of the L/stack positions
            blocks = [(0, L)]
        elif is_causal and not dropout_p and L >= 2 * rows:
            blocks = [(r0, min(r0 + rows, L)) for r0 in range(0, L, rows)]
        else:
            blocks = [(0, L)]
        out, probs, keep = None, [], None
        for r0, r1 in blocks:
            end = min(S, r1) if is_causal else S
            s = _bmm(q[..., r0:r1, :], xp.swapaxes(k[..., :end, :], -1, -2))
            if mask is not None and xp.broadcast_shapes(s.shape, mask.shape) != s.shape:
                s = xp.broadcast_to(s, xp.broadcast_shapes(s.shape, mask.shape)).copy()
            # top-left aligned, as torch: query i sees keys 0..i (mask, scale and softmax in one pass)
            ncols = K.causal_lengths(xp, r0, r1, end) if is_causal else None
            if is_causal and stack > 1:
                ncols = xp.tile(K.causal_lengths(xp, 0, L // stack, S), stack)
            s = K.masked_softmax_forward(s, scale, ncols, mask)
            if dropout_p:
                from ..random import generator_for
                dt = s.dtype if s.dtype.kind == "f" or s.dtype.name == "bfloat16" else np.dtype(np.float32)
                r = generator_for(xp).random(s.shape, dtype=np.float32 if dt.itemsize <= 4 else np.float64)
                keep = (r >= dropout_p).astype(dt)
                keep *= 1.0 / (1.0 - dropout_p)
            o = _bmm(s if keep is None else s * keep, v[..., :end, :])
            if len(blocks) == 1:
                out = o
            else:
                if out is None:
                    out = xp.empty(o.shape[:-2] + (L, o.shape[-1]), o.dtype)
                out[..., r0:r1, :] = o
            probs.append(s)
        ctx.save_for_backward(q, k, v, keep, *probs)
        ctx.blocks, ctx.scale = [(r0, r1, min(S, r1) if is_causal else S) for r0, r1 in blocks], scale
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, keep, *probs = ctx.saved_tensors
        xp = get_array_module(g)
        n = ctx.needs_input_grad
        bs, one = g.shape[:-2], len(probs) == 1
        L, S = q.shape[-2], k.shape[-2]
        gq = gk = gv = None
        if not one:
            gq = xp.empty(bs + (L, q.shape[-1]), g.dtype) if n[0] else None
            gk = xp.zeros(bs + (S, k.shape[-1]), g.dtype) if n[1] else None
            gv = xp.zeros(bs + (S, v.shape[-1]), g.dtype) if n[2] else None
        for (r0, r1, end), p in zip(ctx.blocks, probs):
            gi = g[..., r0:r1, :]
            if n[2]:
                pd = p if keep is None else p * keep
                dv = _bmm(xp.swapaxes(pd, -1, -2), gi)
                if one:
                    gv = dv
                else:
                    gv[..., :end, :] += dv
            if not (n[0] or n[1]):
                continue
            dp = _bmm(gi, xp.swapaxes(v[..., :end, :], -1, -2))
            if keep is not None:
                dp *= keep
            dp = K.masked_softmax_backward(p, dp, ctx.scale)   # scale p (dp - sum(dp p)), in place
            if n[0]:
                dq = _bmm(dp, k[..., :end, :])
                if one:
                    gq = dq
                else:
                    gq[..., r0:r1, :] = dq
            if n[1]:
                dk = _bmm(xp.swapaxes(dp, -1, -2), q[..., r0:r1, :])
                if one:
                    gk = dk
                else:
                    gk[..., :end, :] += dk
        return (None if gq is None else _unbroadcast(gq, q.shape), None if gk is None else _unbroadcast(gk, k.shape),
                None if gv is None else _unbroadcast(gv, v.shape), None, None, None, None, None)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0,  # noqa: C901
                                 is_causal: bool = False, scale=None, enable_gqa: bool = False) -> Tensor:
    """PyTorch's ``F.scaled_dot_product_attention``: ``softmax(q k^T scale + mask) v`` as one fused op.

    Args:
        query, key, value: (..., L, E), (..., S, E), (..., S, Ev) Tensors (heads in a leading axis).
        attn_mask: a boolean mask (True: the pair takes part) or an additive float mask, broadcastable
            to (..., L, S); not a Tensor with gradient.
        dropout_p: attention dropout (applied whenever > 0, as torch's; pass ``p if training else 0``).
        is_causal: mask the pairs (i, j > i) (top-left aligned, as torch).
        scale: defaults to ``1 / sqrt(E)``.
        enable_gqa: not built (``NotImplementedError``): repeat the key/value heads first.

    Example:
        >>> q = k = v = Tensor(np.ones((1, 2, 4, 8)))
        >>> scaled_dot_product_attention(q, k, v, is_causal=True).shape
        (1, 2, 4, 8)
    """
    if enable_gqa:
        raise NotImplementedError("scaled_dot_product_attention(enable_gqa=True) is not built: repeat the key and "
                                  "value heads to the query's (k.repeat_interleave) and call it with enable_gqa=False")
    if is_causal and attn_mask is not None:
        raise ValueError("scaled_dot_product_attention: give attn_mask or is_causal=True, not both (as torch)")
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"scaled_dot_product_attention: dropout_p must be in [0, 1), got {dropout_p}")
    e = query.shape[-1]
    if key.shape[-1] != e or key.shape[-2] != value.shape[-2]:
        raise ValueError(f"scaled_dot_product_attention: query {tuple(query.shape)}, key {tuple(key.shape)} and "
                         f"value {tuple(value.shape)} must have (..., L, E), (..., S, E), (..., S, Ev)")
    mask = attn_mask.data if isinstance(attn_mask, Tensor) else attn_mask
    if mask is not None and not hasattr(mask, "dtype"):
        mask = np.asarray(mask)
    if mask is not None:
        mask = _on_one_device((query.data if isinstance(query, Tensor) else query, mask), (False, False),
                              ("scaled_dot_product_attention: query", "scaled_dot_product_attention: attn_mask"))[1]
    sc = float(1.0 / math.sqrt(e) if scale is None else scale)
    return ScaledDotProductAttention.apply(query, key, value, mask, bool(is_causal), sc, float(dropout_p), 1)


def grouped_causal_attention(query, key, value, groups: int, dropout_p: float = 0.0, scale=None) -> Tensor:
    """Causal attention with grouped key/value heads, the ``groups`` query heads of each key/value head stacked
    along time: ``query`` (..., groups * T, E), ``key`` / ``value`` (..., T, E) -> (..., groups * T, Ev).

    [Note: stacked query groups] Row ``r * T + t`` is query head ``r`` of the group at position ``t``: it sees keys
    ``0..t``. One product per key/value head (keys and values are not repeated); the masked softmax stops at each
    row's last key. Attention dropout draws as :func:`dropout` on the (..., groups * T, T) probabilities would.

    Example:
        >>> y = grouped_causal_attention(q, k, v, groups=4)     # q (B, Hk, 4 T, D), k / v (B, Hk, T, D)
    """
    if query.shape[-2] != groups * key.shape[-2] or key.shape[-2] != value.shape[-2]:
        raise ValueError(f"grouped_causal_attention: query {tuple(query.shape)} must stack groups={groups} blocks of "
                         f"the key/value length {key.shape[-2]} (key {tuple(key.shape)}, value {tuple(value.shape)})")
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"grouped_causal_attention: dropout_p must be in [0, 1), got {dropout_p}")
    sc = float(1.0 / math.sqrt(query.shape[-1]) if scale is None else scale)
    return ScaledDotProductAttention.apply(query, key, value, None, True, sc, float(dropout_p), int(groups))


# -- layer norm ----------------------------------------------------------------------------
class LayerNorm(Function):
    """Fused layer normalization over the trailing ``ndims`` axes.

    float32/float64 inputs take the row form (:func:`axonmpi.kernels.layer_norm_forward`: the trailing axes
    as one row of ``m`` elements, one pass each way); other dtypes the axis form.
    """

    _fresh_grads = True

    @staticmethod
    def forward(ctx, x, weight, bias, ndims, eps):
        xp = get_array_module(x)
        axes = tuple(range(x.ndim - ndims, x.ndim))
        ctx.axes = axes
        n = ctx.needs_input_grad
        m = int(np.prod(x.shape[x.ndim - ndims:]))
        if _inplace_ok(x) and m > 0 and x.size and (weight is None or weight.dtype == x.dtype):
            out, ctx.state = K.layer_norm_forward(x.reshape(-1, m), weight, bias, eps)
            ctx.rows = True
            return out.reshape(x.shape)
        ctx.rows = False
        mu = x.mean(axis=axes, keepdims=True)
        xc = x - mu
        var = (xc * xc).mean(axis=axes, keepdims=True)
        rstd = 1.0 / xp.sqrt(var + eps)
        xhat = xc
        xhat *= rstd
        ctx.save_for_backward(xhat, rstd, weight if n[0] else None)
        out = xhat * weight if weight is not None else xhat.copy()
        if bias is not None:
            out += bias
        return out

    @staticmethod
    def backward(ctx, g, ):
        n = ctx.needs_input_grad
        axes = ctx.axes
        if ctx.rows:
            shape = g.shape
            wshape = shape[len(shape) - len(axes):]
            m = int(np.prod(wshape))
            gx, gw, gb = K.layer_norm_backward(g.reshape(-1, m), ctx.state, n[0], n[1], n[2])
            return (None if gx is None else gx.reshape(shape), None if gw is None else gw.reshape(wshape),
                    None if gb is None else gb.reshape(wshape), None, None)
        xhat, rstd, weight = ctx.saved_tensors
        lead = tuple(range(g.ndim - len(axes)))
        gw = (g * xhat).sum(axis=lead) if n[1] else None
        gb = g.sum(axis=lead) if n[2] else None
        gx = None
        if n[0]:
            gh = g * weight if weight is not None else g.copy()
            m1 = gh.mean(axis=axes, keepdims=True)
            m2 = (gh * xhat).mean(axis=axes, keepdims=True)
            gh -= m1
            gh -= xhat * m2
            gh *= rstd
            gx = gh
        return gx, gw, gb, None, None


def layer_norm(input, normalized_shape: Union[int, Sequence[int]], weight=None, bias=None,  # noqa: A002
               eps: float = 1e-5) -> Tensor:
    """Normalize over the trailing ``normalized_shape`` axes, then scale by ``weight`` and add ``bias``.

    Example:
        >>> layer_norm(Tensor([[1.0, 3.0]]), 2).tolist()   # (x - mean) / sqrt(var + eps)
        [[-0.999995..., 0.999995...]]
    """
    ndims = 1 if isinstance(normalized_shape, (int, np.integer)) else len(tuple(normalized_shape))
    return LayerNorm.apply(input, weight, bias, ndims, eps)


# -- embedding / dropout / masking ---------------------------------------------------------
class Embedding(Function):
    _fresh_grads = True

    @staticmethod
    def forward(ctx, idx, weight, padding_idx=None, bad=None):
        ctx.save_for_backward(idx)
        ctx.wshape, ctx.padding_idx = weight.shape, padding_idx
        out = weight[idx]
        if bad is not None:          # indices out of range (checked on the device): their rows are NaN
            get_array_module(out).copyto(out, np.nan, where=bad[..., None])
        return out

    @staticmethod
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        return None, K.embedding_backward(idx, g, ctx.wshape[0], ctx.padding_idx), None, None


def _scatter_add_rows(xp, out, idx, rows) -> None:
    """``out[idx[i]] += rows[i]`` for every ``i``, repeated indices accumulating (:func:`axonmpi.kernels.scatter_add_rows`)."""
    K.scatter_add_rows(out, idx, rows)


def embedding(input, weight, padding_idx=None) -> Tensor:  # noqa: A002
    """Rows of ``weight`` selected by integer indices ``input`` (Tensor, array or nested list).

    Host indices are copied to a GPU ``weight``'s device.  The backward scatter-adds, so repeated
    indices accumulate; row ``padding_idx`` (if given) receives no gradient.

    Example:
        >>> w = Tensor([[0.0, 1.0], [2.0, 3.0]])
        >>> embedding([1, 1, 0], w).tolist()
        [[2.0, 3.0], [2.0, 3.0], [0.0, 1.0]]
    """
    idx = input.data if isinstance(input, Tensor) else input
    if not hasattr(idx, "dtype"):
        idx = np.asarray(idx)
        if idx.size == 0:
            idx = idx.astype(np.int64)
    if idx.dtype.kind not in "iu":
        raise TypeError(f"embedding indices must be integers, got dtype {idx.dtype}")
    w = weight.data if isinstance(weight, Tensor) else weight
    n = w.shape[0]
    bad = None
    if checks_on_device(get_array_module(w)):       # no host sync: out-of-range ids give NaN rows
        idx = _on_one_device((w, idx), (False, False), ("embedding: weight", "embedding: indices"))[1]
        xp = get_array_module(idx)
        bad = (idx < 0) | (idx >= n)
        idx = xp.where(bad, 0, idx)
    elif idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise IndexError(f"embedding index out of range: indices span [{int(idx.min())}, {int(idx.max())}] "
                         f"for a table of {n} rows (expected 0..{n - 1}; negative ids do not wrap, as in torch)")
    idx = _on_one_device((w, idx), (False, False), ("embedding: weight", "embedding: indices"))[1]
    if padding_idx is not None:
        if not -n <= int(padding_idx) < n:
            raise ValueError(f"embedding padding_idx={padding_idx} out of range for {n} rows")
        padding_idx = int(padding_idx) % n
    return Embedding.apply(idx, weight, padding_idx, bad)


def checks_on_device(xp) -> bool:
    """Whether input checks (indices in range, targets in range) run as array ops instead of host reads: on a
    GPU (no host sync), and in a captured step on any device (``axonmpi.compile``); a failed check then gives
    NaN (the loss read when logged shows it) instead of an ``IndexError``."""
    return xp is not np or _replay.active_tape() is not None


def _uniform(x):
    """Uniform draws in [0, 1) for dropout on ``x`` (float32 for 16- and 32-bit inputs, float64 for float64)."""
    from ..random import generator_for

    xp = get_array_module(x)
    dtype = x.dtype if x.dtype.kind == "f" or x.dtype.name == "bfloat16" else np.dtype(np.float32)
    return generator_for(xp).random(x.shape, dtype=np.float32 if dtype.itemsize <= 4 else np.float64)


class Dropout(Function):
    _fresh_grads = True

    @staticmethod
    def forward(ctx, x, p):
        y, keep = K.dropout_forward(x, _uniform(x), p)
        ctx.save_for_backward(keep)
        ctx.p = p
        return y

    @staticmethod
    def backward(ctx, g):
        return K.dropout_backward(g, ctx.saved_tensors[0], ctx.p), None


class DropoutAdd(Function):
    """``residual + dropout(x)`` in one pass each way (the mask drawn as :class:`Dropout` draws it)."""

    _fresh_grads = True

    @staticmethod
    def forward(ctx, x, residual, p):
        y, keep = K.dropout_forward(x, _uniform(x), p, residual=residual)
        ctx.save_for_backward(keep)
        ctx.p = p
        return y

    @staticmethod
    def backward(ctx, g):
        n = ctx.needs_input_grad
        return (K.dropout_backward(g, ctx.saved_tensors[0], ctx.p) if n[0] else None), (g if n[1] else None), None


def dropout(input, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:  # noqa: A002
    """Zero each element with probability ``p`` and scale the rest by ``1/(1-p)``; identity if not training.

    Masks come from :mod:`axonmpi.random`'s generator, so ``manual_seed`` makes them reproducible.
    ``inplace`` as in :func:`relu`.
    """
    _no_inplace("dropout", inplace)
    x = input
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    return Dropout.apply(x, p)


def dropout_add(input, residual, p: float = 0.5, training: bool = True) -> Tensor:  # noqa: A002
    """``residual + dropout(input, p, training)`` as one op: one pass forward, one backward (the mask is the one
    :func:`dropout` would draw, so the two forms give the same values under the same seed).

    Example:
        >>> x = dropout_add(proj(h), x, p=0.1, training=model.training)     # a transformer block's residual
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return residual + input
    if p == 1.0:
        return residual + input * 0.0
    if not isinstance(input, Tensor):
        input = Tensor(input)
    if tuple(getattr(residual, "shape", ())) != tuple(input.shape):
        return residual + Dropout.apply(input, p)     # broadcasting residuals: the two-op form
    return DropoutAdd.apply(input, residual, p)


class MaskedFill(Function):
    _fresh_grads = True

    @staticmethod
    def forward(ctx, x, mask, value):
        x, mask = _on_one_device((x, mask), (ctx.needs_input_grad[0], False),
                                 ("masked_fill: input", "masked_fill: mask"))
        xp = get_array_module(x)
        ctx.save_for_backward(mask)
        ctx.shape = x.shape
        return xp.where(mask, xp.asarray(value, dtype=x.dtype), x)

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        xp = get_array_module(g)
        return _unbroadcast(xp.where(mask, xp.zeros((), g.dtype), g), tuple(ctx.shape)), None, None


def masked_fill(input, mask, value: float) -> Tensor:  # noqa: A002
    """Replace elements where boolean ``mask`` (broadcastable) is True by ``value``.

    A host ``mask`` is copied to the device of a GPU ``input``.

    Example:
        >>> masked_fill(Tensor([1.0, 2.0]), Tensor([True, False]), 0.0).tolist()
        [0.0, 2.0]
    """
    if isinstance(mask, Tensor):
        mask = mask.data
    if not hasattr(mask, "dtype"):
        mask = np.asarray(mask)
    if mask.dtype != np.bool_:
        raise TypeError(f"masked_fill expects a boolean mask, got dtype {mask.dtype}")
    return MaskedFill.apply(input, mask, value)


# -- losses --------------------------------------------------------------------------------
_REDUCTIONS = ("mean", "sum", "none")


class CrossEntropy(Function):
    """Fused log-softmax + negative log-likelihood over the last axis, with PyTorch's class
    ``weight`` and ``label_smoothing``.

    Per row ``i`` with target ``t`` (``w`` = weight or ones, ``W = sum(w)``, ``e`` = smoothing,
    ``C`` classes): ``loss_i = (1-e) w[t] (lse_i - x_it) + e/C (W lse_i - sum_c w_c x_ic)``, zero
    for ignored rows; ``"mean"`` divides by ``sum_i w[t_i]`` over counted rows, as torch does.
    """

    _fresh_grads = True

    @staticmethod
    def forward(ctx, logits, target, reduction, ignore_index, weight=None, label_smoothing=0.0):
        logits, target = _on_one_device((logits, target), (ctx.needs_input_grad[0], False),
                                        ("cross_entropy: input", "cross_entropy: target"))
        xp = get_array_module(logits)
        c = logits.shape[-1]
        x = logits.reshape(-1, c)
        loss, wt, ctx.state = K.cross_entropy_forward(x, target.reshape(-1), ignore_index, weight, label_smoothing)
        ctx.reduction, ctx.lshape = reduction, logits.shape
        if reduction == "none":
            return loss.reshape(target.shape)
        # 16-bit logits: sum and divide in float32 (as torch's autocast runs this loss), so that
        # neither the sum nor a loss scale (GradScaler: 2**16 * loss) overflows float16
        acc = np.float32 if x.dtype.itemsize < 4 else x.dtype
        total = loss.sum(dtype=acc)
        if reduction == "sum":
            return total
        ctx.count = wt.sum(dtype=acc)
        if checks_on_device(xp):     # 0/NaN: NaN without a host read (or NumPy's warning) when every target is ignored
            return total / xp.where(ctx.count == 0, xp.asarray(xp.nan, ctx.count.dtype), ctx.count)
        if not bool(ctx.count):      # every target ignored: NaN, as torch's 0/0 (without NumPy's warning)
            return xp.full((), xp.nan, dtype=total.dtype)
        return total / ctx.count

    @staticmethod
    def backward(ctx, g):
        xp = get_array_module(g)
        if ctx.reduction == "none":
            scale = g.reshape(-1)
        elif ctx.reduction == "sum":
            scale = g
        else:
            # every target ignored: the loss is NaN but torch's gradient is zero (no row counts)
            count = ctx.count
            scale = g / xp.where(count == 0, xp.ones_like(count), count)
        gx = K.cross_entropy_backward(ctx.state, scale)
        return gx.reshape(ctx.lshape), None, None, None, None, None


def cross_entropy(input, target, weight=None, reduction: str = "mean", ignore_index: int = -100,  # noqa: A002
                  label_smoothing: float = 0.0) -> Tensor:
    """Cross-entropy of class scores ``input`` (N, C) or (..., C) against integer ``target``.

    Matches ``torch.nn.functional.cross_entropy``: targets equal to ``ignore_index`` contribute
    nothing; ``"mean"`` divides by the summed class weight of the counted targets (their number
    without ``weight``), NaN loss with zero gradients if every target is ignored.  A target
    outside ``[0, C)`` (other than ``ignore_index``) raises ``IndexError``, as torch does, rather
    than wrapping around.  Host targets are copied to the device of GPU logits.

    Args:
        input: logits, the class axis last (PyTorch's (N, C) layout; (..., C) is flattened).
        target: integer class indices of shape ``input.shape[:-1]`` (Tensor, array or list).
        weight: optional per-class weights (C,), a constant (no gradient flows to it).
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        ignore_index: target value that contributes no loss and no gradient.
        label_smoothing: ``e`` in [0, 1]: the target is ``(1-e)`` one-hot plus ``e/C`` uniform.

    Example:
        >>> round(cross_entropy(Tensor([[0.0, 0.0]]), [1]).item(), 4)
        0.6931
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    logits = input
    if isinstance(target, Tensor):
        target = target.data
    if not hasattr(target, "dtype"):
        target = np.asarray(target)
    if target.dtype.kind not in "iu":
        raise TypeError(f"cross_entropy targets must be integer class indices, got dtype {target.dtype}")
    lshape = logits.shape
    if tuple(target.shape) != tuple(lshape[:-1]):
        raise ValueError(f"target shape {tuple(target.shape)} does not match logits shape {tuple(lshape)}")
    c = lshape[-1]
    poison = None
    if checks_on_device(get_array_module(logits.data if isinstance(logits, Tensor) else logits)):
        xp = get_array_module(target)   # no host sync: an out-of-range target gives a NaN loss
        if xp is np:                    # (the CuPy kernel does the same itself)
            bad = ((target < 0) | (target >= c)) & (target != ignore_index)
            target = np.where(bad, 0, target)
            poison = np.where(bad if reduction == "none" else bad.any(), np.nan, 0.0)
    elif get_array_module(target) is np:
        _check_targets(target, c, ignore_index, "cross_entropy")
    if weight is not None:
        weight = weight.data if isinstance(weight, Tensor) else weight
        if tuple(getattr(weight, "shape", np.shape(weight))) != (c,):
            raise ValueError(f"cross_entropy weight must have shape ({c},) (one per class), "
                             f"got {tuple(np.shape(weight))}")
    out = CrossEntropy.apply(logits, target, reduction, ignore_index, weight, float(label_smoothing))
    if poison is not None:
        out = out + Tensor._wrap(poison.astype(out.data.dtype))
    return out


def _check_targets(target, num_classes: int, ignore_index: int, where: str, rank: str = "") -> None:
    """Raise ``IndexError`` naming the first target outside ``[0, num_classes)`` that is not ignored."""
    if not target.size:
        return
    xp = get_array_module(target)
    bad = ((target < 0) | (target >= num_classes)) & (target != ignore_index)
    if bool(bad.any()):
        value = int(target.reshape(-1)[xp.argmax(bad.reshape(-1))])
        raise IndexError(f"{rank}{where}: target {value} is out of bounds for {num_classes} classes "
                         f"(expected 0..{num_classes - 1}, or ignore_index={ignore_index} to skip it); "
                         f"negative targets do not wrap around as in NumPy indexing")


class MSELoss(Function):
    _fresh_grads = True

    @staticmethod
    def forward(ctx, a, b, reduction):
        d = a - b
        ctx.save_for_backward(d)
        ctx.sa, ctx.sb, ctx.reduction = _shape(a), _shape(b), reduction
        sq = d * d
        if reduction == "none":
            return sq
        return sq.sum() if reduction == "sum" else sq.mean()

    @staticmethod
    def backward(ctx, g):
        (d,) = ctx.saved_tensors
        scale = 2.0 / d.size if ctx.reduction == "mean" else 2.0
        gd = (g * scale) * d
        n = ctx.needs_input_grad
        return (_unbroadcast(gd, ctx.sa) if n[0] else None,
                _unbroadcast(-gd, ctx.sb) if n[1] else None, None)


def mse_loss(input, target, reduction: str = "mean") -> Tensor:  # noqa: A002
    """Mean squared error (``"mean"``, ``"sum"`` or ``"none"``)."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    return MSELoss.apply(input, target, reduction)
