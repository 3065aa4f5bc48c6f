"""safetensors both ways: stream a checkpoint out block by block (HF-style shards), read files back lazily.

[Note: the bytes we write]
A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [begin, end]}, ...}``,
padded with spaces to a multiple of 8), then the tensors' bytes back to back, C order, little
endian. We write exactly what the ``safetensors`` package writes for the same tensors (tested
byte for byte): tensors ordered by dtype, widest first in the package's dtype order, then by
name; compact JSON with the metadata first. The header needs only shapes and dtypes, which the
checkpoint's manifest has, so the data are streamed entry by entry and block by block (at most
``_BLOCK_BYTES`` in memory besides the output buffer of the OS), never the whole model.

Files of more than ``max_shard_size`` bytes are split as Hugging Face's ``save_pretrained``
does: tensors in state-dict order fill ``model-00001-of-0000K.safetensors`` greedily (a tensor
larger than the limit gets a file of its own), and ``model.safetensors.index.json`` holds
``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``.
"""
from __future__ import annotations

import json
import os
import re
import struct
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import numpy as np

from .format import Entry

__all__ = ["export_safetensors", "load_safetensors", "save_safetensors", "parse_size", "read_model_state",
           "create_temporary", "INDEX_FILE", "SINGLE_FILE"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_BLOCK_BYTES = 16 << 20

# the safetensors package's Dtype order (ascending); files list the widest/highest first
_ORDER = ["BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64"]
_CODE = {np.dtype(np.bool_): "BOOL", np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8",
         np.dtype(np.int16): "I16", np.dtype(np.uint16): "U16", np.dtype(np.float16): "F16",
         np.dtype(np.int32): "I32", np.dtype(np.uint32): "U32", np.dtype(np.float32): "F32",
         np.dtype(np.float64): "F64", np.dtype(np.int64): "I64", np.dtype(np.uint64): "U64"}
_NUMPY = {v: k for k, v in _CODE.items()}
_WIDTH = {c: (2 if c == "BF16" else _NUMPY[c].itemsize) for c in _ORDER}
_CASTS = {"bf16": "BF16", "bfloat16": "BF16", "fp16": "F16", "float16": "F16", "fp32": "F32", "float32": "F32",
          "fp64": "F64", "float64": "F64"}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: Union[int, str]) -> int:
    """Bytes of ``5GB`` (10^9, as Hugging Face counts), ``500MiB`` (2^20) or a plain int.

    Example:
        >>> parse_size("5GB"), parse_size("2MiB"), parse_size(1000)
        (5000000000, 2097152, 1000)
    """
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        n = int(size)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(size))
        if not m or m.group(2).upper() not in _UNITS:
            raise ValueError(f"max_shard_size {size!r}: expected bytes as an int or a number with a unit "
                             f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '5GB'")
        n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise ValueError(f"max_shard_size {size!r} must be positive")
    return n


def create_temporary(out_path: str) -> str:
    """Create an empty temporary file beside ``out_path`` with the umask's mode (0666 & ~umask).

    ``tempfile.mkstemp`` always gives 0600, which keeps an exported model from colleagues on a
    shared cluster; ``os.open`` with 0o666 applies the umask as any new file would get.
    """
    directory = os.path.dirname(os.path.abspath(out_path))
    for _ in range(100):
        tmp = os.path.join(directory, f"{os.path.basename(out_path)}.{os.urandom(6).hex()}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temporary file beside {out_path}")


def _code(dtype: np.dtype, name: str) -> str:
    try:
        return _CODE[np.dtype(dtype).newbyteorder("=")]
    except KeyError:
        raise TypeError(f"tensor {name!r} has dtype {np.dtype(dtype)}, which safetensors cannot hold "
                        f"(it stores {', '.join(_ORDER)})") from None


def _target_code(dtype: np.dtype, cast: Optional[str], name: str) -> str:
    code = _code(dtype, name)
    return cast if cast is not None and code.startswith("F") else code


def to_bfloat16_bits(a: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of ``a``, rounded to nearest even as torch's ``.to(bfloat16)``."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    r = ((u + (((u >> 16) & 1) + np.uint32(0x7FFF))) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        r[nan] = 0x7FC0
    return r


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (exact: bfloat16 is float32's upper half)."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def _convert(block: np.ndarray, code: str) -> np.ndarray:
    if code == "BF16":
        return to_bfloat16_bits(block)
    return np.ascontiguousarray(block, dtype=_NUMPY[code].newbyteorder("<"))


def _header(items: List[Tuple[str, str, Tuple[int, ...]]], metadata: Optional[Dict[str, str]]):
    """``(header bytes, {name: (begin, end)}, order)`` laid out as the safetensors package lays them."""
    order = sorted(items, key=lambda t: (-_ORDER.index(t[1]), t[0]))
    head: "OrderedDict[str, Any]" = OrderedDict()
    if metadata:
        bad = {k: v for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)}
        if bad:
            raise TypeError(f"safetensors metadata maps str to str; got {bad!r}")
        head["__metadata__"] = dict(metadata)
    offsets, at = {}, 0
    for name, code, shape in order:
        n = int(np.prod(shape, dtype=np.int64)) * _WIDTH[code]
        head[name] = {"dtype": code, "shape": [int(s) for s in shape], "data_offsets": [at, at + n]}
        offsets[name] = (at, at + n)
        at += n
    blob = json.dumps(head, separators=(",", ":")).encode()
    blob += b" " * ((8 - len(blob) % 8) % 8)
    return struct.pack("<Q", len(blob)) + blob, offsets, [t[0] for t in order]


def _write_file(path: str, items, metadata, write_tensor) -> None:
    """Write one safetensors file through a temporary name; ``write_tensor(name, f)`` streams its data."""
    head, _, order = _header(items, metadata)
    tmp = create_temporary(path)
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            for name in order:
                write_tensor(name, f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _shards(sizes: List[Tuple[str, int]], limit: int) -> List[List[str]]:
    """Greedy split in order, as Hugging Face's ``split_torch_state_dict_into_shards``."""
    shards: List[List[str]] = []
    cur, used = [], 0
    for name, n in sizes:
        if cur and used + n > limit:
            shards.append(cur)
            cur, used = [], 0
        cur.append(name)
        used += n
    if cur or not shards:
        shards.append(cur)
    return shards


def _write_all(out: str, tensors: List[Tuple[str, str, Tuple[int, ...]]], max_shard_size, metadata,
               write_tensor) -> List[str]:
    """Write ``tensors`` (name, code, shape) as one file or HF-style shards into directory ``out``."""
    limit = parse_size(max_shard_size)
    if out.endswith(".safetensors"):
        d = os.path.dirname(os.path.abspath(out))
        os.makedirs(d, exist_ok=True)
        _write_file(out, tensors, metadata, write_tensor)
        return [out]
    os.makedirs(out, exist_ok=True)
    sizes = [(n, int(np.prod(s, dtype=np.int64)) * _WIDTH[c]) for n, c, s in tensors]
    groups = _shards(sizes, limit)
    by_name = {t[0]: t for t in tensors}
    stale = [f for f in os.listdir(out) if f == INDEX_FILE or f == SINGLE_FILE
             or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f)]
    for f in stale:  # an earlier export's shards would be mixed with these otherwise
        os.remove(os.path.join(out, f))
    if len(groups) == 1:
        path = os.path.join(out, SINGLE_FILE)
        _write_file(path, tensors, metadata, write_tensor)
        return [path]
    files, weight_map = [], OrderedDict()
    for i, names in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        _write_file(os.path.join(out, fname), [by_name[n] for n in names], metadata, write_tensor)
        files.append(os.path.join(out, fname))
        weight_map.update((n, fname) for n in names)
    index = {"metadata": {"total_size": sum(n for _, n in sizes)}, "weight_map": weight_map}
    tmp = create_temporary(os.path.join(out, INDEX_FILE))
    try:
        with open(tmp, "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, os.path.join(out, INDEX_FILE))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return files + [os.path.join(out, INDEX_FILE)]


def _cast_code(dtype: Optional[str]) -> Optional[str]:
    if dtype is None:
        return None
    key = str(dtype).lower()
    if key not in _CASTS:
        raise ValueError(f"dtype {dtype!r}: expected one of bf16, fp16, fp32, fp64 (or None to keep each array's)")
    return _CASTS[key]


def save_safetensors(state_dict: Dict[str, Any], out: str, *, max_shard_size: Union[int, str] = "5GB",
                     dtype: Optional[str] = None, metadata: Optional[Dict[str, str]] = None) -> List[str]:
    """Write a flat state dict (name -> host array) as safetensors; ``out`` a directory or ``*.safetensors`` file.

    Returns:
        The paths written (shards, then the index when there are several).

    Example:
        >>> save_safetensors(model.state_dict(), "export/", dtype="bf16")
    """
    cast = _cast_code(dtype)
    arrays = OrderedDict((k, np.asarray(v)) for k, v in state_dict.items())
    tensors = [(k, _target_code(a.dtype, cast, k), tuple(a.shape)) for k, a in arrays.items()]
    codes = {n: c for n, c, _ in tensors}

    def write_tensor(name, f):
        f.write(_convert(arrays[name], codes[name]).tobytes())

    return _write_all(out, tensors, max_shard_size, {"format": "pt", **(metadata or {})}, write_tensor)


def _model_entries(entries: Iterable[Entry], prefix: Optional[str]) -> List[Tuple[str, Entry]]:
    arrays = [e for e in entries if e.kind == "array"]
    if prefix is None:
        prefix = "model" if any(len(e.keys) > 1 and e.keys[0] == "model" for e in arrays) else ""
    want = tuple(p for p in prefix.split("/") if p)
    out = [(".".join(str(k) for k in e.keys[len(want):]), e) for e in arrays
           if tuple(str(k) for k in e.keys[:len(want)]) == want and len(e.keys) > len(want)]
    if not out:
        raise ValueError(f"the checkpoint has no arrays under {prefix!r} (entries: "
                         f"{[e.name for e in arrays][:10]}); pass prefix= the key of the model state")
    return out


def read_model_state(path: str, prefix: Optional[str] = None, verify: bool = True
                     ) -> Tuple["OrderedDict[str, np.ndarray]", Dict[str, Any]]:
    """``(model arrays, config)`` of a checkpoint saved under any layout: every array of the model state
    (``prefix`` as in :func:`export_safetensors`) whole, in its full shape, under its serial name, and the
    values saved under ``extra/config`` as a nested dict (``{}`` when none), which a model exporter reads
    the sizes no shape holds from.

    Example:
        >>> sd, config = read_model_state("runs/gpt/step-00001000")
        >>> model.load_state_dict(sd)
    """
    from .read import CheckpointReader
    with CheckpointReader(path, verify=verify) as r:
        sd = OrderedDict((n, np.asarray(r.read(e.name)).reshape(e.full_shape))
                         for n, e in _model_entries(r.manifest.entries, prefix))
        config: Dict[str, Any] = {}
        for name in r.names():
            parts = name.split("/")
            if len(parts) >= 3 and parts[:2] == ["extra", "config"]:
                e = r.entry(name)
                if e.kind == "value":
                    node = config
                    for k in parts[2:-1]:
                        node = node.setdefault(k, {})
                    node[parts[-1]] = r.value(e)
    return sd, config


def export_safetensors(path: str, out: str, *, max_shard_size: Union[int, str] = "5GB",
                       dtype: Optional[str] = None, prefix: Optional[str] = None,
                       verify: bool = True) -> List[str]:
    """Stream a checkpoint's model state into safetensors files, full shapes under serial names.

    Args:
        path: the checkpoint directory.
        out: a directory (``model.safetensors``, or ``model-0000i-of-0000K.safetensors`` and
            ``model.safetensors.index.json`` when over ``max_shard_size``) or a ``*.safetensors`` file.
        max_shard_size: bytes per file (``"5GB"``: 5 * 10^9, as Hugging Face).
        dtype: ``"bf16"``, ``"fp16"``, ``"fp32"`` or ``"fp64"`` to cast floating tensors; None keeps them.
        prefix: the state key whose arrays are the model (default ``"model"`` when present, else all
            arrays); names are the remaining keys joined by ``.`` (the serial ``state_dict`` names).
        verify: check every block's checksum as it is read (default).

    Returns:
        The paths written.

    Example:
        >>> export_safetensors("runs/gpt/step-00001000", "hf/", max_shard_size="2GB", dtype="bf16")
    """
    from .read import CheckpointReader
    cast = _cast_code(dtype)
    with CheckpointReader(path, verify=verify) as r:
        chosen = _model_entries(r.manifest.entries, prefix)
        by_name = dict(chosen)
        tensors = [(n, _target_code(np.dtype(e.dtype), cast, n), e.full_shape) for n, e in chosen]
        codes = {n: c for n, c, _ in tensors}

        def write_tensor(name, f):
            e = by_name[name]
            if not e.nbytes:
                return
            shape = tuple(e.shape) if e.shape else ()
            if not shape:
                f.write(_convert(r.read_block(e, (), ()), codes[name]).tobytes())
                return
            row = max(1, e.nbytes // max(1, shape[0]))
            step = max(1, _BLOCK_BYTES // row)
            for a in range(0, shape[0], step):
                b = min(shape[0], a + step)
                blk = r.read_block(e, (a,) + (0,) * (len(shape) - 1), (b - a,) + shape[1:])
                f.write(_convert(blk, codes[name]).tobytes())

        meta = {"format": "pt", "axonmpi_checkpoint": os.path.abspath(r.path)}
        return _write_all(out, tensors, max_shard_size, meta, write_tensor)


def _files(path: str) -> List[str]:
    path = os.fspath(path)
    if os.path.isdir(path):
        idx = os.path.join(path, INDEX_FILE)
        if os.path.isfile(idx):
            with open(idx) as f:
                wm = json.load(f)["weight_map"]
            return [os.path.join(path, n) for n in dict.fromkeys(wm.values())]
        single = os.path.join(path, SINGLE_FILE)
        if os.path.isfile(single):
            return [single]
        found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not found:
            raise FileNotFoundError(f"{path} holds no {INDEX_FILE}, {SINGLE_FILE} or *.safetensors file")
        return [os.path.join(path, f) for f in found]
    if os.path.basename(path) == INDEX_FILE:
        return _files(os.path.dirname(path) or ".")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no safetensors file or directory at {path}")
    return [path]


def _read_header(path: str) -> Tuple[int, Dict[str, Any]]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path} is not a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, 100 << 20):
            raise ValueError(f"{path} is not a safetensors file (header length {n} of a {size}-byte file)")
        head = json.loads(f.read(n))
    return 8 + n, head


def load_safetensors(path_or_dir: "str | os.PathLike", *, upcast_bf16: bool = True) -> "OrderedDict[str, np.ndarray]":
    """A state dict of every tensor in a safetensors file, a directory, or an HF index (sharded).

    Arrays are read-only views of memory-mapped files: nothing is read until used, so a
    sharded strategy that copies only its block reads only those pages. BF16 tensors (NumPy has
    no bfloat16) become float32 copies, exact; ``upcast_bf16=False`` gives their uint16 bits.
    The result is what ``Module.load_state_dict`` (and FSDP/DDP/tensor-parallel ``load_state_dict``
    of full state dicts) accepts.

    Example:
        >>> model.load_state_dict(axonmpi.checkpoint.load_safetensors("hf/"))
    """
    out: "OrderedDict[str, np.ndarray]" = OrderedDict()
    for fname in _files(path_or_dir):
        start, head = _read_header(fname)
        items = sorted(((k, v) for k, v in head.items() if k != "__metadata__"),
                       key=lambda kv: kv[1]["data_offsets"][0])
        mm = np.memmap(fname, dtype=np.uint8, mode="r") if os.path.getsize(fname) > start else None
        for name, info in items:
            code, shape = info["dtype"], tuple(int(s) for s in info["shape"])
            a, b = (int(v) for v in info["data_offsets"])
            if code not in _WIDTH:
                raise TypeError(f"{fname}: tensor {name!r} has dtype {code}, which NumPy cannot hold")
            dt = np.dtype(np.uint16) if code == "BF16" else _NUMPY[code].newbyteorder("<")
            n = int(np.prod(shape, dtype=np.int64))
            if b - a != n * dt.itemsize:
                raise ValueError(f"{fname}: tensor {name!r} has {b - a} bytes for shape {shape} of {code}")
            arr = (np.ndarray(shape, dt, buffer=mm, offset=start + a) if n else np.empty(shape, dt))
            if code == "BF16" and upcast_bf16:
                arr = from_bfloat16_bits(arr).reshape(shape)
            if name in out:
                raise ValueError(f"tensor {name!r} appears in two files of {path_or_dir}")
            out[name] = arr
    return out
