"""dtype rules as PyTorch's: a layer computes in its weight's dtype and takes only input of that dtype. A float32
Linear / LayerNorm / F.linear given float64, float16 or integer input raises DtypeMismatchError (a TypeError and a
RuntimeError) naming the layer, both dtypes and the fix; torch raises on the same calls (checked where installed)."""
import numpy as np
import pytest

import axonmpi
from axonmpi import Tensor, nn
from axonmpi.autograd.ops_nn import DtypeMismatchError
import axonmpi.nn.functional as F


@pytest.mark.serial
@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int64, np.int32])
def test_float32_linear_refuses_other_input_dtypes(dtype):
    lin = nn.Linear(3, 2)
    x = Tensor(np.ones((4, 3), dtype=dtype))
    with pytest.raises(DtypeMismatchError, match=r"Linear\(in_features=3, out_features=2, bias=True\) has float32 "
                                                 rf"weights but got input of dtype {np.dtype(dtype).name} \(shape \(4, 3\)\)"):
        lin(x)
    with pytest.raises(RuntimeError):          # what a ported `except RuntimeError` (torch's type) catches
        nn.Sequential(lin)(x)
    with pytest.raises(TypeError, match="linear has float32 weights"):
        F.linear(x, lin.weight, lin.bias)


@pytest.mark.serial
def test_the_message_names_the_fix():
    lin = nn.Linear(3, 2)
    with pytest.raises(TypeError, match=r"cast the input \(x.to\(float32\), x.float\(\)\) or the layer"):
        lin(Tensor(np.ones((1, 3))))
    with pytest.raises(TypeError, match="integer input is never promoted: cast it"):
        lin(Tensor(np.ones((1, 3), dtype=np.int64)))
    with pytest.raises(TypeError, match=r"LayerNorm\(\(3,\).* has float32 weights but got input of dtype float64"):
        nn.LayerNorm(3)(Tensor(np.ones((2, 3))))


@pytest.mark.serial
def test_matching_dtypes_compute_in_that_dtype():
    lin = nn.Linear(3, 2)
    assert lin(Tensor([[1.0, 2.0, 3.0]])).dtype == np.float32           # a Python list: float32, the default
    assert lin.double()(Tensor(np.ones((1, 3)))).dtype == np.float64     # float64 model, float64 input
    assert nn.Linear(3, 2, dtype=np.float64)(Tensor(np.ones((1, 3)))).dtype == np.float64
    assert nn.LayerNorm(3, dtype=np.float64)(Tensor(np.ones((2, 3)))).dtype == np.float64
    emb = nn.Embedding(5, 3)
    assert emb(Tensor(np.array([1, 4]))).dtype == np.float32             # integer indices are what Embedding takes


@pytest.mark.serial
def test_torch_raises_on_the_same_calls():
    torch = pytest.importorskip("torch")
    lin = torch.nn.Linear(3, 2)
    for dtype in (torch.float64, torch.int64):
        with pytest.raises(RuntimeError):
            lin(torch.ones((4, 3), dtype=dtype))
    with pytest.raises(RuntimeError):
        torch.nn.LayerNorm(3)(torch.ones((2, 3), dtype=torch.float64))


@pytest.mark.serial
def test_16_bit_layers_take_wider_float_input_as_mixed_precision_needs():
    from axonmpi.autograd.ops_nn import dtype_refused
    f16, f32, f64, i64 = (np.dtype(t) for t in ("float16", "float32", "float64", "int64"))
    assert dtype_refused(f64, f32) and dtype_refused(f32, f64) and dtype_refused(f16, f32) and dtype_refused(i64, f16)
    assert not dtype_refused(f32, f16) and not dtype_refused(f32, f32)
    lin = nn.Linear(3, 2).to(np.float16)
    assert lin(Tensor(np.ones((1, 3), np.float32))).dtype == np.float32     # computed in the wider dtype
    with pytest.raises(DtypeMismatchError, match="integer input is never promoted"):
        lin(Tensor(np.ones((1, 3), np.int64)))
