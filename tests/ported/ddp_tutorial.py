"""PyTorch's DDP tutorial ("Getting Started with Distributed Data Parallel": ToyModel, demo_basic,
demo_checkpoint, in its torchrun form), ported to axonmpi by changing only the imports.

    mpiexec -n 4 python tests/ported/ddp_tutorial.py          # axonmpi
    torchrun --nproc_per_node=4 ddp_tutorial_torch.py        # the same file with PyTorch's imports

tests/test_ported.py swaps the import block (between the two IMPORTS markers) for PyTorch's and
checks both print the same losses. Two things differ from the tutorial's text, in both versions
alike, so the two frameworks start from the same numbers: the initial weights and the batches
come from a seeded NumPy generator (torch.randn and axonmpi.randn draw different numbers), and
device_ids is [rank] only where there is a GPU (torch's DDP refuses device_ids for a CPU module).
"""
import os
import sys
import tempfile

import numpy as np
# --- IMPORTS (PyTorch: the block the test swaps in) ---
import axonmpi as torch
import axonmpi.distributed as dist
import axonmpi.nn as nn
import axonmpi.optim as optim
from axonmpi.parallel import DistributedDataParallel as DDP
# --- IMPORTS end ---

STEPS = int(os.environ.get("STEPS", "4"))


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def same_start(model):
    """Seeded NumPy weights (not in the tutorial: both frameworks start from the same numbers)."""
    rng = np.random.default_rng(1234)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.from_numpy(rng.uniform(-0.3, 0.3, tuple(p.shape)).astype(np.float32)))


def batch(rank, step):
    """The tutorial's torch.randn(20, 10) inputs and torch.randn(20, 5) labels, from NumPy."""
    rng = np.random.default_rng(100 * rank + step)
    return (torch.from_numpy(rng.standard_normal((20, 10)).astype(np.float32)),
            torch.from_numpy(rng.standard_normal((20, 5)).astype(np.float32)))


def train(ddp_model, device, rank, tag, first_step=0):
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.1)
    for step in range(first_step, first_step + STEPS):
        inputs, labels = batch(rank, step)
        optimizer.zero_grad()
        outputs = ddp_model(inputs.to(device))
        loss = loss_fn(outputs, labels.to(device))
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.SUM)           # in place, as torch's
        mean = mean / dist.get_world_size()
        sys.stdout.write(f"{tag} rank {rank} step {step} loss {loss.item():.7f} mean {mean.item():.7f}\n")
        sys.stdout.flush()                                     # one write: ranks' lines do not interleave


def demo_basic(rank, device, device_ids):
    print(f"Running basic DDP example on rank {rank}.")
    model = ToyModel().to(device)
    same_start(model)
    ddp_model = DDP(model, device_ids=device_ids)
    train(ddp_model, device, rank, "basic")


def demo_checkpoint(rank, device, device_ids, ckpt_dir):
    print(f"Running DDP checkpoint example on rank {rank}.")
    model = ToyModel().to(device)
    same_start(model)
    ddp_model = DDP(model, device_ids=device_ids)
    train(ddp_model, device, rank, "before")

    CHECKPOINT_PATH = os.path.join(ckpt_dir, "model.checkpoint")
    if rank == 0:
        # All processes should see same parameters as they all start from same
        # random parameters and gradients are synchronized in backward passes.
        # Therefore, saving it in one process is sufficient.
        torch.save(ddp_model.state_dict(), CHECKPOINT_PATH)

    # Use a barrier() to make sure that process 1 loads the model after process 0 saves it.
    dist.barrier()
    # configure map_location properly
    map_location = {"cuda:%d" % 0: "cuda:%d" % rank}
    saved = {k: v.clone() for k, v in ddp_model.state_dict().items()} if hasattr(
        next(iter(ddp_model.state_dict().values())), "clone") else dict(ddp_model.state_dict())
    with torch.no_grad():                                      # scramble, so the load is what restores them
        for p in ddp_model.parameters():
            p.mul_(0.0)
    ddp_model.load_state_dict(torch.load(CHECKPOINT_PATH, map_location=map_location, weights_only=True))
    for k, v in ddp_model.state_dict().items():
        assert np.array_equal(np.asarray(v), np.asarray(saved[k])), f"rank {rank}: {k} differs after load"
    train(ddp_model, device, rank, "after", first_step=STEPS)

    # Not necessary to use a dist.barrier() to guard the file deletion below
    # as the AllReduce ops in the backward pass of DDP already served as
    # a synchronization.
    dist.barrier()
    if rank == 0:
        os.remove(CHECKPOINT_PATH)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"Start running basic DDP example on rank {rank}.")
    if torch.cuda.is_available():
        device_id = rank % torch.cuda.device_count()
        device, device_ids = device_id, [device_id]
    else:
        device, device_ids = "cpu", None
    ckpt_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.gettempdir()
    demo_basic(rank, device, device_ids)
    demo_checkpoint(rank, device, device_ids, ckpt_dir)
    dist.destroy_process_group()
    print(f"Finished running DDP example on rank {rank}.")


if __name__ == "__main__":
    main()
