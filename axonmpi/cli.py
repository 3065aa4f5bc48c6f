"""The ``axonmpi`` command: environment info, local launches and checkpoint tools."""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

__all__ = ["main", "build_parser", "data_dir", "info_dict"]


_THREAD_LEVELS = {0: "single", 1: "funneled", 2: "serialized", 3: "multiple"}


def _cuda_aware_text() -> str:
    """``yes``/``no`` (declared by AXONMPI_CUDA_AWARE or reported by MPI) or ``unknown``."""
    from axonmpi import env
    from axonmpi.distributed.backends.mpi import query_cuda_support

    v = env.get_tribool("AXONMPI_CUDA_AWARE")
    if v is None:
        v = env.get_tribool("AXONMPI_CUDA_AWARE_MPI")
    src = "declared"
    if v is None:
        v, src = query_cuda_support(), "reported by MPI"
    return "unknown" if v is None else f"{'yes' if v else 'no'} ({src})"


def info_dict(world) -> dict:
    """Everything ``axonmpi info`` reports, as a dict (collective: every rank reports its GPUs).

    Example:
        >>> d = info_dict(axonmpi.init()); d["mpi"]["thread_level"]
        'multiple'
    """
    import h5py
    import mpi4py
    import numpy as np
    from mpi4py import MPI

    import axonmpi
    from axonmpi import backend
    from axonmpi.distributed.backends.nccl import nccl_available, nccl_version

    cp = backend.get_cupy()
    cuda = None
    if cp is not None:
        rt = cp.cuda.runtime
        v, d = rt.runtimeGetVersion(), rt.driverGetVersion()
        cuda = {"runtime": f"{v // 1000}.{v % 1000 // 10}", "driver": f"{d // 1000}.{d % 1000 // 10}"}
    me = {"rank": world.rank, "host": MPI.Get_processor_name(), "local_rank": world.local_rank,
          "device": str(world.device), "gpus_visible": backend.device_count(),
          "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}
    ranks = axonmpi.gather_object(me)
    return {
        "axonmpi": axonmpi.__version__,
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "numpy": np.__version__,
        "mpi4py": mpi4py.__version__,
        "mpi": {"standard": ".".join(map(str, MPI.Get_version())),
                "library": MPI.Get_library_version().splitlines()[0].strip(),
                "thread_level": _THREAD_LEVELS.get(MPI.Query_thread(), str(MPI.Query_thread())),
                "cuda_aware": _cuda_aware_text()},
        "compute": backend.host_compute(),
        "h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version, "parallel_hdf5": bool(h5py.get_config().mpi),
        "cupy": None if cp is None else cp.__version__,
        "cuda": cuda,
        "nccl": nccl_version() if (cp is not None or nccl_available()) else None,
        "backend": world.backend.value,
        "debug": world.debug,
        "world_size": world.world_size, "num_nodes": world.num_nodes,
        "ranks": ranks,
    }


def _cmd_info(args: argparse.Namespace) -> int:
    """Print versions, the MPI library, CUDA/CuPy/NCCL status and GPUs per rank (``--json``: as JSON)."""
    import axonmpi

    world = axonmpi.init()
    d = info_dict(world)
    if world.rank != 0:
        return 0
    if args.json:
        import json
        print(json.dumps(d, indent=2))
        return 0
    mpi, cuda = d["mpi"], d["cuda"]
    print(f"axonmpi      {d['axonmpi']}")
    print(f"python       {d['python']}  ({d['python_executable']})")
    print(f"numpy        {d['numpy']}")
    comp = d["compute"]
    print(f"compute      {comp['cpu']} ({comp['cores']} cores): BLAS {comp['blas']} ({comp['kernels'] or '?'} kernels, "
          f"{comp['threads']} thread(s)); elementwise: NumPy ufuncs in place")
    for note in comp["notes"]:
        print(f"  note: {note}")
    print(f"mpi4py       {d['mpi4py']}   MPI {mpi['standard']}: {mpi['library']}")
    print(f"MPI threads  {mpi['thread_level']}")
    print(f"CUDA-aware MPI: {mpi['cuda_aware']}")
    print(f"h5py         {d['h5py']}   HDF5 {d['hdf5']}   parallel HDF5: {'yes' if d['parallel_hdf5'] else 'no'}")
    print(f"cupy         {d['cupy'] or 'not available'}   CUDA "
          f"{'-' if cuda is None else cuda['runtime'] + ' (driver ' + cuda['driver'] + ')'}   "
          f"NCCL {d['nccl'] or '-'}")
    arrays = "device arrays" if d['cupy'] else "host arrays over MPI; no CuPy, so no device arrays"
    print(f"backend      {d['backend']} ({arrays})   debug mode (AXONMPI_DEBUG): {'on' if d['debug'] else 'off'}")
    print(f"world        {d['world_size']} rank(s) on {d['num_nodes']} node(s)")
    gpus = sorted({r["gpus_visible"] for r in d["ranks"]})
    print(f"GPUs visible per rank: {', '.join(map(str, gpus))}")
    if args.ranks:
        for r in d["ranks"]:
            print(f"  rank {r['rank']:>4}  host {r['host']}  local_rank {r['local_rank']}  device {r['device']}  "
                  f"GPUs visible {r['gpus_visible']}  CUDA_VISIBLE_DEVICES={r['CUDA_VISIBLE_DEVICES']}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    """``mpiexec -n N python SCRIPT ARGS`` with the MPI beside this Python."""
    import subprocess

    from axonmpi.distributed.launch import mpiexec_path

    env = dict(os.environ)
    if args.threads is not None:
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = str(args.threads)
    env.setdefault("PYTHONUNBUFFERED", "1")
    cmd = [mpiexec_path(), "-n", str(args.n), sys.executable, args.script, *args.script_args]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.call(cmd, env=env)


def data_dir(name: str) -> str:
    """The folder of the shipped ``jobs`` or ``examples`` (package data in an install, the repo's in a clone)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for cand in (os.path.join(here, "_data", name), os.path.join(os.path.dirname(here), name)):
        if os.path.isdir(cand):
            return cand
    raise FileNotFoundError(f"no {name}/ shipped with this axonmpi install ({here}); reinstall with "
                            "`pip install .` from a clone or `pip install git+<repo url>`")


def _cmd_write(args: argparse.Namespace) -> int:
    """Copy the shipped job templates into DIR/jobs (with ``--examples`` the example scripts into DIR/examples)."""
    import shutil

    os.makedirs(args.dir, exist_ok=True)
    written = []
    for name in ("jobs", "examples") if args.examples else ("jobs",):
        src = data_dir(name)
        dst = os.path.join(args.dir, name)
        os.makedirs(dst, exist_ok=True)
        for f in sorted(os.listdir(src)):
            if f.startswith((".", "__")) or not os.path.isfile(os.path.join(src, f)):
                continue
            target = os.path.join(dst, f)
            if os.path.exists(target) and not args.force:
                raise FileExistsError(f"{target} exists (pass --force to replace it)")
            shutil.copy2(os.path.join(src, f), target)
            written.append(target)
    for w in written:
        print(w)
    print(f"{len(written)} file(s) written; edit {os.path.join(args.dir, 'jobs', 'site.sh')} (modules, venv, "
          f"scratch) and the #SBATCH lines, then submit from {args.dir}: sbatch jobs/slurm_ddp_1node.sbatch",
          file=sys.stderr)
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from axonmpi.plot import plot_metrics
    print(plot_metrics(args.files, args.output))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from axonmpi import plan as P
    args.gpus_per_node_set = args.gpus_per_node is not None
    if args.gpus_per_node is None:
        args.gpus_per_node = 8
    if args.hardware not in (None, "cpu") or (args.hardware is None and args.heads):
        return _cmd_plan_model(args)
    hw = P.Hardware(bw_intra=args.bw_intra * 1e9, bw_inter=args.bw_inter * 1e9, flops=args.tflops * 1e12,
                    gpus_per_node=args.gpus_per_node, cores=args.cores)
    if args.hardware == "cpu" and not args.measure:    # the shipped measurement of the development allocation
        from axonmpi.planner.cpu import hardware_from_spec
        hw = hardware_from_spec("cpu", args.gpus_per_node if args.gpus_per_node_set else None)
    if args.measure:
        bw = P.measure_bandwidth(width=args.width, seq=args.seq, heads=args.heads or max(1, args.width // 64),
                                 dtype="float32" if args.dtype_bytes == 4 else "float64")
        import axonmpi
        per_node = hw.gpus_per_node if args.gpus_per_node_set else axonmpi.get_world().local_size  # the measured run's
        hw = P.Hardware.from_measured(bw, per_node, args.cores)
        if args.save_hardware:
            from axonmpi.planner.cpu import save_measured
            if axonmpi.get_world().rank == 0:
                save_measured(args.save_hardware, bw, hw.gpus_per_node)
    model = P.Model(layers=args.layers, width=args.width, seq=args.seq, global_batch=args.global_batch,
                    vocab=args.vocab, dtype_bytes=args.dtype_bytes, heads=args.heads)
    limit = args.memory_gib * 2 ** 30 if args.memory_gib else None
    import axonmpi
    if axonmpi.is_initialized() and axonmpi.get_world().rank != 0:
        return 0
    if args.layout:
        from axonmpi.planner.cpu import legacy_layout
        lay, fsdp, m = legacy_layout(args.layout, args.world)
        ests = [P.estimate(model, lay, hw, microbatches=m, fsdp=fsdp)]
    else:
        ests = P.plan(model, args.world, hw, memory_limit=limit)
    if args.json:
        import json
        from axonmpi.planner.cpu import legacy_json
        print(json.dumps({"layouts": [legacy_json(e, model) for e in ests]}, indent=1))
        return 0
    print(f"GPT {model.params / 1e6:.1f}M weights on {args.world} ranks ({hw.gpus_per_node} per node); "
          f"bandwidth intra {hw.bw_intra / 1e9:.1f} GB/s, inter {hw.bw_inter / 1e9:.1f} GB/s"
          f"{' (measured)' if args.measure else ''}, latency {hw.latency * 1e6:.1f} us; "
          f"{hw.flops / 1e12:.3f} TFLOP/s per rank{' (measured GEMM)' if args.measure else ''}"
          f"{f', {hw.cores:.2g} cores per node' if hw.cores else ''}")
    print(P.format_plan(ests, top=args.top, dtype_bytes=model.dtype_bytes))
    if args.moe_experts:
        _print_moe_plan(P, args, hw)
    return 0


def _cmd_plan_model(args: argparse.Namespace) -> int:
    """The planner's cost model of every axis on a described machine (``axonmpi.planner``)."""
    import json

    from axonmpi.planner import ParallelLayout, TrainConfig, TransformerConfig, estimate_layout, load_hardware
    from axonmpi.planner.search import search
    from axonmpi.planner.report import format_table
    if not args.heads:
        raise ValueError(f"--hardware {args.hardware or 'dgx-a100'} plans with the full cost model, which needs "
                         "--heads (attention heads)")
    hw = load_hardware(args.hardware or "dgx-a100")
    if args.gpus_per_node_set:
        hw = hw.with_(gpus_per_node=args.gpus_per_node)
    cfg = TransformerConfig(layers=args.layers, width=args.width, heads=args.heads, seq=args.seq, vocab=args.vocab,
                            ffn=args.ffn, experts=args.moe_experts, top_k=args.moe_top_k)
    train = TrainConfig(args.global_batch, args.micro_batch, args.precision, args.recompute)
    limit = args.memory_gib * 2 ** 30 if args.memory_gib else None
    if args.layout:
        lay = ParallelLayout.parse(args.layout)
        if "overlap=" not in args.layout:
            lay = lay.with_(overlap=args.overlap)
        ests = [estimate_layout(cfg, train, lay, hw, world=args.world)]
    else:
        ests = search(cfg, train, args.world, hw, memory_limit=limit, max_cp=args.max_cp, axonn=not args.no_axonn,
                      overlap=args.overlap)
    if args.json:
        print(json.dumps({"layouts": [e.as_dict() for e in ests]}, indent=1))
        return 0
    print(f"GPT {cfg.params / 1e9:.2f}B parameters, {args.world} GPUs of {hw.name} ({hw.gpus_per_node} per node), "
          f"global batch {train.global_batch}, micro-batch {train.micro_batch}, {train.precision}, recompute "
          f"{train.recompute}; memory limit {(limit or hw.memory_bytes) / 2 ** 30:.0f} GiB")
    print(format_table(ests, top=args.top))
    return 0


def _print_moe_plan(P, args, hw) -> None:
    """Per MoE layer and rank: expert parallelism vs tensor-parallel experts over each group size."""
    tokens = args.global_batch * args.seq // args.world
    hidden = 4 * args.width
    print(f"\nMoE layer ({args.moe_experts} experts, top-{args.moe_top_k}, hidden {hidden}, {tokens} tokens per rank; "
          f"per rank and step, forward + backward; expert parallelism at uniform routing)")
    print(f"{'option':26s} {'group':>5s} {'MB moved':>10s} {'comm ms':>9s} {'expert params':>14s}")
    for n in range(2, args.world + 1):
        if args.world % n:
            continue
        for e in P.moe_options(tokens, args.width, hidden, args.moe_experts, args.moe_top_k, n,
                               itemsize=args.dtype_bytes):
            ms = 1e3 * e.bytes_total / hw.bw_intra
            print(f"{e.option:26s} {n:5d} {e.bytes_total / 1e6:10.2f} {ms:9.3f} {e.expert_params:14d}")


def _cmd_trace(args: argparse.Namespace) -> int:
    from axonmpi import trace
    if args.trace_command == "analyze":
        print(trace.analyze(args.dir))
    else:
        print(f"wrote {trace.merge(args.dir, args.output)} (open it in https://ui.perfetto.dev)")
    return 0


from ._argtypes import count0 as _count0, positive as _positive, positive_int as _positive_int  # noqa: E402


def _amount0(text: str) -> float:
    """A number >= 0."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not 0 <= x < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return x


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="axonmpi", description="axonmpi: MPI-native distributed deep learning.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--version", action="version", version=f"axonmpi {__import__('axonmpi').__version__}")
    p.add_argument("--traceback", action="store_true", help="show the full traceback of an error")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sp = sub.add_parser("info", help="versions, MPI library, GPUs; under mpiexec also the rank layout")
    sp.add_argument("--ranks", action="store_true", help="list every rank's host, local rank, device and GPUs")
    sp.add_argument("--json", action="store_true", help="print everything as one JSON object (rank 0)")
    sp.set_defaults(func=_cmd_info)
    sp = sub.add_parser("run", help="run a script on N local ranks (mpiexec -n N python SCRIPT ...)",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sp.add_argument("-n", type=_positive_int, default=4, help="number of ranks")
    sp.add_argument("--threads", type=_positive_int, default=None,
                    help="BLAS/OpenMP threads per rank (default: axonmpi.init() uses 1 when ranks share a node)")
    sp.add_argument("script", help="the Python script")
    sp.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    sp.set_defaults(func=_cmd_run)
    sp = sub.add_parser("jobs", help="job templates (Slurm, local) shipped with axonmpi")
    jsub = sp.add_subparsers(dest="jobs_command", required=True, metavar="{write}")
    w = jsub.add_parser("write", help="copy the job templates into DIR/jobs (with --examples also DIR/examples)")
    w.add_argument("dir", help="destination folder (created)")
    w.add_argument("--examples", action="store_true", help="also write the example scripts into DIR/examples/")
    w.add_argument("--force", action="store_true", help="replace files that exist")
    w.set_defaults(func=_cmd_write)
    sp = sub.add_parser("plan", help="rank the (G_data, G_inter, G_intra_r, G_intra_c, G_intra_d) layouts of a GPT "
                        "by predicted step time (axonmpi.plan)", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sp.add_argument("--world", type=_positive_int, required=True, help="number of ranks")
    sp.add_argument("--layers", type=_positive_int, required=True, help="transformer blocks")
    sp.add_argument("--width", type=_positive_int, required=True, help="hidden size")
    sp.add_argument("--seq", type=_positive_int, required=True, help="sequence length")
    sp.add_argument("--global-batch", type=_positive_int, required=True, help="sequences per step")
    sp.add_argument("--vocab", type=_positive_int, default=50304, help="vocabulary size")
    sp.add_argument("--gpus-per-node", type=_positive_int, default=None, help="ranks per node (default: with "
                    "--measure the run's, else the --hardware file's, else 8)")
    sp.add_argument("--dtype-bytes", type=_positive_int, default=4, help="bytes per element")
    sp.add_argument("--bw-intra", type=_positive, default=50.0, help="GB/s inside a node")
    sp.add_argument("--bw-inter", type=_positive, default=12.5, help="GB/s between nodes")
    sp.add_argument("--tflops", type=_positive, default=50.0, help="TFLOP/s per rank")
    sp.add_argument("--cores", type=_amount0, default=0.0,
                    help="cores per node; more ranks than cores stretch compute (0: one per rank)")
    sp.add_argument("--memory-gib", type=_positive, default=None, help="leave out layouts needing more per rank")
    sp.add_argument("--top", type=_positive_int, default=20, help="rows shown")
    sp.add_argument("--moe-experts", type=_count0, default=0,
                    help="also estimate one MoE layer of E experts: expert parallelism vs tensor-parallel experts")
    sp.add_argument("--moe-top-k", type=int, default=1, choices=[1, 2], help="experts per token (with --moe-experts)")
    sp.add_argument("--measure", action="store_true",
                    help="time all-reduces and a GEMM on this allocation for the bandwidths, latency, flop rate and "
                         "cores (run under mpiexec/srun)")
    sp.add_argument("--hardware", default=None,
                    help="a shipped machine (dgx-a100, dgx-h100, perlmutter, frontier: the full cost model of "
                         "axonmpi.planner; cpu: HybridGPT's model with this allocation's measured numbers) or a JSON file")
    sp.add_argument("--heads", type=_count0, default=0, help="attention heads (the full cost model)")
    sp.add_argument("--ffn", type=_count0, default=0, help="MLP hidden size (default 4 x width)")
    sp.add_argument("--micro-batch", type=_positive_int, default=1, help="sequences per micro-batch")
    sp.add_argument("--precision", choices=["fp16", "bf16", "fp32", "fp64"], default="fp16",
                    help="compute precision (the full cost model)")
    sp.add_argument("--recompute", choices=["none", "selective", "full"], default="none",
                    help="activation recomputation (the full cost model)")
    sp.add_argument("--layout", default=None,
                    help="estimate one layout: tp=8,pp=12,dp=16[,vp=2][,cp=..][,ep=..][,sp=1][,zero=0|1|3]"
                         "[,row=..,col=..,depth=..][,schedule=1f1b|interleaved|zb-h1|zbv]")
    sp.add_argument("--json", action="store_true", help='print {"layouts": [...]} as JSON')
    sp.add_argument("--max-cp", type=_positive_int, default=1, help="largest context-parallel size searched")
    sp.add_argument("--no-axonn", action="store_true", help="leave AxoNN 3-D tensor layouts out of the search")
    sp.add_argument("--overlap", type=int, choices=[0, 1], default=1,
                    help="1: gradients reduced during the backward (DDP buckets, FSDP prefetch) as axonmpi's "
                         "runtime does; 0: after it")
    sp.add_argument("--save-hardware", default=None, metavar="PATH",
                    help="with --measure: write the measured numbers as a hardware JSON file")
    sp.set_defaults(func=_cmd_plan)
    sp = sub.add_parser("plot", help="loss and tokens/s curves of --metrics-json files into a PNG (axonmpi.plot; needs "
                                     "pip install 'axonmpi[plot]')")
    sp.add_argument("files", nargs="+", help="JSON Lines files written by examples/train_gpt.py --metrics-json")
    sp.add_argument("-o", "--output", default="metrics.png", help="the PNG to write")
    sp.set_defaults(func=_cmd_plot)
    sp = sub.add_parser("trace", help="flight records and timelines: analyze DIR (first divergence), merge DIR")
    tsub = sp.add_subparsers(dest="trace_command", required=True, metavar="{analyze,merge}")
    t = tsub.add_parser("analyze", help="read DIR/flight_rank*.json and name the first call where ranks diverge")
    t.add_argument("dir")
    t.set_defaults(func=_cmd_trace)
    t = tsub.add_parser("merge", help="merge DIR/trace_rank*.json into one timeline DIR/trace.json")
    t.add_argument("dir")
    t.add_argument("-o", "--output", default=None, help="the merged file (default DIR/trace.json)")
    t.set_defaults(func=_cmd_trace)
    from axonmpi.checkpoint import cli as ckpt_cli
    from axonmpi.interop import EXPORT_FORMATS
    ckpt_cli.add_subparser(sub, formats=EXPORT_FORMATS)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``axonmpi`` console script (and ``python -m axonmpi``)."""
    from axonmpi.log import run_main

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return run_main(args.func, args, traceback=args.traceback)


if __name__ == "__main__":
    sys.exit(main())
