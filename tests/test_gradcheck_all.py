"""Every ``Function`` in ``axonmpi.autograd`` is checked against central finite differences in float64.

The ops are discovered (``Function.__subclasses__()`` recursively, after importing every module of
the package), and ``CASES`` maps each one to its checks: a new op without an entry fails
``test_every_function_has_a_gradcheck_case``, so no op can skip its gradcheck.
"""
import importlib
import pkgutil

import numpy as np
import pytest

import axonmpi
import axonmpi.autograd
from axonmpi.autograd import Function, Tensor, gradcheck, ops
from axonmpi.autograd import ops_nn as F
from axonmpi.autograd import ops_llama as F_llama

RNG = np.random.default_rng(2024)


def _t(*shape, positive=False, away_from=None):
    a = RNG.standard_normal(shape)
    if positive:
        a = np.abs(a) + 0.5
    if away_from is not None:  # keep finite differences off kinks (relu at 0, clamp bounds)
        for k in away_from:
            a = np.where(np.abs(a - k) < 0.05, a + 0.2, a)
    return lambda: Tensor(a.copy(), requires_grad=True, dtype=np.float64)


def _int(*vals):
    return np.array(vals)


def _dropout(a):
    axonmpi.manual_seed(3)  # the same mask on every evaluation
    return F.dropout(a, 0.3)


def _dropout_add(a, r):
    axonmpi.manual_seed(3)
    return F.dropout_add(a, r, 0.3)


_TARGET = _int(1, -100, 0, 2)
_ANGLE = np.arange(3)[:, None, None] * np.array([1.0, 0.3, 0.05, 1.0, 0.3, 0.05])   # (T, 1, head_dim)
_COS, _SIN = np.cos(_ANGLE), np.sin(_ANGLE)
_FLOAT_MASK = RNG.standard_normal((2, 1, 3, 3))

# Function (module.Class) -> [(case id, function of the inputs, input factories[, gradcheck options])]
CASES = {
    "ops.Add": [("add_bcast", lambda a, b: a + b, [_t(3, 1, 4), _t(5, 1)]),
                ("add_method_scalar", lambda a: a.add(2.5), [_t(3)])],
    "ops.Sub": [("sub", lambda a, b: a.sub(b), [_t(2, 3), _t(3)]), ("rsub", lambda a: 1.0 - a, [_t(4)])],
    "ops.Mul": [("mul", lambda a, b: a.mul(b), [_t(2, 1, 3), _t(1, 4, 1)]),
                ("square", lambda a: a.square(), [_t(3)])],
    "ops.Div": [("div", lambda a, b: a.div(b), [_t(3, 4), _t(4, positive=True)]),
                ("reciprocal", lambda a: a.reciprocal(), [_t(3, positive=True)])],
    "ops.Pow": [("pow_method", lambda a: a.pow(3), [_t(3, 2)]),
                ("pow_tensor", lambda a, b: a ** b, [_t(3, 2, positive=True), _t(2)]),
                ("rsqrt", lambda a: a.rsqrt(), [_t(4, positive=True)])],
    "ops.Neg": [("neg", lambda a: a.neg(), [_t(2, 3)])],
    "ops.MatMul": [("mm", lambda a, b: a.matmul(b), [_t(3, 4), _t(4, 5)]),
                   ("vec_vec", lambda a, b: a @ b, [_t(4), _t(4)]),
                   ("vec_mat", lambda a, b: a @ b, [_t(4), _t(4, 3)]),
                   ("mat_vec", lambda a, b: a @ b, [_t(3, 4), _t(4)]),
                   ("batched_vec", lambda a, b: a @ b, [_t(2, 3, 4), _t(4)]),
                   ("vec_batched", lambda a, b: a @ b, [_t(4), _t(2, 4, 3)]),
                   ("batch_bcast", lambda a, b: a @ b, [_t(2, 1, 3, 4), _t(3, 4, 2)])],
    "ops_reduce.Sum": [("sum_dim", lambda a: a.sum(dim=(0, 2), keepdim=True), [_t(2, 3, 4)]),
                       ("sum_all", lambda a: a.sum(), [_t(3, 4)])],
    "ops_reduce.Mean": [("mean_dim", lambda a: a.mean(dim=1), [_t(2, 3, 4)])],
    "ops_reduce.Extreme": [("max_all", lambda a: a.max(), [_t(3, 3)]),
                           ("amin_dims", lambda a: a.amin(dim=(0, 1), keepdim=True), [_t(3, 4, 2)])],
    "ops_reduce.ExtremeDim": [("max_dim", lambda a: a.max(dim=1).values, [_t(3, 5)]),
                              ("min_dim_keep", lambda a: a.min(0, keepdim=True)[0], [_t(4, 3)])],
    "ops_reduce.Var": [("var_dim", lambda a: a.var(dim=1), [_t(3, 5)]),
                       ("std_biased", lambda a: a.std(correction=0), [_t(3, 5)])],
    "ops.Reshape": [("view", lambda a: a.view(4, -1), [_t(2, 3, 2)]),
                    ("flatten", lambda a: a.flatten(1), [_t(2, 3, 2)]),
                    ("unsqueeze_squeeze", lambda a: a.unsqueeze(1).squeeze(), [_t(3, 4)])],
    "ops.Permute": [("permute", lambda a: a.permute(1, 2, 0), [_t(2, 3, 4)]),
                    ("transpose", lambda a: a.transpose(0, 2), [_t(2, 3, 4)]), ("t", lambda a: a.t(), [_t(2, 3)])],
    "ops.Expand": [("expand", lambda a: a.expand(2, 3, 4), [_t(3, 1)])],
    "ops.GetItem": [("slice", lambda a: a[1:, ::2, None], [_t(3, 5)]),
                    ("repeated_index", lambda a: a[np.array([0, 2, 0, 0])], [_t(3, 2)])],
    "ops.Concat": [("cat", lambda a, b: ops.cat([a, b, a], dim=1), [_t(2, 3), _t(2, 1)])],
    "ops.Stack": [("stack", lambda a, b: ops.stack([a, b], dim=1), [_t(2, 3), _t(2, 3)])],
    "ops.Split": [("split", lambda a: a.split([1, 3], dim=1), [_t(2, 4)]),
                  ("chunk", lambda a: a.chunk(3, dim=-1), [_t(2, 7)])],
    "ops.Where": [("where", lambda a, b: ops.where(np.array([[True], [False]]), a, b), [_t(2, 3), _t(3)]),
                  ("where_method", lambda a: a.where(Tensor(np.array([True, False, True])), 0.5), [_t(2, 3)])],
    "ops_math.Exp": [("exp", lambda a: a.exp(), [_t(3, 4)])],
    "ops_select._TopK": [("topk_last", lambda a: a.topk(3).values, [_t(4, 6)]),
                         ("topk_dim0_smallest", lambda a: axonmpi.topk(a, 2, dim=0, largest=False).values,
                          [_t(5, 3)]),
                         ("topk_unsorted", lambda a: a.topk(2, sorted=False)[0] * 1.0, [_t(2, 3, 4)])],
    "ops_select._Tri": [("tril_neg1", lambda a: a.tril(-1), [_t(4, 4)]),
                        ("triu_batched", lambda a: axonmpi.triu(a, 1), [_t(2, 3, 5)])],
    "ops_math.Log": [("log", lambda a: a.log(), [_t(3, 4, positive=True)])],
    "ops_math.Sqrt": [("sqrt", lambda a: a.sqrt(), [_t(3, 4, positive=True)])],
    "ops_math.Tanh": [("tanh", lambda a: a.tanh(), [_t(3, 4)])],
    "ops_math.Abs": [("abs", lambda a: a.abs(), [_t(3, 4, away_from=[0])])],
    "ops_math.Sin": [("sin", lambda a: a.sin(), [_t(3, 4)])],
    "ops_math.Cos": [("cos", lambda a: a.cos(), [_t(3, 4)])],
    "ops_math.Clamp": [("clamp", lambda a: a.clamp(-0.5, 0.5), [_t(4, 5, away_from=[-0.5, 0.5])]),
                  ("clamp_min", lambda a: a.clamp(min=0.1), [_t(6, away_from=[0.1])])],
    "ops_math._Pairwise": [("maximum", lambda a, b: a.maximum(b), [_t(3, 4), _t(4)]),
                      ("minimum", lambda a, b: ops.minimum(a, b), [_t(3, 1), _t(1, 4)])],
    "ops.Cast": [("cast_same_dtype", lambda a: ops.cast(a, np.float64) * a, [_t(3)]),
                 # through float32: the step must dwarf float32 rounding (the map is linear)
                 ("float_double", lambda a: a.float().double() * 3.0, [_t(2, 2)],
                  dict(eps=1e-1, atol=1e-5, rtol=1e-5))],
    "ops.ToDevice": [("to_device", lambda a: ops.to_device(a, "cpu") * 2.0, [_t(3, 2)])],
    "ops.Clone": [("clone", lambda a: a.clone() * a, [_t(3)])],
    "ops_nn.Linear": [("linear", lambda x, w, b: F.linear(x, w, b), [_t(2, 3, 4), _t(5, 4), _t(5)]),
                      ("linear_nobias", lambda x, w: F.linear(x, w), [_t(3, 4), _t(2, 4)])],
    "ops_nn.ReLU": [("relu_method", lambda a: a.relu(), [_t(3, 4, away_from=[0])])],
    "ops_nn.Sigmoid": [("sigmoid_method", lambda a: a.sigmoid(), [_t(3, 4)])],
    "ops_nn.SiLU": [("silu", F.silu, [_t(3, 4)])],
    "ops_nn.GELU": [("gelu", F.gelu, [_t(3, 4)]), ("gelu_tanh", lambda a: F.gelu(a, "tanh"), [_t(3, 4)])],
    "ops_nn.Softmax": [("softmax_method", lambda a: a.softmax(dim=0), [_t(3, 4)]),
                       ("softmax_last", lambda a: a.softmax(dim=-1), [_t(2, 3, 4)])],
    "ops_nn.LogSoftmax": [("log_softmax_method", lambda a: a.log_softmax(dim=-1), [_t(3, 4)])],
    "ops_nn.LayerNorm": [("layer_norm", lambda x, w, b: F.layer_norm(x, 4, w, b), [_t(2, 3, 4), _t(4), _t(4)]),
                         ("layer_norm_2d_noaffine", lambda x: F.layer_norm(x, (3, 4)), [_t(2, 3, 4)])],
    "ops_nn.ScaledDotProductAttention": [
        ("sdpa_causal", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
         [_t(2, 2, 4, 3), _t(2, 2, 4, 3), _t(2, 2, 4, 5)]),
        ("sdpa_causal_blocks", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
         [_t(1, 130, 3), _t(1, 129, 3), _t(2, 1, 129, 2)]),
        ("grouped_causal_stacked", lambda q, k, v: F.grouped_causal_attention(q, k, v, 2),
         [_t(1, 2, 6, 3), _t(1, 2, 3, 3), _t(1, 2, 3, 2)]),
        ("sdpa_bool_mask_scale", lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=np.array([[True, False, True], [True, True, False]]), scale=0.7),
         [_t(3, 2, 4), _t(3, 3, 4), _t(3, 3, 2)]),
        ("sdpa_float_mask_bcast", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=_FLOAT_MASK), [_t(2, 2, 3, 4), _t(1, 2, 3, 4), _t(2, 2, 3, 4)]),
        ("sdpa_dropout", lambda q, k, v: (axonmpi.manual_seed(5), F.scaled_dot_product_attention(
            q, k, v, dropout_p=0.3, is_causal=True))[1], [_t(2, 5, 3), _t(2, 5, 3), _t(2, 5, 3)])],
    "ops_llama.RMSNorm": [("rms_norm", lambda x, w: F_llama.rms_norm(x, 4, w, eps=1e-3), [_t(2, 3, 4), _t(4)]),
                          ("rms_norm_2d_noweight", lambda x: F_llama.rms_norm(x, (3, 4)), [_t(2, 3, 4)])],
    "ops_llama.Rotary": [("rotary", lambda x: F_llama.apply_rotary_emb(x, _COS, _SIN), [_t(2, 3, 2, 6)])],
    "ops_llama.SwiGLU": [("swiglu", F_llama.swiglu, [_t(3, 4), _t(3, 4)])],
    "ops_nn.Embedding": [("embedding", lambda w: F.embedding([[1, 1], [0, 3]], w), [_t(4, 3)])],
    "ops_nn.Dropout": [("dropout", _dropout, [_t(4, 5)])],
    "ops_nn.DropoutAdd": [("dropout_add", _dropout_add, [_t(4, 5), _t(4, 5)])],
    "ops_nn.MaskedFill": [("masked_fill_method", lambda a: a.masked_fill(Tensor(np.array([True, False, True])), -2.0),
                           [_t(2, 3)])],
    "ops_nn.CrossEntropy": [("cross_entropy", lambda a: F.cross_entropy(a, _TARGET), [_t(4, 3)]),
                            ("cross_entropy_none", lambda a: F.cross_entropy(a, _TARGET, reduction="none"),
                             [_t(4, 3)])],
    "ops_nn.MSELoss": [("mse", F.mse_loss, [_t(3, 4), _t(3, 4)]),
                       ("mse_sum_bcast", lambda a, b: F.mse_loss(a, b, reduction="sum"), [_t(3, 4), _t(4)])],
}


def _functions():
    """Every Function subclass defined in axonmpi.autograd, as ``module.Class``."""
    for info in pkgutil.iter_modules(axonmpi.autograd.__path__):
        importlib.import_module(f"axonmpi.autograd.{info.name}")
    found, stack = {}, list(Function.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls.__module__.startswith("axonmpi.autograd."):
            found[f"{cls.__module__.rsplit('.', 1)[1]}.{cls.__name__}"] = cls
    return found


def test_every_function_has_a_gradcheck_case():
    found = _functions()
    missing = sorted(set(found) - set(CASES))
    assert not missing, f"Functions without a gradcheck case in tests/test_gradcheck_all.py: {missing}"
    stale = sorted(set(CASES) - set(found))
    assert not stale, f"gradcheck cases for Functions that no longer exist: {stale}"


PARAMS = [(op, c[0], c[1], c[2], c[3] if len(c) > 3 else {}) for op, cases in CASES.items() for c in cases]


@pytest.mark.parametrize("op,cid,fn,makers,opts", PARAMS, ids=[f"{p[0]}:{p[1]}" for p in PARAMS])
def test_gradcheck(op, cid, fn, makers, opts):
    inputs = [m() for m in makers]
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    nodes = {type(o.grad_fn).__name__ for o in outs if o.grad_fn is not None}
    seen, stack = set(), [o.grad_fn for o in outs if o.grad_fn is not None]
    while stack:  # the case really runs the op it is filed under
        node = stack.pop()
        seen.add(type(node).__name__)
        stack.extend(e[0] for e in node._edges if e is not None and e[1] >= 0)
    assert op.split(".")[1] in seen | nodes, f"case {cid} does not use {op} (graph has {sorted(seen)})"
    assert gradcheck(fn, inputs, **{"eps": 1e-6, "atol": 1e-7, "rtol": 1e-5, **opts})
