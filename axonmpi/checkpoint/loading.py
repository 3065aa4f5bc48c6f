"""load: read a checkpoint into this rank's current layout, whatever layout it was saved from.

Rank 0 reads and checks ``index.h5`` once and broadcasts the parsed manifest; every rank then
reads only the blocks its template needs, straight from the shard files, verifying each
block's checksum; one all-gather at the end makes an error on any rank raise on every rank.
All exchanges are axonmpi collectives on the group (checked in debug mode).
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import numpy as np

from .. import backend as _be
from .. import trace as _trace
from ..distributed.sharding import ShardedArray
from .agree import agree, share
from .format import INDEX_NAME, CheckpointError, Entry, flatten, key_name, unflatten
from .index import read_index
from .read import CheckpointReader, resolve_path

__all__ = ["load", "LegacyChecksumWarning"]


class LegacyChecksumWarning(UserWarning):
    """A format-1 checkpoint was loaded: its pagesum64 block checksum misses some damage."""


# one warning per process, whatever the path (the message names no path, so "once" matches it)
warnings.filterwarnings("once", category=LegacyChecksumWarning)


def _warn_format_1(manifest, path) -> None:
    if int(manifest.attrs.get("format_version", 2)) >= 2:
        return
    warnings.warn(LegacyChecksumWarning(
        f"{os.path.dirname(path) or '.'}/...: format-1 checkpoints are verified with the old axonmpi.pagesum64 checksum, which misses some damage "
        "(a swap of two 8-byte words passes it); re-save them to get xxh3_64 checksums: "
        "axonmpi.checkpoint.save(NEW_PATH, axonmpi.checkpoint.load(OLD_PATH))"), stacklevel=3)


@_trace.traced("checkpoint.load", "checkpoint")
def load(path: "str | os.PathLike", state: Optional[dict] = None, group=None, *, strict: bool = True,
         cast: bool = False, verify: bool = True) -> dict:
    """Load a checkpoint into this rank's current layout, whatever layout it was saved from.

    Collective over ``group`` (default: all ranks). With a template ``state`` (same nested
    keys as saved), each rank reads only the blocks it needs, straight from the shard files,
    and every block read is checksum-verified:

    * a :class:`ShardedArray` leaf gets its block ``global[offsets : offsets+local.shape]``
      filled in place (any saved sharding, any saved world size);
    * a NumPy/CuPy array leaf gets the full array, in place (shapes must match, or the leaf has
      the ``view_shape`` of an entry FSDP/ZeRO saved flattened);
    * a ``None`` leaf gets the saved value or full array; an empty-dict leaf gets everything
      saved under that key (e.g. an optimizer's not-yet-created ``state``);
    * any other leaf (scalar, str, list) is replaced by the saved value.

    Without a template every rank gets everything as full arrays and values.

    Args:
        path: the checkpoint directory.
        state: template (nested dict), or None.
        group: the process group loading together (default: all ranks); errors on any rank
            raise on all.
        strict: entries missing from the checkpoint or present only in it raise a
            :class:`CheckpointError` listing them all; ``strict=False`` skips both.
        cast: allow a template array dtype different from the saved dtype (values are cast).
        verify: check every block read against its stored checksum (default). ``verify=False``
            skips that pass for speed on storage you trust; the index is still checked, and a
            missing or truncated shard still raises, but silently flipped bits go unnoticed.

    Returns:
        The loaded nested dict (template arrays are the same objects, filled in place).

    Example:
        >>> w = ShardedArray.zeros((1024, 512), np.float32, axis=1)     # another layout
        >>> out = axonmpi.checkpoint.load("ckpt/step-100", {"model": {"w": w, "b": bias}, "step": 0})
        >>> out["step"]
        100
    """
    from ..distributed import resolve_group

    g = resolve_group(group)
    payload, err = None, None
    if g.rank == 0:
        try:
            real = resolve_path(path)
            payload = (real, read_index(os.path.join(real, INDEX_NAME)))
        except Exception as e:
            err = e
    real, manifest = share(g, payload, err, f"load of {path}")
    if g.rank == 0:
        _warn_format_1(manifest, real)
    result, err = None, None
    try:
        with CheckpointReader(real, manifest, verify=verify) as reader:
            result = _fill(reader, state, g.rank, strict, cast)
    except Exception as e:
        err = e
    agree(g, err, f"load of {path}")
    return result


def _fill(reader: CheckpointReader, state: Optional[dict], rank: int, strict: bool, cast: bool) -> dict:
    saved = reader.manifest.entries
    if state is None:
        return reader.to_dict()
    tmpl = flatten(state, rank)
    by_name = reader.manifest.by_name()
    wild = {key_name(k): k for k, v in tmpl if v is None or (isinstance(v, dict) and not v)}
    tnames = {key_name(k) for k, _ in tmpl}

    def under_wild(name: str) -> bool:
        parts = name.split("/")
        return any("/".join(parts[:i]) in wild for i in range(1, len(parts)))

    missing = [n for n in (key_name(k) for k, _ in tmpl) if n not in by_name and not (
        n in wild and any(s.name.startswith(n + "/") for s in saved))]
    extra = [e.name for e in saved if e.name not in tnames and not under_wild(e.name)]
    if strict and (missing or extra):
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {missing}")
        if extra:
            parts.append(f"in the checkpoint but not in the template: {extra}")
        raise CheckpointError(f"rank {rank}: {reader.path}: " + "; ".join(parts) + " (strict=False skips them)")
    items, problems = [], []
    for keys, leaf in tmpl:
        name = key_name(keys)
        e = by_name.get(name)
        if e is None:
            if name in wild:
                sub = [s for s in saved if s.name.startswith(name + "/")]
                if sub:
                    items.extend((s.keys, reader.read(s.name)) for s in sub)
                    continue
            items.append((keys, leaf))
            continue
        try:
            items.append((keys, _fill_one(reader, e, leaf, cast)))
        except CheckpointError as ex:
            problems.append(str(ex))
    if problems:
        raise CheckpointError(f"rank {rank}: {reader.path}: " + "; ".join(problems))
    return unflatten(items)


def _fill_one(reader: CheckpointReader, e: Entry, leaf: Any, cast: bool) -> Any:
    is_arr = isinstance(leaf, (ShardedArray, np.ndarray)) or _be.is_cupy_array(leaf)
    if e.kind != "array":
        if is_arr:
            raise CheckpointError(f"entry {e.name!r}: the checkpoint holds a {e.pytype} value, the template an array")
        return reader.value(e)
    if not is_arr:
        if isinstance(leaf, np.generic):
            return reader.read_block(e, (0,) * len(e.shape), e.shape).astype(leaf.dtype if cast else e.dtype)[()]
        return reader.read(e.name)
    if isinstance(leaf, ShardedArray):
        target, off, shp = leaf.local, leaf.offsets, leaf.local_shape
        if leaf.global_shape != e.shape:
            raise CheckpointError(
                f"entry {e.name!r}: saved global shape {e.shape}, template ShardedArray global shape "
                f"{leaf.global_shape} (changed shape)"
            )
    else:
        target, off, shp = leaf, (0,) * len(e.shape), e.shape
        if tuple(leaf.shape) != e.shape and tuple(leaf.shape) == e.full_shape and leaf.flags.c_contiguous:
            target = leaf.reshape(e.shape)   # saved flattened (FSDP/ZeRO): a view, so filled in place
        elif tuple(leaf.shape) != e.shape:
            raise CheckpointError(f"entry {e.name!r}: saved shape {e.shape}, template shape {tuple(leaf.shape)} (changed shape)")
    dt = np.dtype(e.dtype)
    if target.dtype != dt and not cast:
        raise CheckpointError(
            f"entry {e.name!r}: saved dtype {dt}, template dtype {target.dtype} (pass cast=True to convert)"
        )
    on_host = isinstance(target, np.ndarray)
    if on_host and target.dtype == dt and target.flags.c_contiguous and target.flags.writeable:
        reader.read_block(e, off, shp, target)
    else:
        if on_host and not target.flags.writeable:
            raise CheckpointError(f"entry {e.name!r}: the template array is read-only; load fills arrays in place")
        buf = reader.read_block(e, off, shp)
        if on_host:
            target[...] = buf
        else:
            target[...] = _be.get_array_module(target).asarray(buf).astype(target.dtype, copy=False)
    return leaf
