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
from .format import INDEX_NAME, CheckpointError, CheckpointMismatchError, Entry, flatten, key_name, unflatten
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
    from ..distributed import phases as _phases
    with _phases.long_phase("checkpoint.load", f"reading {os.fspath(path)}"):
        return _load(path, state, group, strict, cast, verify)


def _load(path, state, group, strict: bool, cast: bool, verify: bool) -> dict:
    """:func:`load` inside its long phase."""
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


def _template_form(leaf: Any):
    """``(stored shape, logical shape, dtype)`` of an array leaf of a template, None for other leaves."""
    if isinstance(leaf, ShardedArray):
        g = tuple(leaf.global_shape)
        return g, tuple(leaf.view_shape) if leaf.view_shape is not None else g, np.dtype(leaf.local.dtype)
    if isinstance(leaf, np.ndarray) or _be.is_cupy_array(leaf):
        return tuple(leaf.shape), tuple(leaf.shape), np.dtype(leaf.dtype)
    return None


def _misfit(e: Entry, leaf: Any, cast: bool) -> Optional[str]:
    """Why ``leaf`` cannot take entry ``e`` ("shape", "dtype", "kind"), or None when it fits."""
    form = _template_form(leaf)
    if e.kind != "array":
        return "kind" if form is not None else None
    if form is None:
        return None                    # a value, None or a NumPy scalar leaf takes the saved array
    stored, logical, dt = form
    if stored != tuple(e.shape) and logical != e.full_shape:
        return "shape"
    if dt != np.dtype(e.dtype) and not cast:
        return "dtype"
    return None


def _describe_saved(e: Entry) -> str:
    if e.kind != "array":
        return f"a {e.pytype} value"
    return f"{np.dtype(e.dtype)} of shape {e.full_shape}"


def _describe_template(leaf: Any) -> str:
    form = _template_form(leaf)
    if form is None:
        return f"a {type(leaf).__name__} value"
    stored, logical, dt = form
    extra = f" (stored flattened as {stored})" if stored != logical else ""
    return f"{dt} of shape {logical}{extra}"


def _misfit_error(path: str, rank: int, found: list, cast: bool) -> "CheckpointMismatchError":
    """One error naming the first entry that does not fit, the others by name, and what to do."""
    why, e, leaf = found[0]
    more = ""
    if len(found) > 1:
        names = [f"{x.name!r} ({w})" for w, x, _ in found[1:6]]
        more = f"; {len(found) - 1} more entr{'y differs' if len(found) == 2 else 'ies differ'}: " + ", ".join(names) + (
            ", ..." if len(found) > 6 else "")
    if why == "dtype":
        fix = (f"pass cast=True to convert the saved {np.dtype(e.dtype)} values to "
               f"{_template_form(leaf)[2]} (load(path, state, cast=True), mgr.load_latest(state, cast=True)), "
               f"or build the model in {np.dtype(e.dtype)}")
    elif why == "shape":
        fix = ("build the model with the options it was saved with (the saved shapes); load(path) without a "
               "template returns the saved arrays as they are")
    else:
        fix = "build the template from the same kind of object that was saved"
    return CheckpointMismatchError(
        f"rank {rank}: {path} is intact but does not fit the template: entry {e.name!r} is saved as "
        f"{_describe_saved(e)}, the template has {_describe_template(leaf)}{more}. To load it, {fix}")


def _optional(name: str, leaf: Any) -> bool:
    """A template value that an older checkpoint may lack: ``meta/step`` or ``meta/epoch`` left as None."""
    return leaf is None and name in ("meta/step", "meta/epoch")


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

    missing = [n for n, v in ((key_name(k), v) for k, v in tmpl) if n not in by_name and not (
        n in wild and any(s.name.startswith(n + "/") for s in saved)) and not _optional(n, v)]
    extra = [e.name for e in saved if e.name not in tnames and not under_wild(e.name)]
    if strict and (missing or extra):
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {missing}")
        if extra:
            parts.append(f"in the checkpoint but not in the template: {extra}")
        raise CheckpointMismatchError(
            f"rank {rank}: {reader.path} is intact but does not fit the template: " + "; ".join(parts) +
            ". Build the template from the model and optimizer the checkpoint was saved from (the same parameter "
            "names), or pass strict=False to skip these entries")
    found = []
    for keys, leaf in tmpl:
        e = by_name.get(key_name(keys))
        if e is not None:
            why = _misfit(e, leaf, cast)
            if why is not None:
                found.append((why, e, leaf))
    if found:   # before any data is read
        raise _misfit_error(reader.path, rank, found, cast)
    items = []
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
        items.append((keys, _fill_one(reader, e, leaf, cast)))
    return unflatten(items)


def _read_flat(reader: CheckpointReader, e: Entry, lo: int, hi: int) -> np.ndarray:
    """Elements ``lo:hi`` of the entry's values in C order (whole stored rows are read and verified)."""
    rest = tuple(e.shape[1:])
    rs = int(np.prod(rest, dtype=np.int64)) if e.shape else 1
    if not e.shape:
        return reader.read_block(e, (), ()).reshape(-1)[lo:hi]
    r0, r1 = lo // rs, -(-hi // rs)
    buf = reader.read_block(e, (r0,) + (0,) * len(rest), (r1 - r0,) + rest).reshape(-1)
    return buf[lo - r0 * rs: hi - r0 * rs]


def _read_reshaped(reader: CheckpointReader, e: Entry, tshape, off, shp) -> np.ndarray:
    """The block ``off:off+shp`` of the entry seen in the shape ``tshape`` (same elements, C order).

    An FSDP template (flattened 1-D blocks) reads a checkpoint saved in the parameters' own shapes
    (tensor parallel, AxoNN, serial), and a sharded N-D template reads one FSDP saved flattened.
    """
    if not tshape:
        return _read_flat(reader, e, 0, 1).reshape(())
    trs = int(np.prod(tshape[1:], dtype=np.int64))
    flat = _read_flat(reader, e, off[0] * trs, (off[0] + shp[0]) * trs)
    rows = flat.reshape((shp[0],) + tuple(tshape[1:]))
    return rows[(slice(None),) + tuple(slice(o, o + n) for o, n in zip(off[1:], shp[1:]))]


def _fill_one(reader: CheckpointReader, e: Entry, leaf: Any, cast: bool) -> Any:
    """Fill ``leaf`` from entry ``e`` (``_misfit`` said it fits)."""
    is_arr = isinstance(leaf, (ShardedArray, np.ndarray)) or _be.is_cupy_array(leaf)
    if e.kind != "array":
        return reader.value(e)
    if not is_arr:
        if isinstance(leaf, np.generic):
            return reader.read_block(e, (0,) * len(e.shape), e.shape).astype(leaf.dtype if cast else e.dtype)[()]
        return reader.read(e.name)
    reshaped = None
    if isinstance(leaf, ShardedArray):
        if leaf.is_empty:                                 # this rank holds none of it (another stage's)
            return leaf
        target, off, shp = leaf.local, leaf.offsets, leaf.local_shape
        if tuple(leaf.global_shape) != tuple(e.shape):    # same elements, another shape (FSDP <-> TP/serial)
            reshaped = tuple(leaf.global_shape)
    else:
        target, off, shp = leaf, (0,) * len(e.shape), e.shape
        if tuple(leaf.shape) != e.shape and leaf.flags.c_contiguous:
            target = leaf.reshape(e.shape)   # saved flattened (FSDP/ZeRO): a view, so filled in place
        elif tuple(leaf.shape) != e.shape:
            reshaped, off, shp = tuple(leaf.shape), (0,) * leaf.ndim, tuple(leaf.shape)
    dt = np.dtype(e.dtype)
    on_host = isinstance(target, np.ndarray)
    if on_host and not target.flags.writeable:
        raise CheckpointError(f"entry {e.name!r}: the template array is read-only; load fills arrays in place")
    if reshaped is None and on_host and target.dtype == dt and target.flags.c_contiguous:
        reader.read_block(e, off, shp, target)
        return leaf
    buf = _read_reshaped(reader, e, reshaped, off, shp) if reshaped is not None else reader.read_block(e, off, shp)
    if on_host:
        target[...] = buf
    else:
        target[...] = _be.get_array_module(target).asarray(buf).astype(target.dtype, copy=False)
    return leaf
