"""Test-only: lets CPU-only PyTorch run the GPU tutorials in tests/ported/ the way axonmpi runs them on a
host without a GPU, so that tests/test_ported.py can run the same file under both.

On PYTHONPATH only for the torch runs of tests/test_ported.py (spawned workers inherit it). Where torch sees
no GPU it makes torch answer a tutorial's GPU calls as axonmpi does on such a host (docs/porting.md):
``.to(rank)`` / ``.to("cuda")`` is the CPU, ``torch.cuda.set_device`` does nothing, ``torch.cuda.Event`` times
on the host clock, ``init_process_group("nccl")`` runs gloo, ``DDP(device_ids=[rank])`` of a CPU module
is DDP with no device ids, and FSDP with no ``device_id`` runs on the CPU, where ``CPUOffload(offload_params=True)``
has nothing to move (torch's FSDP1 otherwise refuses a host without an accelerator, and pins offloaded memory). Nothing else changes. Imports torch only when it is installed.
"""
import importlib.util
import time

if importlib.util.find_spec("torch") is not None:
    import torch
    import torch.distributed as _dist
    import torch.nn.parallel as _par

    if not torch.cuda.is_available():
        def _cpu(d):
            if isinstance(d, bool):
                return d
            if isinstance(d, int) or (isinstance(d, str) and d.startswith("cuda")) or (
                    isinstance(d, torch.device) and d.type == "cuda"):
                return "cpu"
            return d

        def _moved(to):
            def f(self, *args, **kw):
                if "device" in kw:
                    kw["device"] = _cpu(kw["device"])
                return to(self, *[_cpu(a) for a in args], **kw)
            f.__doc__ = to.__doc__
            return f

        torch.Tensor.to = _moved(torch.Tensor.to)
        torch.nn.Module.to = _moved(torch.nn.Module.to)
        torch.cuda.set_device = lambda device: None

        class _Event:
            def __init__(self, enable_timing=False, blocking=False, interprocess=False):
                self._t = None

            def record(self, stream=None):
                self._t = time.perf_counter()

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return (end._t - self._t) * 1000.0

        torch.cuda.Event = _Event
        _init = _dist.init_process_group

        def _init_gloo(backend=None, *args, **kw):
            return _init("gloo" if backend == "nccl" else backend, *args, **kw)

        _dist.init_process_group = _init_gloo
        _ddp_init = _par.DistributedDataParallel.__init__

        def _ddp(self, module, device_ids=None, *args, **kw):
            _ddp_init(self, module, None, *args, **kw)

        _par.DistributedDataParallel.__init__ = _ddp
        import torch.distributed.fsdp as _fsdp
        _fsdp_init = _fsdp.FullyShardedDataParallel.__init__

        def _fsdp_cpu(self, module, *args, **kw):
            if kw.get("device_id") is None:
                kw["device_id"] = torch.device("cpu")
            kw.pop("cpu_offload", None)         # the parameters are on the host already
            _fsdp_init(self, module, *args, **kw)

        _fsdp.FullyShardedDataParallel.__init__ = _fsdp_cpu
