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


def _kernels_text() -> str:
    from axonmpi import kernels
    return kernels.describe()


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
          "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"), "kernels": _kernels_text()}
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
          f"{comp['threads']} thread(s))")
    paths = sorted({r["kernels"] for r in d["ranks"]})
    print(f"kernels      {paths[0]}" + ("" if len(paths) == 1 else f" (ranks differ: {paths})"))
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
                  f"GPUs visible {r['gpus_visible']}  CUDA_VISIBLE_DEVICES={r['CUDA_VISIBLE_DEVICES']}  "
                  f"kernels {r['kernels'].split(' ')[0]}")
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


def _plan_hardware(args: argparse.Namespace):
    """The machine ``axonmpi plan`` plans for: measured now (``--measure``, collective), a shipped or saved
    file (``--hardware``), with the command line's overrides; and a note on how it was measured."""
    from axonmpi.planner import load_hardware
    note = ""
    if args.measure:
        import axonmpi
        from axonmpi.planner.measure import check_load, hardware_from_measured, load_report, measure_bandwidth
        world = axonmpi.get_world() if axonmpi.is_initialized() else axonmpi.init()
        comm = world.default_group.comm
        load, cores = comm.bcast(load_report() if world.rank == 0 else None, root=0)
        bad = check_load(load, cores)
        if bad and args.save_hardware and not args.allow_load:
            raise ValueError(f"rank {world.rank}: refusing to --save-hardware: {bad}. Measure when the load average "
                             f"(uptime) is below {cores}, or pass --allow-load to save it anyway")
        if bad and world.rank == 0:
            print(f"WARNING: {bad}; the plan below uses them (--save-hardware would refuse them)", file=sys.stderr)
        heads = args.heads or max(1, args.width // 64)
        bw = measure_bandwidth(width=args.width, seq=args.seq, heads=heads,
                               dtype="float64" if args.precision == "fp64" else "float32")
        after = comm.bcast(load_report()[0] if world.rank == 0 else None, root=0)
        per_node = args.gpus_per_node or world.local_size             # the measured run's ranks per node
        note = (f"measured on {world.world_size} ranks ({world.local_size} per node) under load average "
                f"{load:.2f} before, {after:.2f} after, on {cores} cores")
        hw = hardware_from_measured(bw, per_node, name="measured", description=note)
        if args.save_hardware:
            from axonmpi.planner.cpu import save_measured
            if world.rank == 0:
                save_measured(args.save_hardware, bw, hw.gpus_per_node, load=load, cores=cores)
    else:
        hw = load_hardware(args.hardware or "dgx-a100")
        if args.gpus_per_node:
            hw = hw.with_(gpus_per_node=args.gpus_per_node)
    over = {}
    if args.tflops is not None:
        over["matrix_flops"] = {k: args.tflops * 1e12 for k in hw.matrix_flops}
        if hw.is_measured:
            over["measured"] = {**hw.measured, "flops": args.tflops * 1e12}
    if args.bw_intra is not None:
        over["intra_bw"] = args.bw_intra * 1e9
    if args.bw_inter is not None:
        over["nic_bw"] = args.bw_inter * 1e9
    if args.cores is not None:
        over["cores"] = args.cores
    return (hw.with_(**over) if over else hw), note


def _cmd_plan(args: argparse.Namespace) -> int:
    """Rank the layouts of a transformer by predicted step time (``axonmpi.planner``: one cost model)."""
    import json

    from axonmpi.planner import ParallelLayout, TrainConfig, TransformerConfig, estimate_layout
    from axonmpi.planner.report import format_table
    from axonmpi.planner.search import search
    if args.save_hardware and not args.measure:
        raise ValueError("--save-hardware writes what --measure measured: add --measure (under mpiexec/srun)")
    hw, note = _plan_hardware(args)
    llama = args.model == "llama"
    cfg = TransformerConfig(layers=args.layers, width=args.width, heads=args.heads or max(1, args.width // 64),
                            seq=args.seq, vocab=args.vocab, ffn=args.ffn, experts=args.moe_experts,
                            top_k=args.moe_top_k, kv_heads=args.kv_heads, gated=llama or args.gated,
                            rotary=llama or args.rotary, bias=not (llama or args.no_bias),
                            tied=args.tied and not llama)
    precision = args.precision or {2: "fp16", 4: "fp32", 8: "fp64"}.get(args.dtype_bytes or 0) or (
        "fp16" if "fp16" in hw.matrix_flops else "fp32")
    train = TrainConfig(args.global_batch, args.micro_batch, precision, args.recompute, dropout=args.dropout > 0)
    limit = args.memory_gib * 2 ** 30 if args.memory_gib else None
    import axonmpi
    if axonmpi.is_initialized() and axonmpi.get_world().rank != 0:
        return 0
    if args.layout:
        lay = ParallelLayout.parse(args.layout)
        if "overlap=" not in args.layout.replace("tp_overlap=", "").replace("reduce_overlap=", ""):
            lay = lay.with_(overlap=args.overlap)
        ests = [estimate_layout(cfg, train, lay, hw, world=args.world)]
    else:
        ests = search(cfg, train, args.world, hw, memory_limit=limit, max_cp=args.max_cp, axonn=not args.no_axonn,
                      overlap=args.overlap)
    ests = ests[:args.top]
    if args.json:
        print(json.dumps({"layouts": [e.as_dict() for e in ests]}, indent=1))
        return 0
    kind = "Llama" if llama else "GPT"
    print(f"{kind} {cfg.params / 1e9:.3g}B parameters, {args.world} ranks of {hw.name} ({hw.gpus_per_node} per node"
          f"{f', {hw.cores:.2g} cores in effect' if hw.cores else ''}), global batch {train.global_batch}, "
          f"micro-batch {train.micro_batch}, {train.precision}, recompute {train.recompute}; memory limit "
          f"{(limit or hw.memory_bytes) / 2 ** 30:.0f} GiB" + (f"; {note}" if note else ""))
    print(format_table(ests, top=args.top))
    from axonmpi.planner import kernels_assumed
    print(kernels_assumed(hw))
    if args.moe_experts:
        _print_moe_plan(args, hw)
    return 0


def _print_moe_plan(args, hw) -> None:
    """Per MoE layer and rank: expert parallelism vs tensor-parallel experts over each group size."""
    from axonmpi.planner.moe import moe_options
    tokens = args.global_batch * args.seq // args.world
    hidden = args.ffn or 4 * args.width
    itemsize = {"fp16": 2, "bf16": 2, "fp32": 4, "fp64": 8}.get(args.precision or "", args.dtype_bytes or 4)
    print(f"\nMoE layer ({args.moe_experts} experts, top-{args.moe_top_k}, hidden {hidden}, {tokens} tokens per rank; "
          f"per rank and step, forward + backward; expert parallelism at uniform routing)")
    print(f"{'option':26s} {'group':>5s} {'MB moved':>10s} {'comm ms':>9s} {'expert params':>14s}")
    for n in range(2, args.world + 1):
        if args.world % n:
            continue
        for e in moe_options(tokens, args.width, hidden, args.moe_experts, args.moe_top_k, n, itemsize=itemsize):
            ms = 1e3 * e.bytes_total / hw.intra_bw
            print(f"{e.option:26s} {n:5d} {e.bytes_total / 1e6:10.2f} {ms:9.3f} {e.expert_params:14d}")


def _cmd_trace(args: argparse.Namespace) -> int:
    from axonmpi import trace
    if args.trace_command == "analyze":
        print(trace.analyze(args.dir))
    else:
        print(f"wrote {trace.merge(args.dir, args.output)} (open it in https://ui.perfetto.dev)")
    return 0


from ._argtypes import count0 as _count0, positive as _positive, positive_int as _positive_int  # noqa: E402


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
    sp = sub.add_parser(
        "plan", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="rank the parallel layouts of a transformer by predicted step time, memory and breakdown "
             "(axonmpi.planner)",
        description="""Rank every layout of a transformer (GPT or Llama shape) on a machine by predicted step time.

One cost model (axonmpi/planner/estimate.py, docs/plan.md) covers every axis: Megatron tensor parallelism
(tp, with sequence parallelism sp) or AxoNN's row x col x depth, the pipeline (pp, vp, schedule 1f1b,
interleaved, zb-h1, zbv), context (cp: ring, ulysses), experts (ep), and the data ranks (dp) as DDP,
ZeRO-1, FSDP shard_grad_op (zero=2), FSDP full shard (zero=3) and hybrid shard (shard=N), with their
bytes per rank per micro-batch, what overlaps compute and what cannot, the network bandwidth per GPU for
groups that span nodes, and the memory each needs.  On a datasheet machine (--hardware dgx-a100,
dgx-h100, perlmutter, frontier) ops take a roofline with five efficiencies fitted on Megatron 2021's
Table 1 only; held out, Korthikanti 2022 reads 5.2% mean / 10.4% worst and Megatron 2021's ZeRO-3
vs tensor x pipeline comparison (Table 2) 7.4% / 16.7%, picking the published winner at each GPU
count (Table 1, fitted: 2.5% / 5.1%).  On a measured machine (--measure under mpiexec/srun, or
--hardware cpu: this development machine's file) the same formulas take the rates measured there.
Every layout string printed is accepted by --layout; --json prints {"layouts": [...]} (--top of them).
Here, in examples/train_gpt.py and in its --layout, tp is Megatron tensor parallelism (train_gpt.py's --tp N =
--G-intra-c N --tp-style megatron); AxoNN's 3-D split is row/col/depth. Paste a printed layout into
examples/train_gpt.py --layout "..." to train under it.""")
    sp.add_argument("--world", type=_positive_int, required=True, help="number of ranks")
    sp.add_argument("--layers", type=_positive_int, required=True, help="transformer blocks")
    sp.add_argument("--width", type=_positive_int, required=True, help="hidden size")
    sp.add_argument("--seq", type=_positive_int, required=True, help="sequence length")
    sp.add_argument("--global-batch", type=_positive_int, required=True, help="sequences per step")
    sp.add_argument("--vocab", type=_positive_int, default=50304, help="vocabulary size (default 50304)")
    sp.add_argument("--heads", type=_count0, default=0, help="attention heads (default width / 64)")
    sp.add_argument("--model", choices=["gpt", "llama"], default="gpt",
                    help="gpt (default): GeLU MLP, learned positions, biases; llama: SwiGLU, rotary, no biases, untied")
    sp.add_argument("--kv-heads", type=_count0, default=0, help="key/value heads (grouped-query attention; default --heads)")
    sp.add_argument("--ffn", type=_count0, default=0, help="MLP hidden size (default 4 x width)")
    sp.add_argument("--gated", action="store_true", help="a SwiGLU MLP (three matrices)")
    sp.add_argument("--rotary", action="store_true", help="rotary position embeddings (no learned position table)")
    sp.add_argument("--no-bias", action="store_true", help="no biases in Linears and norms")
    sp.add_argument("--tied", action="store_true", help="the head shares the word embedding")
    sp.add_argument("--micro-batch", type=_positive_int, default=1, help="sequences per micro-batch (default 1)")
    sp.add_argument("--precision", choices=["fp16", "bf16", "fp32", "fp64"], default=None,
                    help="compute precision (default fp16 where the machine has it, else fp32)")
    sp.add_argument("--dtype-bytes", type=int, choices=[2, 4, 8], default=None,
                    help="bytes per element: another way to say --precision (2 fp16, 4 fp32, 8 fp64)")
    sp.add_argument("--recompute", choices=["none", "selective", "full"], default="none",
                    help="activation recomputation (default none)")
    sp.add_argument("--dropout", type=float, default=0.0, help="dropout probability of the run (default 0: none)")
    sp.add_argument("--hardware", default=None,
                    help="a shipped machine (dgx-a100 (default), dgx-h100, perlmutter, frontier; cpu: this "
                         "development machine, measured) or a hardware JSON file (--save-hardware writes one)")
    sp.add_argument("--measure", action="store_true",
                    help="measure this allocation (under mpiexec/srun: GEMM rate, kernels, bandwidth and latency "
                         "between computation, cores in effect) and plan with it; reports the load average")
    sp.add_argument("--save-hardware", default=None, metavar="PATH",
                    help="with --measure: write the measured numbers as a hardware JSON file (refused when the load "
                         "average exceeds the cores, unless --allow-load)")
    sp.add_argument("--allow-load", action="store_true",
                    help="save measured figures even when the machine was loaded (they describe the load)")
    sp.add_argument("--gpus-per-node", type=_positive_int, default=None, help="ranks per node (default: the "
                    "hardware file's; with --measure the run's)")
    sp.add_argument("--tflops", type=_positive, default=None, help="override: matrix TFLOP/s per rank")
    sp.add_argument("--bw-intra", type=_positive, default=None, help="override: GB/s of a rank's link inside a node")
    sp.add_argument("--bw-inter", type=_positive, default=None, help="override: GB/s of a rank's network card")
    sp.add_argument("--cores", type=_positive, default=None,
                    help="override: cores per node; more ranks than cores stretch compute")
    sp.add_argument("--memory-gib", type=_positive, default=None,
                    help="leave out layouts needing more per rank (default: the hardware's memory)")
    sp.add_argument("--layout", default=None,
                    help="estimate one layout, as the table prints it: tp=8,pp=12,dp=16[,vp=2][,cp=..][,ep=..][,sp=1]"
                         "[,zero=0|1|2|3][,shard=N][,row=..,col=..,depth=..][,schedule=1f1b|interleaved|zb-h1|zbv]"
                         "[,overlap=0][,reduce_overlap=0][,tp_overlap=1]")
    sp.add_argument("--top", type=_positive_int, default=20, help="layouts shown (and printed by --json; default 20)")
    sp.add_argument("--json", action="store_true", help='print {"layouts": [...]} as JSON')
    sp.add_argument("--max-cp", type=_positive_int, default=1, help="largest context-parallel size searched")
    sp.add_argument("--no-axonn", action="store_true", help="leave AxoNN 3-D tensor layouts out of the search")
    sp.add_argument("--overlap", type=int, choices=[0, 1], default=1,
                    help="1 (default): gradients reduced during the backward and FSDP's gathers prefetched, as "
                         "axonmpi's runtime does (where the machine progresses collectives under compute); 0: after it")
    sp.add_argument("--moe-experts", type=_count0, default=0,
                    help="every MLP a mixture of E experts; also prints expert parallelism vs tensor-parallel experts")
    sp.add_argument("--moe-top-k", type=int, default=1, choices=[1, 2], help="experts per token (with --moe-experts)")
    sp.set_defaults(func=_cmd_plan)
    sp = sub.add_parser("plot", help="loss and tokens/s curves of --metrics-json files into a PNG (axonmpi.plot; needs "
                                     "pip install 'axonmpi[plot]')")
    sp.add_argument("files", nargs="+", help="JSON Lines files written by examples/train_gpt.py --metrics-json, or run "
                    "folders (their metrics.jsonl: the trainer writes one into its --checkpoint-dir)")
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
