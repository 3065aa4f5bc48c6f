"""``axonmpi ckpt inspect|verify|consolidate|export`` (also ``python -m axonmpi.checkpoint``).

Every command that reads array data verifies each block's checksum before using it;
``inspect`` reads no array data but checks that every shard file exists and is long enough.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Callable, List, Mapping, Optional, Tuple

import numpy as np

from .format import META_GROUP, CheckpointError
from .index import write_entry_view
from ..log import human as _size
from .read import CheckpointReader, resolve_path
from .manager import list_run_folder, run_folder_rows
from .safetensors_io import create_temporary, export_safetensors

__all__ = ["add_subparser", "add_commands", "main", "inspect", "verify", "consolidate", "export",
           "create_temporary", "check_output"]


def _step(r: CheckpointReader):
    by_name = r.manifest.by_name()
    for name in ("meta/step", "step"):
        if name in by_name and by_name[name].kind == "value":
            return r.value(by_name[name])
    return None


def inspect(path: str, as_json: bool = False, out=None) -> int:
    """Print a checkpoint's entries (kind, dtype, shape, pieces, bytes), layout and step.

    Also checks, without reading array data, that every shard file exists, opens and is long
    enough for the datasets it holds; problems are listed and the exit status is 1. Flipped
    bytes need ``verify`` (which reads every block).

    Returns:
        0, or 1 when a shard file is missing, unreadable or short.
    """
    out = out or sys.stdout
    if list_run_folder(path, as_json, out):  # a run folder of step-* checkpoints: list them
        return 0
    with CheckpointReader(path) as r:
        a = r.attrs
        files = r.files()
        problems = r.file_problems()
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
            "checksum_algorithm": r.manifest.checksum_algorithm,
            "sizes_recorded": bool(r.manifest.file_bytes),
            "problems": [p._asdict() for p in problems],
        }
    if as_json:
        json.dump(info, out, indent=1, default=str)
        out.write("\n")
        return 1 if problems else 0
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
    if not problems:
        sized = " with their saved sizes" if info["sizes_recorded"] else " and readable"
        w(f"\nfiles: all present{sized}; block checksums ({info['checksum_algorithm']}) not read "
          "here: `axonmpi ckpt verify PATH` checks every block\n")
    else:
        w(f"\nDAMAGED: {len(problems)} problem(s) with the shard files (load will fail):\n")
        for p in problems:
            w(f"  {p.file}: {p.message}" + (f" (entry {p.entry!r})" if p.entry else "") + "\n")
    return 1 if problems else 0


def verify(path: str, as_json: bool = False, out=None, strict: bool = False) -> int:
    """Check every block of every piece against its checksum, and that the pieces tile each entry; list every problem.

    ``path`` is a checkpoint, or a run folder (as ``inspect`` takes): then every checkpoint in it
    (those set aside as ``.damaged`` and ``.old-*`` ones too) is verified, one line each, and
    unfinished saves (``.tmp-*``, ``.unfinished*``, no index) are listed as "incomplete (ignored by
    resume)", as resume ignores them.

    Returns:
        0 when the checkpoint (every checkpoint of the folder) is intact, 1 when any file is
        missing, short or unreadable, any block's checksum differs or an entry's pieces do not
        tile its shape (each problem names the entry and the file); with ``strict``, 1 also when
        an unfinished save is there.

    Example:
        >>> verify("runs/gpt/ckpt/step-00000500")     # prints "ok: ..." and returns 0
    """
    out = out or sys.stdout
    rows = run_folder_rows(path)
    if rows is not None:
        return _verify_folder(path, rows, as_json, out, strict)
    if _unfinished(path, None):
        info = {"path": path, "ok": None, "status": _INCOMPLETE}
        if as_json:
            json.dump(info, out, indent=1)
            out.write("\n")
        else:
            out.write(f"incomplete (ignored by resume): {path}: an unfinished or crashed save\n")
        return 1 if strict else 0
    code, info = _verify_one(path)
    if as_json:
        json.dump(info, out, indent=1)
        out.write("\n")
    else:
        out.write(_verify_text(info))
    return code


def _verify_text(info: dict) -> str:
    if info["problems"]:
        lines = [f"DAMAGED: {info['path']}: {len(info['problems'])} problem(s)\n"]
        for p in info["problems"]:
            where = f"entry {p['entry']!r} in {p['file']}" if p["entry"] else p["file"]
            lines.append(f"  {where}: {p['message']}\n")
        return "".join(lines)
    return (f"ok: {info['path']}: {info['entries']} entries, {info['pieces']} pieces, {info['blocks']} blocks, "
            f"{_size(info['bytes'])} verified ({info['checksum_algorithm']})\n")


_INCOMPLETE = "incomplete (ignored by resume)"


def _unfinished(path: str, row: Optional[dict]) -> bool:
    """True for a save that never finished: a ``.tmp-*`` or ``.unfinished*`` folder, or one without an index."""
    base = os.path.basename(os.path.normpath(path))
    if ".tmp-" in base or ".unfinished" in base:
        return True
    return row is not None and not row["has_index"]


def _verify_folder(path: str, rows: List[dict], as_json: bool, out, strict: bool = False) -> int:
    """``verify`` of every checkpoint of a run folder (unfinished saves listed, not verified)."""
    results, bad = [], 0
    for row in rows:
        if _unfinished(row["path"], row):
            results.append({"path": row["path"], "step": row["step"], "ok": None,
                            "status": f"{_INCOMPLETE}: {row['status']}"})
            bad += 1 if strict else 0
            continue
        try:
            code, info = _verify_one(row["path"])
        except Exception as e:   # an unreadable index: damaged, and the other checkpoints still get checked
            code, info = 1, {"path": row["path"], "ok": False,
                             "problems": [{"entry": "", "file": "index.h5", "message": f"{type(e).__name__}: {e}"}]}
        bad += code
        info.update(step=row["step"], status=row["status"])
        results.append(info)
    if as_json:
        json.dump({"run_folder": path, "ok": bad == 0, "checkpoints": results}, out, indent=1)
        out.write("\n")
        return 1 if bad else 0
    out.write(f"run folder  {path}\n")
    for info in results:
        if info["ok"] is None:
            out.write(f"{_INCOMPLETE}: {info['path']}: {info['status'].split(': ', 1)[1]}\n")
            continue
        text = _verify_text(info)
        if info["ok"] and ".damaged" in os.path.basename(info["path"]):
            text = text.rstrip("\n") + (f"; set aside as damaged by an earlier load but intact: rename it back to "
                                        f"{os.path.basename(info['path']).split('.damaged')[0]} to use it\n")
        out.write(text)
    n = sum(1 for i in results if i["ok"] is not None)
    out.write(f"{n - bad} of {n} checkpoint(s) intact\n")
    return 1 if bad else 0


def _verify_one(path: str):
    """``(exit code, info)`` of verifying one checkpoint."""
    with CheckpointReader(path) as r:
        problems = r.file_problems()
        bad_files = {p.file for p in problems if not p.entry}
        problems += [p for p in r.verify_all() if p.file not in bad_files]
        problems += r.coverage_problems()
        npieces = sum(len(e.pieces) for e in r.manifest.entries)
        nblocks = sum(len(p.checksums) for e in r.manifest.entries for p in e.pieces)
        nbytes = sum(e.nbytes for e in r.manifest.entries)
        info = {"path": r.path, "checksum_algorithm": r.manifest.checksum_algorithm, "entries": len(r.names()),
                "pieces": npieces, "blocks": nblocks, "bytes": nbytes, "ok": not problems,
                "problems": [p._asdict() for p in problems]}
    return (1 if problems else 0), info


def consolidate(path: str, out_path: str, force: bool = False) -> int:
    """Write every entry of a checkpoint into one plain HDF5 file of full arrays.

    Arrays saved flattened by FSDP/ZeRO are written in their own shape (the entry's
    ``view_shape``). The file is created with the mode the umask gives a new file (as ``open``
    does), so a group-readable umask shares it. Every block is verified before it is written; on any error (a corrupt block, a missing
    shard, a full disk) the partial output is removed and ``out_path`` is left as it was.

    Returns:
        0 on success (errors raise :class:`CheckpointError` / ``FileExistsError``).
    """
    import h5py
    check_output(path, out_path, force, "consolidate")
    tmp = create_temporary(out_path)
    try:
        with CheckpointReader(path) as r, h5py.File(tmp, "w") as f:
            cover = r.coverage_problems()
            if cover:
                raise CheckpointError(f"cannot consolidate {path}: entry {cover[0].entry!r}: {cover[0].message}"
                                      + (f" (and {len(cover) - 1} more entries)" if len(cover) > 1 else "")
                                      + "; `axonmpi ckpt verify` lists every problem")
            for k, v in r.attrs.items():
                if k != "checksum":
                    f.attrs[k] = v
            f.attrs["consolidated_from"] = os.path.abspath(r.path)
            for e in r.manifest.entries:
                if e.kind == "array":
                    ds = f.create_dataset(e.name, shape=e.full_shape, dtype=np.dtype(e.dtype))
                    if e.nbytes:  # verified blocks only
                        try:
                            ds[...] = r.read_block(e, (0,) * len(e.shape), e.shape).reshape(e.full_shape)
                        except MemoryError:
                            raise CheckpointError(f"cannot consolidate {path}: entry {e.name!r} of shape "
                                                  f"{e.shape} ({_size(e.nbytes)}) does not fit in this machine's "
                                                  "memory") from None
                    ds.attrs["axonmpi_type"] = e.pytype
                else:
                    write_entry_view(f, e, h5py)
            meta = f.create_group(META_GROUP)
            entries = json.dumps([e.to_json() for e in r.manifest.entries]).encode()
            meta.create_dataset("entries", data=np.frombuffer(entries, np.uint8))
            n_arrays = sum(1 for e in r.manifest.entries if e.kind == "array")
            n_bytes = sum(int(e.nbytes or 0) for e in r.manifest.entries if e.kind == "array")
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    print(f"wrote {out_path}: {n_arrays} arrays ({n_bytes / 2**20:.1f} MiB, every block verified) from {path}")
    return 0


_EXPORT_FILES = re.compile(r"model\.safetensors|model\.safetensors\.index\.json|model-\d{5}-of-\d{5}\.safetensors")


def check_output(path: str, out: str, force: bool, command: str, directory: bool = False,
                 also: Tuple[str, ...] = ()) -> None:
    """Refuse an output that would destroy the input or overwrite silently (``consolidate`` and ``export``).

    * ``out`` inside the checkpoint folder (or the folder itself): refused, ``--force`` or not (the
      command would replace ``index.h5`` or a shard it is reading);
    * ``out``'s folder missing: refused, naming it (nothing is created but ``out`` itself);
    * ``out`` already there (for a directory output: a file the export writes, or ``also``):
      refused without ``force``.

    Raises:
        ValueError, FileNotFoundError, FileExistsError naming the paths.
    """
    ck = os.path.realpath(resolve_path(path))
    target = os.path.realpath(out)
    if target == ck or target.startswith(ck.rstrip(os.sep) + os.sep):
        raise ValueError(f"{command}: the output {out} is inside the checkpoint {path} it reads ({ck}); writing there "
                         f"would destroy the checkpoint. Choose an output outside it")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"{command}: the folder of the output {out} does not exist ({parent}); create it first "
                                "or choose another output")
    if directory and os.path.isdir(out):
        present = sorted(f for f in os.listdir(out) if _EXPORT_FILES.fullmatch(f) or f in also)
        if present and not force:
            raise FileExistsError(f"{command}: {out} already holds {', '.join(present)} (an earlier export?); pass "
                                  "--force to replace them, or choose another folder")
    elif os.path.lexists(out) and not force:
        raise FileExistsError(f"{command}: {out} exists (pass --force to replace it)")


def export(path: str, out: str, fmt: str = "safetensors", max_shard_size: str = "5GB",
           dtype: Optional[str] = None, prefix: Optional[str] = None, stream=None,
           n_head: Optional[int] = None, formats: Optional[Mapping[str, Callable]] = None,
           config: Optional[str] = None, force: bool = False) -> int:
    """``axonmpi ckpt export CKPT OUT --format FMT``: the model state as safetensors files.

    ``safetensors``: full shapes under the serial ``state_dict`` names, streamed block by block,
    HF-style shards with ``model.safetensors.index.json`` above ``max_shard_size`` (see
    :func:`axonmpi.checkpoint.export_safetensors`).  The other formats are a model's (the checkpoint
    package knows no model): ``formats`` maps each name to its exporter, ``fn(path, out, *, prefix, dtype,
    max_shard_size, n_head=, config=)`` returning the paths written; the ``axonmpi`` command passes
    :data:`axonmpi.interop.EXPORT_FORMATS` (``hf-gpt2``: an axonmpi GPT saved under any layout as a directory
    ``transformers.GPT2LMHeadModel.from_pretrained`` loads; ``hf-llama``: a Llama for
    ``transformers.LlamaForCausalLM``).  ``n_head`` / ``config`` go to the exporter when given.

    ``out`` must lie outside the checkpoint and in a folder that exists (``out`` itself is created);
    files an earlier export wrote there are replaced only with ``force`` (``--force``).

    Returns:
        0 on success.
    """
    formats = dict(formats or {})
    if fmt != "safetensors" and fmt not in formats:
        hint = "" if formats else (" (the model formats hf-gpt2 and hf-llama come with the `axonmpi` command: "
                                   "axonmpi ckpt export CKPT OUT --format hf-llama)")
        raise ValueError(f"--format {fmt!r}: the export formats are: {', '.join(['safetensors', *formats])}{hint}")
    single = fmt == "safetensors" and out.endswith(".safetensors")
    check_output(path, out, force, "export", directory=not single,
                 also=("config.json",) if fmt != "safetensors" else ())
    if fmt == "safetensors":
        written = export_safetensors(path, out, max_shard_size=max_shard_size, dtype=dtype, prefix=prefix)
    else:
        options = {k: v for k, v in (("n_head", n_head), ("config", config)) if v is not None}
        written = formats[fmt](path, out, prefix=prefix, dtype=dtype, max_shard_size=max_shard_size, **options)
    (stream or sys.stdout).write("".join(f"wrote {p}\n" for p in written))
    return 0


from .._argtypes import positive_int as _heads  # noqa: E402


def _shard_size(text: str) -> str:
    from .safetensors_io import parse_size
    try:
        parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_commands(sub, formats: Optional[Mapping[str, Callable]] = None) -> None:
    """Add the ``inspect``, ``verify``, ``consolidate`` and ``export`` commands to an argparse subparsers object;
    ``formats``: the model export formats beside ``safetensors`` (name -> exporter, see :func:`export`)."""
    formats = dict(formats or {})
    p = sub.add_parser("inspect", help="list a checkpoint's entries, shapes, dtypes, shards, bytes and step; "
                                       "report missing or short shard files")
    p.add_argument("path", help="checkpoint directory (or its index.h5)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=lambda a: inspect(a.path, a.json))
    p = sub.add_parser("verify", help="check every block of a checkpoint against its checksum "
                                      "(exit 1 naming each damaged entry and file)")
    p.add_argument("path", help="checkpoint directory (or its index.h5), or a run folder: every checkpoint in it")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 also for an unfinished save (a .tmp-* or "
                                                         ".unfinished folder, which resume ignores)")
    p.set_defaults(func=lambda a: verify(a.path, a.json, strict=a.strict))
    p = sub.add_parser("consolidate", help="write a checkpoint as one plain HDF5 file of full arrays (verified)")
    p.add_argument("path", help="checkpoint directory")
    p.add_argument("out", help="output .h5 file")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=lambda a: consolidate(a.path, a.out, a.force))
    p = sub.add_parser("export", help="write a checkpoint's model as safetensors (full shapes, serial names, "
                                      "HF-style shards with model.safetensors.index.json)")
    p.add_argument("path", help="checkpoint directory")
    p.add_argument("out", help="output directory (or a single .safetensors file)")
    p.add_argument("--format", default="safetensors", choices=["safetensors", *formats],
                   help="output format: safetensors (serial names)" + "".join(
                       f"; {name}: {(fn.__doc__ or '').strip().splitlines()[0].rstrip('.')}" for name, fn in formats.items()))
    p.add_argument("--n-head", type=_heads, default=None,
                   help="hf-gpt2: the GPT's number of heads when the checkpoint does not record it "
                        "(default: extra/config/n_head, else n_embd // 64)")
    p.add_argument("--config", default=None, metavar="JSON",
                   help="hf-llama: the model's config when the checkpoint does not record it under extra/config "
                        "(a JSON file of LlamaConfig.to_dict() or a transformers config.json)")
    p.add_argument("--max-shard-size", default="5GB", type=_shard_size,
                   help="bytes per file, e.g. 5GB (10^9) or 500MiB")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32", "fp64"],
                   help="cast floating tensors (default: keep each tensor's dtype)")
    p.add_argument("--prefix", default=None, help="state key holding the model (default: 'model' if present)")
    p.add_argument("--force", action="store_true", help="replace the files of an earlier export in OUT")
    p.set_defaults(func=lambda a: export(a.path, a.out, a.format, a.max_shard_size, a.dtype, a.prefix,
                                         n_head=a.n_head, formats=formats, config=a.config,
                                         force=a.force))


def add_subparser(subparsers, formats: Optional[Mapping[str, Callable]] = None) -> argparse.ArgumentParser:
    """Register ``ckpt`` (with ``inspect``/``verify``/``consolidate``/``export``) on a top-level CLI; run it with
    ``args.func(args)``; ``formats``: the model export formats (see :func:`export`)."""
    p = subparsers.add_parser("ckpt", help="inspect, verify, consolidate or export axonmpi checkpoints",
                              description="Inspect, verify or consolidate axonmpi sharded HDF5 checkpoints.")
    add_commands(p.add_subparsers(dest="ckpt_command", required=True, metavar="{inspect,verify,consolidate,export}"),
                 formats)
    return p


def main(argv: Optional[List[str]] = None, formats: Optional[Mapping[str, Callable]] = None) -> int:
    """``python -m axonmpi.checkpoint {inspect,verify,consolidate,export} ...``; ``formats``: the model export
    formats beside ``safetensors`` (``python -m axonmpi.checkpoint`` passes :data:`axonmpi.interop.EXPORT_FORMATS`)."""
    parser = argparse.ArgumentParser(prog="python -m axonmpi.checkpoint",
                                     description="Inspect, verify or consolidate axonmpi sharded HDF5 checkpoints.")
    add_commands(parser.add_subparsers(dest="command", required=True, metavar="{inspect,verify,consolidate,export}"),
                 formats)
    args = parser.parse_args(argv)
    from ..log import run_main
    return run_main(args.func, args)  # one "error: ..." line, quiet on a closed pipe
