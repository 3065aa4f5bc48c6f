"""The ``axonmpi`` command: environment info, local launches and checkpoint tools."""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

__all__ = ["main", "build_parser"]


def _cmd_info(args: argparse.Namespace) -> int:
    """Print versions, the MPI library, CUDA/CuPy status and (under mpiexec) the rank layout."""
    import h5py
    import numpy as np
    from mpi4py import MPI

    import axonmpi
    from axonmpi import backend
    from axonmpi.distributed.backends.mpi import cuda_aware_mpi

    world = axonmpi.init()
    if world.rank == 0:
        lib = MPI.Get_library_version().splitlines()[0].strip()
        print(f"axonmpi      {axonmpi.__version__}")
        print(f"python       {sys.version.split()[0]}  ({sys.executable})")
        print(f"numpy        {np.__version__}")
        print(f"mpi4py       {__import__('mpi4py').__version__}   MPI {'.'.join(map(str, MPI.Get_version()))}: {lib}")
        print(f"h5py         {h5py.__version__}   HDF5 {h5py.version.hdf5_version}   parallel HDF5: "
              f"{'yes' if h5py.get_config().mpi else 'no'}")
        cp = backend.get_cupy()
        print(f"cupy         {'not available' if cp is None else cp.__version__}   CUDA devices: {backend.device_count()}")
        print(f"CUDA-aware MPI declared (AXONMPI_CUDA_AWARE_MPI): {'yes' if cuda_aware_mpi() else 'no'}")
        print(f"debug mode (AXONMPI_DEBUG): {'on' if world.debug else 'off'}")
        print(f"world        {world.world_size} rank(s) on {world.num_nodes} node(s)")
    layout = axonmpi.gather_object((world.rank, MPI.Get_processor_name(), world.local_rank, str(world.device)))
    if world.rank == 0 and args.ranks:
        for r, host, lr, dev in layout:
            print(f"  rank {r:>4}  host {host}  local_rank {lr}  device {dev}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    """``mpiexec -n N python SCRIPT ARGS`` with one BLAS thread per rank."""
    import subprocess

    from axonmpi.testing import mpiexec_path

    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, str(args.threads))
    env.setdefault("PYTHONUNBUFFERED", "1")
    cmd = [mpiexec_path(), "-n", str(args.n), sys.executable, args.script, *args.script_args]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.call(cmd, env=env)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="axonmpi", description="axonmpi: MPI-native distributed deep learning.")
    p.add_argument("--version", action="version", version=f"axonmpi {__import__('axonmpi').__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sp = sub.add_parser("info", help="versions, MPI library, GPUs; under mpiexec also the rank layout")
    sp.add_argument("--ranks", action="store_true", help="list every rank's host, local rank and device")
    sp.set_defaults(func=_cmd_info)
    sp = sub.add_parser("run", help="run a script on N local ranks (mpiexec -n N python SCRIPT ...)")
    sp.add_argument("-n", type=int, default=4, help="number of ranks (default 4)")
    sp.add_argument("--threads", type=int, default=1, help="BLAS/OpenMP threads per rank (default 1)")
    sp.add_argument("script", help="the Python script")
    sp.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    sp.set_defaults(func=_cmd_run)
    try:
        from axonmpi.checkpoint import cli as ckpt_cli
    except ImportError:  # pragma: no cover - checkpoint CLI always ships
        ckpt_cli = None
    if ckpt_cli is not None and hasattr(ckpt_cli, "add_subparser"):
        ckpt_cli.add_subparser(sub)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``axonmpi`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
