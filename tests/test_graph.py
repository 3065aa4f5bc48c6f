"""autograd.graph: tensors in nested outputs and the leaves a backward can reach."""
import numpy as np
import pytest

from axonmpi import Tensor
from axonmpi.autograd.graph import reachable_leaves, tensors_in
from axonmpi.nn import Parameter


@pytest.mark.serial
def test_tensors_in_nested_structures():
    a, b, c = Tensor(np.ones(1)), Tensor(np.ones(2)), Tensor(np.ones(3))
    found = list(tensors_in({"x": (a, [b, 7]), "y": c, "z": "text"}))
    assert [t is s for t, s in zip(found, (a, b, c))] == [True, True, True]


@pytest.mark.serial
def test_reachable_leaves_follows_every_path_once():
    w, v, u = Parameter(np.ones(2)), Parameter(np.ones(2)), Parameter(np.ones(2))
    frozen = Tensor(np.ones(2))                       # does not require grad: never a leaf of the graph
    h = (w * frozen).tanh()
    out = (h * v).sum() + h.sum()                     # w reached twice, v once, u never
    assert reachable_leaves(out) == {id(w), id(v)}
    assert reachable_leaves((out, u)) == {id(w), id(v), id(u)}   # a leaf output counts
    assert reachable_leaves([frozen * 2]) == set()
