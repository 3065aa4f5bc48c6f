"""The default random generator used for initialization and dropout (seedable, checkpointable).

This module holds the one piece of module-level mutable state in axonmpi besides the
current World: a NumPy ``Generator`` (PCG64) and, created lazily, a CuPy generator seeded
from the same seed.  ``manual_seed(s)`` makes weight initialization and dropout masks
reproducible; the generator starts seeded with 0, so every rank builds the same initial
weights unless told otherwise.

Example:
    >>> import axonmpi.random as R
    >>> R.manual_seed(1234)
    >>> state = R.get_rng_state()      # plain, JSON-able dict
    >>> a = R.default_generator().standard_normal(3)
    >>> R.set_rng_state(state)
    >>> b = R.default_generator().standard_normal(3)   # a == b
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Dict, Iterator, Optional

import numpy as np

from . import backend

__all__ = [
    "Generator",
    "cupy_generator",
    "default_generator",
    "fork_rng",
    "get_rng_state",
    "host_generator",
    "initial_seed",
    "manual_seed",
    "set_rng_state",
]

_DEFAULT_SEED = 0


class _RNGState:
    """Holder of the process-wide generators (one instance, ``_STATE``)."""

    __slots__ = ("seed", "numpy", "cupy")

    def __init__(self, seed: int):
        self.seed = int(seed)
        self.numpy = np.random.Generator(np.random.PCG64(self.seed))
        self.cupy = None  # created on first use, seeded from ``seed``


_STATE = _RNGState(_DEFAULT_SEED)


def manual_seed(seed: int) -> None:
    """Reseed the default generator(s) with ``seed`` (a non-negative integer)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    _STATE.seed = int(seed)
    _STATE.numpy = np.random.Generator(np.random.PCG64(int(seed)))
    _STATE.cupy = None


def initial_seed() -> int:
    """The seed last passed to :func:`manual_seed` (0 by default)."""
    return _STATE.seed


def default_generator() -> np.random.Generator:
    """The process-wide NumPy generator (PCG64) used for init and CPU dropout."""
    return _STATE.numpy


def cupy_generator():
    """The process-wide CuPy generator (created lazily from the current seed); needs CuPy."""
    if _STATE.cupy is None:
        cp = backend.get_cupy()
        if cp is None:
            raise RuntimeError("cupy_generator() needs CuPy and a CUDA device")
        _STATE.cupy = cp.random.default_rng(_STATE.seed)
    return _STATE.cupy


class Generator:
    """PyTorch's ``torch.Generator``: a random stream of its own, for the ``generator=`` argument of
    ``randn``, ``rand``, ``randint``, ``randperm``, ``Tensor.normal_`` / ``uniform_`` and ``DataLoader``.

    It holds a NumPy PCG64 generator: the same seed gives the same numbers on every rank and run
    (not torch's numbers: torch's CPU generator is a Mersenne twister with its own transforms).

    Example:
        >>> g = Generator().manual_seed(42)
        >>> a = axonmpi.randn(2, 3, generator=g)
    """

    def __init__(self, device: Any = "cpu"):
        self.device = backend.Device(device) if not isinstance(device, backend.Device) else device
        self._seed = 67280421310721          # torch's default seed of a new Generator
        self._np = np.random.Generator(np.random.PCG64(self._seed))

    def manual_seed(self, seed: int) -> "Generator":
        """Reseed and return self (``torch.Generator().manual_seed(0)``)."""
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"Generator.manual_seed: seed must be an int, got {seed!r}")
        self._seed = int(seed) & 0xFFFFFFFFFFFFFFFF      # torch takes a negative seed modulo 2**64
        self._np = np.random.Generator(np.random.PCG64(self._seed))
        return self

    def seed(self) -> int:
        """Reseed from the operating system's entropy and return the new seed."""
        self.manual_seed(int(np.random.SeedSequence().entropy) & 0xFFFFFFFFFFFFFFFF)
        return self._seed

    def initial_seed(self) -> int:
        """The seed last set."""
        return self._seed

    def get_state(self) -> Dict[str, Any]:
        """The stream's state (a plain dict; ``set_state`` restores it)."""
        return {"seed": self._seed, "bit_generator": copy.deepcopy(self._np.bit_generator.state)}

    def set_state(self, state: Dict[str, Any]) -> "Generator":
        """Restore a state from :meth:`get_state`."""
        if not isinstance(state, dict) or "bit_generator" not in state:
            raise ValueError(f"Generator.set_state expects a dict from get_state(), got {type(state).__name__}")
        self._np.bit_generator.state = copy.deepcopy(state["bit_generator"])
        self._seed = int(state.get("seed", self._seed))
        return self

    @property
    def numpy(self) -> np.random.Generator:
        """The NumPy generator behind this stream."""
        return self._np

    def __repr__(self) -> str:
        return f"Generator(device='{self.device}', initial_seed={self._seed})"


def host_generator(generator: Optional["Generator"] = None) -> np.random.Generator:
    """The NumPy generator a host draw uses: ``generator``'s, or the default one when it is None."""
    if generator is None:
        return _STATE.numpy
    if isinstance(generator, Generator):
        return generator.numpy
    if isinstance(generator, np.random.Generator):
        return generator
    raise TypeError(f"generator must be an axonmpi.Generator (torch.Generator's counterpart), got "
                    f"{type(generator).__name__}")


def generator_for(xp) -> Any:
    """The default generator matching array module ``xp`` (numpy or cupy)."""
    return _STATE.numpy if xp is np else cupy_generator()


def get_rng_state() -> Dict[str, Any]:
    """Return the NumPy generator's state as a plain JSON-able dict (a deep copy).

    The CuPy generator's state is not included (it is re-created from the seed).
    """
    return {"seed": _STATE.seed, "bit_generator": copy.deepcopy(_STATE.numpy.bit_generator.state)}


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore a state returned by :func:`get_rng_state`."""
    if not isinstance(state, dict) or "bit_generator" not in state:
        raise ValueError(f"set_rng_state expects a dict from get_rng_state(), got {type(state).__name__}")
    bit = state["bit_generator"]
    if bit.get("bit_generator") != "PCG64":
        raise ValueError(f"unsupported bit generator {bit.get('bit_generator')!r}; expected 'PCG64'")
    gen = np.random.Generator(np.random.PCG64())
    gen.bit_generator.state = copy.deepcopy(bit)
    _STATE.numpy = gen
    _STATE.seed = int(state.get("seed", _STATE.seed))


@contextlib.contextmanager
def fork_rng(seed: Optional[int] = None) -> Iterator[None]:
    """Run a block with its own random stream and restore the previous state afterwards."""
    saved, saved_cupy = get_rng_state(), _STATE.cupy
    try:
        if seed is not None:
            manual_seed(seed)
        yield
    finally:
        set_rng_state(saved)
        _STATE.cupy = saved_cupy
