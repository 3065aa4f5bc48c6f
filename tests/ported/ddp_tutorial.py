"""PyTorch's "Getting Started with Distributed Data Parallel" (setup / cleanup, ToyModel, demo_basic,
demo_checkpoint, run_demo with mp.spawn), ported to axonmpi by the import rule of docs/porting.md alone.

    WORLD_SIZE=4 mpiexec -n 4 python tests/ported/ddp_tutorial.py     # axonmpi: each rank plays one worker
    WORLD_SIZE=4 python ddp_tutorial_torch.py                         # the same file with torch's imports

What differs from the tutorial's text, in both versions alike:
- after each optimizer step a rank prints its loss and a checksum of its parameters (DDP's promise, the same
  model on every rank, made visible); the checkpoint demo also prints the checksum right after loading;
- the world size comes from the environment when set (the tutorial runs 2), and so does `MASTER_PORT`
  (so that two torch runs on one machine do not collide), and the checkpoint lands in `CKPT_DIR` when set;
- demo_model_parallel (8 GPUs) is left out, as the tutorial's own main leaves it out below 8 GPUs.
Under CPU-only torch, tests/ported/torch_cpu/sitecustomize.py answers `.to(rank)` and `device_ids=[rank]`
as axonmpi does on a host without a GPU (the CPU).
"""
import os
import sys
import tempfile
# --- IMPORTS (PyTorch's, by the rule: the test writes them back) ---
import axonmpi as torch
import axonmpi.distributed as dist
import axonmpi.nn as nn
import axonmpi.optim as optim
import axonmpi.multiprocessing as mp

from axonmpi.nn.parallel import DistributedDataParallel as DDP
# --- IMPORTS end ---


def setup(rank, world_size):
    os.environ['MASTER_ADDR'] = 'localhost'
    os.environ['MASTER_PORT'] = os.environ.get('MASTER_PORT', '12355')

    # initialize the process group
    dist.init_process_group("gloo", rank=rank, world_size=world_size)

    # the same seed on every process: the models start from the same weights
    torch.manual_seed(42)


def cleanup():
    dist.destroy_process_group()


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def report(tag, rank, model, loss=None):
    checksum = sum(float(p.sum()) for p in model.parameters())
    line = f"{tag} rank {rank} checksum {checksum:.6f}" + ("" if loss is None else f" loss {loss.item():.6f}")
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def demo_basic(rank, world_size):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)

    # create model and move it to GPU with id rank
    model = ToyModel().to(rank)
    ddp_model = DDP(model, device_ids=[rank])

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5).to(rank)
    loss = loss_fn(outputs, labels)
    loss.backward()
    optimizer.step()
    report("basic", rank, ddp_model, loss)

    cleanup()


def run_demo(demo_fn, world_size):
    mp.spawn(demo_fn,
             args=(world_size,),
             nprocs=world_size,
             join=True)


def demo_checkpoint(rank, world_size):
    print(f"Running DDP checkpoint example on rank {rank}.")
    setup(rank, world_size)

    model = ToyModel().to(rank)
    ddp_model = DDP(model, device_ids=[rank])

    CHECKPOINT_PATH = os.environ.get("CKPT_DIR", tempfile.gettempdir()) + "/model.checkpoint"
    if rank == 0:
        # every rank holds the same parameters (same start, synchronized gradients): one saves them
        torch.save(ddp_model.state_dict(), CHECKPOINT_PATH)

    # Use a barrier() to make sure that process 1 loads the model after process 0 saves it.
    dist.barrier()
    # configure map_location properly
    map_location = {'cuda:%d' % 0: 'cuda:%d' % rank}
    ddp_model.load_state_dict(
        torch.load(CHECKPOINT_PATH, map_location=map_location))
    report("loaded", rank, ddp_model)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5).to(rank)
    loss = loss_fn(outputs, labels)
    loss.backward()
    optimizer.step()
    report("checkpoint", rank, ddp_model, loss)

    # Use a barrier() to make sure that all processes have finished reading the checkpoint
    dist.barrier()

    if rank == 0:
        os.remove(CHECKPOINT_PATH)

    cleanup()


if __name__ == "__main__":
    world_size = int(os.environ.get("WORLD_SIZE", 2))
    run_demo(demo_basic, world_size)
    run_demo(demo_checkpoint, world_size)
