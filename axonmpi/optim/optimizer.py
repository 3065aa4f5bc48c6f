"""``Optimizer``: parameter groups, per-parameter state and PyTorch-format state dicts."""
from __future__ import annotations

import copy
import functools
import numbers
from typing import Any, Callable, Dict, Iterable, List, Optional

import numpy as np

from ..backend import get_array_module, to_host
from ..nn.parameter import local_arrays

__all__ = ["Optimizer", "state_dtype"]

# Elements per piece of the host update loop: 64 Ki float32 = 256 KiB per buffer, so
# parameter, gradient, state and scratch pieces stay in a 1 MiB L2 cache.
_HOST_CHUNK = 1 << 16


@functools.lru_cache(maxsize=None)
def _state_dtype(dt: np.dtype) -> np.dtype:
    if dt.kind == "f" and dt.itemsize < 4 or dt.name == "bfloat16":
        return np.dtype(np.float32)
    return dt


def state_dtype(param_dtype: Any) -> np.dtype:
    """dtype of optimizer state for a parameter: float32 for 16-bit floats, else the parameter's."""
    return _state_dtype(np.dtype(param_dtype))


def _check_param(p: Any) -> Any:
    data = getattr(p, "data", None)
    if data is None or not hasattr(data, "shape") or isinstance(p, np.ndarray):
        raise TypeError(f"optimizer parameters must be Tensors/Parameters with a .data array, "
                        f"got {type(p).__name__}")
    return p


class Optimizer:
    """Base class: holds ``param_groups`` and ``state`` and implements the bookkeeping.

    Subclasses pass their hyper-parameter ``defaults`` and implement
    ``_update_group(group)`` (the update of one group, under no-grad) and may extend
    ``_validate(options)``.

    Args:
        params: an iterable of parameters, or of dicts ``{"params": [...], **options}``
            (parameter groups with per-group options overriding ``defaults``).
        defaults: every option this optimizer understands, with its default value.

    Attributes:
        param_groups: list of dicts, each with ``"params"`` (a list) and all options.
        state: dict parameter -> dict of per-parameter state (``"step"``, buffers).
    """

    def __init__(self, params: Iterable[Any], defaults: Dict[str, Any]):
        if hasattr(params, "data") and hasattr(params, "grad") or isinstance(params, dict):
            raise TypeError(
                "params must be an iterable of parameters or of dicts (param groups), "
                f"got a single {type(params).__name__}; wrap it in a list"
            )
        self.defaults = dict(defaults)
        self._validate(self.defaults)
        self.param_groups: List[Dict[str, Any]] = []
        self.state: Dict[Any, Dict[str, Any]] = {}
        groups = list(params)
        if not groups:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for g in groups:
            self.add_param_group(g)

    # ------------------------------------------------------------------ options
    def _validate(self, options: Dict[str, Any]) -> None:
        """Raise ValueError naming a bad option value (subclasses extend this)."""
        lr = options.get("lr")
        if not isinstance(lr, numbers.Real) or isinstance(lr, bool) or not lr >= 0.0:
            raise ValueError(f"{type(self).__name__}: invalid learning rate lr={lr!r}; "
                             "expected a number >= 0")
        wd = options.get("weight_decay", 0.0)
        if not isinstance(wd, numbers.Real) or not wd >= 0.0:
            raise ValueError(f"{type(self).__name__}: invalid weight_decay={wd!r}; expected a number >= 0")

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a group ``{"params": [...], **options}``; missing options take the defaults."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        if "params" not in param_group:
            raise ValueError("param_group needs a 'params' entry")
        # LR schedulers keep these in each group (as PyTorch's do); they are not options.
        unknown = sorted(k for k in param_group
                         if k not in self.defaults and k not in ("params", *_SCHEDULER_KEYS))
        if unknown:
            raise TypeError(f"{type(self).__name__}: unknown option(s) {unknown} in param group; "
                            f"expected some of {sorted(self.defaults)}")
        params = param_group["params"]
        params = [params] if hasattr(params, "data") and hasattr(params, "grad") else list(params)
        for p in params:
            _check_param(p)
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter appears more than once in the same param group")
        existing = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) in existing for p in params):
            raise ValueError("some parameters appear in more than one parameter group")
        group = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}, "params": params}
        self._validate(group)
        self.param_groups.append(group)

    # ------------------------------------------------------------------ stepping
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients (``set_to_none=True``) or zero the gradient arrays in place."""
        for group in self.param_groups:
            for p in group["params"]:
                owner = getattr(p, "__dict__", {}).get("_local_owner")
                if owner is not None:       # its gradient is a piece of another buffer (an FSDP flat chunk)
                    owner[0].zero_piece_grad(owner[1])
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.data.fill(0)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Update every parameter that has a gradient; ``closure`` re-evaluates and returns the loss."""
        loss = None
        if closure is not None:
            from ..autograd.grad_mode import enable_grad

            with enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._update_group(group)
        return loss

    def _update_group(self, group: Dict[str, Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _update_group")

    # ------------------------------------------------------------------ hot-loop plumbing
    def _scratch(self, like: Any, n: int, count: int) -> List[Any]:
        """``count`` reusable 1-D buffers of ``n`` elements in ``like``'s state dtype, on its device."""
        xp = get_array_module(like)
        dt = state_dtype(like.dtype)
        key = (dt, None if xp is np else like.device.id)
        cache = self.__dict__.setdefault("_scratch_cache", {})
        bufs = cache.get(key)
        if bufs is None or len(bufs) < count or bufs[0].size < n:
            size = max(n, bufs[0].size if bufs else 0)
            bufs = cache[key] = [xp.empty(size, dtype=dt) for _ in range(max(count, len(bufs or ())))]
        return [b[:n] for b in bufs[:count]]

    def _chunks(self, arrays: List[Any], n_scratch: int) -> Iterable[List[Any]]:
        """Yield ``[views of arrays..., scratch buffers...]`` covering ``arrays[0]`` piece by piece.

        On the host the element-wise update runs over cache-sized pieces (``_HOST_CHUNK``
        elements), so its dozen passes hit L2 instead of main memory; on a GPU it is
        one piece. ``None`` entries (absent buffers) stay ``None``.
        """
        first = arrays[0]
        n = first.size
        flat = all(a is None or a.flags.c_contiguous for a in arrays)
        size = min(_HOST_CHUNK, n) if flat and isinstance(first, np.ndarray) else n
        scratch = self._scratch(first, size, n_scratch)
        if not flat:  # strided views: one piece in the parameter's own shape
            yield list(arrays) + [b.reshape(first.shape) for b in scratch]
            return
        flats = [None if a is None else a.reshape(-1) for a in arrays]
        if size == n:
            yield flats + scratch
            return
        for i in range(0, n, size):
            j = min(i + size, n)
            yield [None if f is None else f[i:j] for f in flats] + [b[:j - i] for b in scratch]

    # ------------------------------------------------------------------ state dicts
    def state_dict(self) -> Dict[str, Any]:
        """``{"state": {index: {...}}, "param_groups": [{..., "params": [indices]}]}`` (PyTorch's format).

        Parameters are numbered consecutively across groups; state arrays are copied
        to host NumPy arrays.
        """
        index: Dict[int, int] = {}
        groups = []
        for g in self.param_groups:
            ids = []
            for p in g["params"]:
                index.setdefault(id(p), len(index))
                ids.append(index[id(p)])
            groups.append({**copy.deepcopy({k: v for k, v in g.items() if k != "params"}), "params": ids})
        state = {}
        for g in self.param_groups:
            for p in g["params"]:
                if p in self.state:
                    state[index[id(p)]] = {
                        k: (to_host(v).copy() if hasattr(v, "shape") and getattr(v, "ndim", 0) > 0 else v)
                        for k, v in self.state[p].items()
                    }
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; arrays go to each parameter's device in its state dtype."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, "
                             f"this optimizer has {len(self.param_groups)}")
        for i, (sg, g) in enumerate(zip(saved_groups, self.param_groups)):
            if len(sg["params"]) != len(g["params"]):
                raise ValueError(f"parameter group {i}: loaded state dict has {len(sg['params'])} "
                                 f"parameters, this optimizer has {len(g['params'])}")
        by_index = {i: p for sg, g in zip(saved_groups, self.param_groups)
                    for i, p in zip(sg["params"], g["params"])}
        new_state: Dict[Any, Dict[str, Any]] = {}
        for key, pstate in state_dict["state"].items():
            p = by_index.get(int(key))
            if p is None:
                raise ValueError(f"loaded state dict has state for parameter index {key}, "
                                 "which no group lists")
            new_state[p] = {k: self._state_to_param(p, k, v) for k, v in pstate.items()}
        for sg, g in zip(saved_groups, self.param_groups):
            options = {k: copy.deepcopy(v) for k, v in sg.items() if k != "params"}
            self._validate({**g, **options})
            g.update(options)
        self.state = new_state

    @staticmethod
    def _state_to_param(p: Any, key: str, value: Any) -> Any:
        if key == "step":
            return int(np.asarray(to_host(value)).reshape(()))
        if not hasattr(value, "shape") or getattr(value, "ndim", 0) == 0:
            return value
        pd = local_arrays(p)[0]             # the piece the optimizer steps on this rank
        if tuple(value.shape) != tuple(pd.shape):
            raise ValueError(f"state {key!r} has shape {tuple(value.shape)}, "
                             f"its parameter's piece on this rank {tuple(pd.shape)}")
        xp = get_array_module(pd)
        dt = state_dtype(pd.dtype)
        if xp is np:
            return np.array(to_host(value), dtype=dt)  # always a private copy
        with pd.device:
            return xp.array(value, dtype=dt)

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} ("]
        for i, g in enumerate(self.param_groups):
            opts = ", ".join(f"{k}={v!r}" for k, v in g.items() if k != "params")
            lines.append(f"  group {i}: {len(g['params'])} params, {opts}")
        return "\n".join(lines + [")"])


_SCHEDULER_KEYS = ("initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum")  # OneCycleLR's
