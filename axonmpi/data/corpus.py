"""A download-free text corpus (the Python standard library's own sources) and character-level tools."""
from __future__ import annotations

import os
import sysconfig
from typing import Any, Dict, Iterator, Optional, Sequence

import numpy as np

from .dataset import Dataset, _check_index

__all__ = ["CharDataset", "CharTokenizer", "load_stdlib_corpus", "unigram_entropy"]

# Directory names never read: test suites (large, repetitive, partly non-UTF-8 on purpose),
# caches and third-party packages (which differ between installations).
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages"})


def _stdlib_sources(root: str) -> Iterator[str]:
    """Yield the ``.py`` files under ``root`` in a deterministic order (sorted, depth first)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("test_"):
                yield os.path.join(dirpath, name)


def load_stdlib_corpus(max_bytes: int = 1 << 20, root: Optional[str] = None) -> str:
    """Return up to ``max_bytes`` of UTF-8 text made of the standard library's Python sources.

    Files are read in sorted order (file names within a directory, then its sorted
    subdirectories), skipping test directories and files that are not valid UTF-8,
    and joined with a newline; the last file is cut to fit the budget. The same
    Python installation always gives the same text.

    Args:
        max_bytes: size budget of the UTF-8 encoded result (> 0).
        root: directory to read instead of ``sysconfig.get_paths()["stdlib"]``.

    Returns:
        The corpus text.

    Example:
        >>> text = load_stdlib_corpus(64 * 1024)
        >>> len(text.encode()) <= 64 * 1024
        True
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
    root = root if root is not None else sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise FileNotFoundError(f"standard library source directory {root!r} does not exist")
    parts, used = [], 0
    for path in _stdlib_sources(root):
        limit = max_bytes - used
        with open(path, "rb") as f:
            raw = f.read(limit + 4)  # no need to read far past the budget
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as err:
            cut = len(raw) > limit and err.reason == "unexpected end of data"
            if not cut:  # a real encoding error, not a multi-byte character cut by the read
                continue
        chunk = raw[:limit]
        parts.append(chunk.decode("utf-8", errors="ignore"))  # drops only a cut character at the end
        used += len(chunk) + 1
        if used >= max_bytes:
            break
    if not parts:
        raise FileNotFoundError(f"no UTF-8 Python sources found under {root!r}")
    text = "\n".join(parts)
    return text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")


class CharTokenizer:
    """Character-level tokenizer with a sorted vocabulary (token id = rank of the character).

    Args:
        text: the characters to cover (usually the corpus itself).

    Example:
        >>> tok = CharTokenizer("hello")
        >>> tok.vocab_size, tok.decode(tok.encode("hole"))
        (4, 'hole')
    """

    def __init__(self, text: str):
        if not isinstance(text, str) or not text:
            raise ValueError("CharTokenizer needs a non-empty str to build its vocabulary")
        self.chars = sorted(set(text))
        # Unicode code points of the vocabulary, sorted, for vectorized lookup.
        self._codes = np.array([ord(c) for c in self.chars], dtype=np.uint32)

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters."""
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` as an int64 array; unknown characters raise ValueError."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        ids = np.searchsorted(self._codes, codes)
        ids_clipped = np.minimum(ids, len(self._codes) - 1)
        bad = self._codes[ids_clipped] != codes
        if bad.any():
            unknown = sorted({chr(c) for c in codes[bad][:1000]})
            raise ValueError(f"characters not in the vocabulary: {unknown[:20]!r}")
        return ids.astype(np.int64)

    def decode(self, ids: Any) -> str:
        """The text of token ids (any integer array-like, host or device)."""
        ids = np.asarray(ids.get() if hasattr(ids, "get") else ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), "
                             f"got range [{ids.min()}, {ids.max()}]")
        return self._codes[ids].tobytes().decode("utf-32-le")

    def state_dict(self) -> Dict[str, Any]:
        """``{"chars": [...]}``: enough to rebuild the tokenizer with :meth:`from_state_dict`."""
        return {"chars": list(self.chars)}

    @classmethod
    def from_state_dict(cls, state: Dict[str, Any]) -> "CharTokenizer":
        """Rebuild a tokenizer saved with :meth:`state_dict`."""
        chars = list(state["chars"])
        if chars != sorted(set(chars)):
            raise ValueError("tokenizer state: 'chars' must be sorted and distinct")
        return cls("".join(chars))


class CharDataset(Dataset):
    """Next-token windows: sample ``i`` is ``(tokens[i:i+T], tokens[i+1:i+T+1])`` as int64.

    Args:
        tokens: 1-D integer token array.
        block_size: window length ``T`` (>= 1, < len(tokens)).

    Example:
        >>> x, y = CharDataset(np.arange(10), 4)[2]
        >>> x.tolist(), y.tolist()
        ([2, 3, 4, 5], [3, 4, 5, 6])
    """

    def __init__(self, tokens: Sequence[int], block_size: int):
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be a 1-D integer array, "
                             f"got shape {tokens.shape} dtype {tokens.dtype}")
        if not isinstance(block_size, int) or not 1 <= block_size < len(tokens):
            raise ValueError(f"block_size must be an int in [1, {len(tokens)}), got {block_size!r}")
        self.tokens = tokens.astype(np.int64, copy=False)
        self.block_size = block_size
        self._offsets = np.arange(block_size + 1, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.tokens) - self.block_size

    def __getitem__(self, index: int):
        i = _check_index(index, len(self))
        w = self.tokens[i:i + self.block_size + 1]
        return w[:-1].copy(), w[1:].copy()

    def get_batch(self, indices: np.ndarray):
        """``(x, y)`` of shape ``(len(indices), T)`` gathered in one indexing call."""
        w = self.tokens[np.asarray(indices, dtype=np.int64)[:, None] + self._offsets]
        return w[:, :-1], w[:, 1:]


def unigram_entropy(tokens: Sequence[int]) -> float:
    """Entropy in nats of the token frequency distribution: the loss of the best context-free model.

    Example:
        >>> round(unigram_entropy([0, 1, 0, 1]), 4) == round(math.log(2), 4)
        True
    """
    tokens = np.asarray(tokens).reshape(-1)
    if tokens.size == 0:
        raise ValueError("unigram_entropy of an empty token array is undefined")
    counts = np.unique(tokens, return_counts=True)[1]
    p = counts / tokens.size
    return float(-(p * np.log(p)).sum())
