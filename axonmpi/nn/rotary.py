"""Rotary position embedding tables (RoPE), with Llama 3's frequency scaling as an option.

[Note: rotary layout and precision]
The tables follow transformers' Llama (``LlamaRotaryEmbedding``): ``inv_freq[i] = theta ** (-2i / d)``
for ``i < d / 2``, ``angle = position * inv_freq``, and ``cos = [cos(angle), cos(angle)]`` (the two
halves equal), so dimension ``i`` of a head rotates with dimension ``i + d / 2``
(:func:`~axonmpi.nn.functional.apply_rotary_emb`). Weights in transformers' Llama layout therefore
need no q/k permutation here (Meta's original checkpoints interleave the pairs; transformers'
conversion script permutes them once, into this layout).  The frequencies and angles are computed in
float64 on every dtype and cast at the end (transformers computes them in float32), so a float64
model is float64-exact and the positions of a long sequence keep their precision in float32.
Positions are explicit: a caller that feeds a subset of a sequence's tokens (context parallelism)
passes each token's global position.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import numpy as np

from ..autograd.tensor import Tensor
from ..backend import get_array_module
from .module import Module

__all__ = ["RotaryEmbedding", "rope_inv_freq", "check_rope_scaling"]

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_rope_scaling(scaling: Optional[Dict[str, Any]], where: str = "rope_scaling") -> Optional[Dict[str, Any]]:
    """``scaling`` as a plain dict with ``rope_type`` (transformers' ``rope_scaling`` / ``rope_parameters``;
    the old key ``type`` is read as ``rope_type``), or ``None`` for unscaled RoPE.

    Built: ``"default"`` (none), ``"linear"`` (``factor``: positions divided by it) and ``"llama3"``
    (``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).
    Other types (``"dynamic"``, ``"yarn"``, ``"longrope"``, ...) raise ``NotImplementedError``.
    """
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise TypeError(f"{where} must be a dict such as {{'rope_type': 'llama3', 'factor': 8.0, ...}} or None, "
                        f"got {type(scaling).__name__}")
    s = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
    kind = s.pop("rope_type", s.pop("type", "default"))
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError(f"{where}: partial_rotary_factor={scaling['partial_rotary_factor']} (rotating part "
                                  "of each head) is not built; every dimension of a head is rotated")
    if kind == "default":
        return None if not s else _unknown(where, kind, s, ())
    if kind == "linear":
        _unknown(where, kind, s, ("factor",))
        return {"rope_type": "linear", "factor": _positive(where, "factor", s)}
    if kind == "llama3":
        _unknown(where, kind, s, _LLAMA3_KEYS)
        out = {"rope_type": "llama3"}
        for k in _LLAMA3_KEYS:
            out[k] = _positive(where, k, s)
        out["original_max_position_embeddings"] = int(out["original_max_position_embeddings"])
        if out["high_freq_factor"] <= out["low_freq_factor"]:
            raise ValueError(f"{where}: llama3 needs high_freq_factor > low_freq_factor, got "
                             f"{out['high_freq_factor']} and {out['low_freq_factor']}")
        return out
    raise NotImplementedError(f"{where}: rope_type={kind!r} is not built; the rotary scalings built are "
                              "'default', 'linear' and 'llama3'")


def _unknown(where, kind, s, allowed):
    extra = sorted(set(s) - set(allowed))
    if extra:
        raise ValueError(f"{where}: unknown keys {extra} for rope_type={kind!r} (expected {list(allowed)})")


def _positive(where, key, s) -> float:
    if key not in s:
        raise ValueError(f"{where}: rope_type={s.get('rope_type', '?')!r} needs {key!r}")
    v = float(s[key])
    if not v > 0:
        raise ValueError(f"{where}: {key} must be > 0, got {s[key]!r}")
    return v


def rope_inv_freq(head_dim: int, theta: float = 10000.0, scaling: Optional[Dict[str, Any]] = None) -> np.ndarray:
    """The ``head_dim / 2`` inverse frequencies ``theta ** (-2i / head_dim)`` (float64, host), scaled as
    ``scaling`` says (:func:`check_rope_scaling`; ``"llama3"``: transformers' ``rope_type="llama3"``:
    wavelengths above ``original_max_position_embeddings / low_freq_factor`` divided by ``factor``,
    below ``... / high_freq_factor`` kept, smoothly interpolated between).

    Example:
        >>> rope_inv_freq(4, theta=100.0).tolist()
        [1.0, 0.1]
    """
    head_dim = int(head_dim)
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rope_inv_freq: head_dim must be a positive even int, got {head_dim}")
    if not float(theta) > 0:
        raise ValueError(f"rope_inv_freq: theta must be > 0, got {theta!r}")
    inv = 1.0 / (float(theta) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    s = check_rope_scaling(scaling)
    if s is None:
        return inv
    if s["rope_type"] == "linear":
        return inv / s["factor"]
    factor, lo, hi, old = (s[k] for k in _LLAMA3_KEYS)
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old / lo, old / hi
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled)


class RotaryEmbedding(Module):
    """The cos / sin tables of rotary position embedding for given positions (no parameters; nothing in
    ``state_dict``, as transformers' non-persistent ``inv_freq``).

    Args:
        head_dim: the rotated width (even).
        theta: the base (``rope_theta``; Llama 2: 10000, Llama 3: 500000).
        scaling: ``None``, or transformers' ``rope_scaling`` dict: ``{"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}``
            or ``{"rope_type": "linear", "factor": f}``.

    ``forward(x, positions=None)`` returns ``(cos, sin)``, arrays of shape ``positions.shape + (head_dim,)``
    in ``x``'s dtype on ``x``'s device; ``positions`` (integers, ``(T,)`` or ``(B, T)``, transformers'
    ``position_ids``) default to ``0 .. x.shape[1] - 1``.

    Example:
        >>> rope = RotaryEmbedding(16, theta=500000.0)
        >>> cos, sin = rope(x, positions=np.arange(8, 16))     # tokens 8..15 of a sequence
        >>> cos.shape
        (8, 16)
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, scaling: Optional[Dict[str, Any]] = None):
        super().__init__()
        self.head_dim, self.theta = int(head_dim), float(theta)
        self.scaling = check_rope_scaling(scaling)
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)   # host float64, not a buffer

    def forward(self, x, positions=None) -> Tuple[Any, Any]:
        a = x.data if isinstance(x, Tensor) else x
        xp = get_array_module(a)
        if positions is None:
            if a.ndim < 2:
                raise ValueError(f"RotaryEmbedding: x of shape {tuple(a.shape)} has no sequence dimension (1); "
                                 "pass positions=")
            positions = xp.arange(a.shape[1])
        p = positions.data if isinstance(positions, Tensor) else xp.asarray(positions)
        if p.dtype.kind not in "iu":
            raise TypeError(f"RotaryEmbedding: positions must be integers, got dtype {p.dtype}")
        angle = p[..., None].astype(np.float64) * xp.asarray(self.inv_freq)
        angle = xp.concatenate([angle, angle], axis=-1)
        dtype = a.dtype if a.dtype.kind == "f" else np.float32
        return xp.cos(angle).astype(dtype, copy=False), xp.sin(angle).astype(dtype, copy=False)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, scaling={self.scaling}"
