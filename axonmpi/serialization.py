"""``axonmpi.save`` / ``axonmpi.load``: PyTorch's ``torch.save`` / ``torch.load`` for state dicts, in HDF5.

What is saved: nested ``dict``s (str or int keys: a model's ``state_dict()``, an optimizer's
``state_dict()`` with its int parameter ids, a dict of both plus an epoch), ``list``s and
``tuple``s, arrays (NumPy, CuPy) and Tensors, and plain values (``int``, ``float``, ``bool``,
``str``, ``None``). Each array is one HDF5 dataset (bfloat16 kept as its 16 bits); the tree's
shape is a JSON attribute. Nothing is pickled, so loading never runs code: ``weights_only=True``
holds always. Other objects raise ``TypeError`` naming where they sit in the tree.

The file is written to ``<name>.tmp`` and renamed when complete, so a crash leaves any earlier
file whole. ``f`` may also be a binary file object (``io.BytesIO``).

``load`` gives arrays back as they were saved: NumPy arrays as NumPy arrays (state dicts hold
host arrays here), Tensors as Tensors. ``map_location`` is accepted in torch's forms: ``None``
or ``"cpu"`` (host), a device (``"cuda:1"``, ``axonmpi.device(...)``, an int), a dict
``{saved: target}`` of device strings (``{"cuda:0": "cuda:1"}``; a location not in it stays),
or a callable ``(array, saved_location) -> array``.

Example:
    >>> axonmpi.save(model.state_dict(), "model.h5")
    >>> model.load_state_dict(axonmpi.load("model.h5", map_location="cpu", weights_only=True))
"""
from __future__ import annotations

import io
import json
import os
from typing import Any

import numpy as np

from . import backend as _be

__all__ = ["save", "load"]

_FORMAT = "axonmpi.save/1"


def _is_tensor(x) -> bool:
    from .autograd import Tensor
    return isinstance(x, Tensor)


def _encode(obj, path, arrays):
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise TypeError(f"axonmpi.save: key {k!r} at {path or '<root>'} is a {type(k).__name__}; "
                                "keys must be str or int")
            items.append([k, _encode(v, f"{path}[{k!r}]", arrays)])
        return {"t": "dict", "items": items}
    if isinstance(obj, (list, tuple)):
        return {"t": type(obj).__name__, "items": [_encode(v, f"{path}[{i}]", arrays) for i, v in enumerate(obj)]}
    if _is_tensor(obj) or isinstance(obj, np.ndarray) or _be.is_cupy_array(obj) or isinstance(obj, np.generic):
        tensor = _is_tensor(obj)
        arr = obj.data if tensor else obj
        loc = str(_be.device_of(arr))
        host = np.asarray(_be.to_host(arr))
        if host.ndim:                                   # ascontiguousarray would make a 0-d array 1-d
            host = np.ascontiguousarray(host)
        ref = f"a{len(arrays)}"
        arrays.append((ref, host))
        node = {"t": "tensor" if tensor else ("scalar" if isinstance(obj, np.generic) else "array"),
                "ref": ref, "loc": loc, "dtype": host.dtype.name}
        if tensor and obj.requires_grad:
            node["requires_grad"] = True
        return node
    if obj is None or isinstance(obj, (bool, int, float, str)):
        if isinstance(obj, float) and not np.isfinite(obj):
            return {"t": "float", "v": repr(obj)}
        return {"t": "value", "v": obj}
    raise TypeError(f"axonmpi.save: {path or '<root>'} is a {type(obj).__name__}; axonmpi.save stores dicts, "
                    "lists, tuples, arrays, Tensors and plain values (save the object's state_dict())")


def save(obj: Any, f, pickle_module=None, pickle_protocol=None, _use_new_zipfile_serialization=True) -> None:
    """Write ``obj`` (a state dict, or a tree of dicts/lists of arrays and values) to path or file ``f``.

    Args:
        obj: what to save (see the module notes).
        f: a path (``str`` / ``os.PathLike``) or a binary file object.
        pickle_module, pickle_protocol: torch's; accepted and ignored (nothing is pickled).
    """
    import h5py
    arrays = []
    tree = _encode(obj, "", arrays)

    def write(target):
        with h5py.File(target, "w") as h:
            h.attrs["format"] = _FORMAT
            h.attrs["tree"] = json.dumps(tree)
            for ref, a in arrays:
                if a.dtype.name == "bfloat16":
                    h.create_dataset(ref, data=a.view(np.uint16))
                elif a.dtype.kind in "biufc":
                    h.create_dataset(ref, data=a)
                else:
                    raise TypeError(f"axonmpi.save: arrays of dtype {a.dtype} are not supported (numeric only)")

    if isinstance(f, (str, os.PathLike)):
        path = os.fspath(f)
        tmp = path + ".tmp"
        write(tmp)
        os.replace(tmp, path)
    else:
        write(f)


def _target(map_location, loc):
    if map_location is None:
        return "cpu"
    if callable(map_location) and not isinstance(map_location, _be.Device):
        return map_location
    if isinstance(map_location, dict):
        return map_location.get(loc, "cpu" if loc == "cpu" else loc)
    return map_location


def _place(arr, map_location, loc):
    tgt = _target(map_location, loc)
    if callable(tgt) and not isinstance(tgt, (str, _be.Device)):
        out = tgt(arr, loc)
        return arr if out is None else out
    dev = _be.as_device(tgt)
    if dev.type == "cuda" and not _be.cupy_available():
        return arr       # a GPU location on a host without a GPU: the host (torch would refuse)
    return _be.to_device(arr, dev)


def _decode(node, h, map_location):
    t = node["t"]
    if t == "dict":
        return {k: _decode(v, h, map_location) for k, v in node["items"]}
    if t in ("list", "tuple"):
        items = [_decode(v, h, map_location) for v in node["items"]]
        return items if t == "list" else tuple(items)
    if t == "value":
        return node["v"]
    if t == "float":
        return float(node["v"])
    arr = h[node["ref"]][()]
    if node["dtype"] == "bfloat16":
        arr = arr.view(_be.np_dtype("bfloat16")) if hasattr(_be, "np_dtype") else arr.view(
            __import__("ml_dtypes").bfloat16)
    arr = np.asarray(arr)
    if t == "scalar":
        return arr[()]
    arr = _place(arr, map_location, node["loc"])
    if t == "tensor":
        from .autograd import Tensor
        out = Tensor._wrap(arr)
        if node.get("requires_grad"):
            out.requires_grad = True
        return out
    return arr


def load(f, map_location=None, pickle_module=None, *, weights_only: bool = True, mmap=None, **pickle_load_args):
    """Read what :func:`save` wrote to path or file ``f``.

    Args:
        f: a path or a binary file object.
        map_location: where arrays go (see the module notes); default the host.
        weights_only: torch's flag; always true here (nothing is unpickled), ``False`` is accepted.

    Raises:
        FileNotFoundError: ``f`` does not exist (its path named).
        ValueError: ``f`` is not a file :func:`save` wrote (e.g. a torch pickle), with what to do.
    """
    import h5py
    if isinstance(f, (str, os.PathLike)) and not os.path.exists(os.fspath(f)):
        raise FileNotFoundError(f"axonmpi.load: no file {os.fspath(f)!r}")
    try:
        h = h5py.File(f, "r")
    except OSError as e:
        raise ValueError(f"axonmpi.load: {f!r} is not an HDF5 file written by axonmpi.save ({e}); a file "
                         "torch.save wrote loads with torch.load, then pass its state dict "
                         "(tensors -> .numpy()) to load_state_dict") from None
    with h:
        if h.attrs.get("format") != _FORMAT:
            raise ValueError(f"axonmpi.load: {f!r} is HDF5 but not written by axonmpi.save (format "
                             f"{h.attrs.get('format')!r}); for checkpoints of axonmpi.checkpoint.save use "
                             "axonmpi.checkpoint.load")
        return _decode(json.loads(h.attrs["tree"]), h, map_location)
