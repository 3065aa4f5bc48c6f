"""``axonmpi ckpt inspect PATH`` and ``axonmpi ckpt consolidate PATH OUT.h5`` (also ``python -m axonmpi.checkpoint``)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

import numpy as np

from .format import META_GROUP, CheckpointError, _write_entry_view
from .io import CheckpointReader
from .manager import list_run_folder

__all__ = ["add_subparser", "add_commands", "main", "inspect", "consolidate"]


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _step(r: CheckpointReader):
    for name in ("meta/step", "step"):
        if name in r._by_name and r._by_name[name].kind == "value":
            return r.value(r._by_name[name])
    return None


def inspect(path: str, as_json: bool = False, out=None) -> int:
    """Print a checkpoint's entries (kind, dtype, shape, pieces, bytes), layout and step."""
    out = out or sys.stdout
    if list_run_folder(path, as_json, out):  # a run folder of step-* checkpoints: list them
        return 0
    with CheckpointReader(path) as r:
        a = r.attrs
        files = sorted({p.file for e in r.manifest.entries for p in e.pieces})
        disk = sum(os.path.getsize(os.path.join(r.path, f)) for f in files + ["index.h5"]
                   if os.path.exists(os.path.join(r.path, f)))
        rows = []
        for e in r.manifest.entries:
            if e.kind == "array":
                rows.append({"name": e.name, "kind": e.pytype, "dtype": str(np.dtype(e.dtype)),
                             "shape": list(e.shape), "pieces": len(e.pieces), "bytes": e.nbytes,
                             "files": sorted({p.file for p in e.pieces})})
            else:
                rows.append({"name": e.name, "kind": e.pytype, "value": r.value(e)})
        info = {
            "path": r.path, "format": a.get("format"), "format_version": a.get("format_version"),
            "library_version": a.get("library_version"), "created": a.get("created"),
            "world_size": a.get("world_size"), "group_size": a.get("group_size"),
            "group_ranks": a.get("group_ranks"), "files": files, "bytes_on_disk": disk,
            "array_bytes": sum(x.get("bytes", 0) for x in rows), "step": _step(r), "entries": rows,
        }
    if as_json:
        json.dump(info, out, indent=1, default=str)
        out.write("\n")
        return 0
    w = out.write
    w(f"checkpoint  {info['path']}\n")
    w(f"format      {info['format']} v{info['format_version']}, written by axonmpi {info['library_version']} "
      f"at {info['created']}\n")
    w(f"layout      {info['group_size']} rank(s) of a world of {info['world_size']}; "
      f"{len(files)} shard file(s) + index.h5, {_size(disk)} on disk\n")
    if info["step"] is not None:
        w(f"step        {info['step']}\n")
    arrays = [x for x in rows if "dtype" in x]
    values = [x for x in rows if "dtype" not in x]
    if arrays:
        nw = max(len("entry"), *(len(x["name"]) for x in arrays))
        w(f"\n{'entry':<{nw}}  {'kind':<8} {'dtype':<10} {'shape':<16} {'pieces':>6} {'bytes':>10}\n")
        for x in arrays:
            w(f"{x['name']:<{nw}}  {x['kind']:<8} {x['dtype']:<10} {str(tuple(x['shape'])):<16} "
              f"{x['pieces']:>6} {_size(x['bytes']):>10}\n")
        w(f"{len(arrays)} arrays, {_size(info['array_bytes'])}\n")
    if values:
        nw = max(len(x["name"]) for x in values)
        w("\n")
        for x in values:
            v = repr(x["value"])
            w(f"{x['name']:<{nw}}  {x['kind']:<6} {v if len(v) <= 60 else v[:57] + '...'}\n")
    return 0


def consolidate(path: str, out_path: str, force: bool = False) -> int:
    """Write every entry of a checkpoint into one plain HDF5 file (full arrays, verified reads)."""
    import h5py
    if os.path.exists(out_path) and not force:
        raise FileExistsError(f"{out_path} exists (pass --force to replace it)")
    tmp = out_path + ".tmp"
    with CheckpointReader(path) as r, h5py.File(tmp, "w") as f:
        for k, v in r.attrs.items():
            if k != "checksum":
                f.attrs[k] = v
        f.attrs["consolidated_from"] = os.path.abspath(r.path)
        for e in r.manifest.entries:
            if e.kind == "array":
                ds = f.create_dataset(e.name, shape=e.shape, dtype=np.dtype(e.dtype))
                if e.nbytes:
                    ds[...] = r.read_block(e, (0,) * len(e.shape), e.shape)
                ds.attrs["axonmpi_type"] = e.pytype
            else:
                _write_entry_view(f, e, h5py)
        meta = f.create_group(META_GROUP)
        entries = json.dumps([e.to_json() for e in r.manifest.entries]).encode()
        meta.create_dataset("entries", data=np.frombuffer(entries, np.uint8))
    os.replace(tmp, out_path)
    return 0


def add_commands(sub) -> None:
    """Add the ``inspect`` and ``consolidate`` commands to an argparse subparsers object."""
    p = sub.add_parser("inspect", help="list a checkpoint's entries, shapes, dtypes, shards, bytes and step")
    p.add_argument("path", help="checkpoint directory (or its index.h5)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=lambda a: inspect(a.path, a.json))
    p = sub.add_parser("consolidate", help="write a checkpoint as one plain HDF5 file of full arrays")
    p.add_argument("path", help="checkpoint directory")
    p.add_argument("out", help="output .h5 file")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=lambda a: consolidate(a.path, a.out, a.force))


def add_subparser(subparsers) -> argparse.ArgumentParser:
    """Register ``ckpt`` (with ``inspect``/``consolidate``) on a top-level CLI; run it with ``args.func(args)``."""
    p = subparsers.add_parser("ckpt", help="inspect or consolidate axonmpi checkpoints",
                              description="Inspect or consolidate axonmpi sharded HDF5 checkpoints.")
    add_commands(p.add_subparsers(dest="ckpt_command", required=True, metavar="{inspect,consolidate}"))
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m axonmpi.checkpoint {inspect,consolidate} ...``."""
    parser = argparse.ArgumentParser(prog="python -m axonmpi.checkpoint",
                                     description="Inspect or consolidate axonmpi sharded HDF5 checkpoints.")
    add_commands(parser.add_subparsers(dest="command", required=True, metavar="{inspect,consolidate}"))
    args = parser.parse_args(argv)
    from ..log import run_main
    return run_main(args.func, args)  # one "error: ..." line, quiet on a closed pipe
