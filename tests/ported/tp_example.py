"""PyTorch's tensor-parallel example (pytorch/examples distributed/tensor_parallelism/tensor_parallel_example.py:
ToyModel, init_device_mesh, parallelize_module with ColwiseParallel / RowwiseParallel, AdamW, ten iterations of
forward / backward / step), ported to axonmpi by the import rule of docs/porting.md alone.

    WORLD_SIZE=2 mpiexec -n 2 python tests/ported/tp_example.py      # axonmpi (Megatron column / row layers)
    torchrun --nproc_per_node=2 tp_example_torch.py                  # the same file with torch's imports

What differs from the example's text, in both versions alike:
- the device is "cuda" where there is a GPU and "cpu" otherwise (the example names "cuda"), and the GPU-count
  check of its log_utils helper is left out with that helper (the logger is the example's, inlined);
- each iteration also prints the output's sum on every rank (a number to compare: every rank of the tensor
  group gets the same output, and so does one process);
- `WORLD_SIZE` defaults to 1 when the launcher does not set it (mpiexec does not).
The example builds its optimizer before `parallelize_module`, so (in torch as here) the optimizer holds the
parameters the plan replaced and the steps change nothing: the printed sums are those of the first weights.
"""
import os
import sys
import logging
# --- IMPORTS (PyTorch's, by the rule: the test writes them back) ---
import axonmpi as torch
import axonmpi.nn as nn

from axonmpi.distributed.tensor.parallel import (
    parallelize_module,
    ColwiseParallel,
    RowwiseParallel,
)
from axonmpi.distributed._tensor.device_mesh import init_device_mesh
# --- IMPORTS end ---

logging.basicConfig(format="%(asctime)s %(message)s", datefmt="%m/%d/%Y %I:%M:%S %p", level=logging.INFO)


def get_logger():
    return logging.getLogger(__name__)


def rank_log(_rank, logger, msg):
    """helper function to log only on global rank 0"""
    if _rank == 0:
        logger.info(f" {msg}")


class ToyModel(nn.Module):
    """MLP based model"""

    def __init__(self):
        super(ToyModel, self).__init__()
        self.in_proj = nn.Linear(10, 32)
        self.relu = nn.ReLU()
        self.out_proj = nn.Linear(32, 5)

    def forward(self, x):
        return self.out_proj(self.relu(self.in_proj(x)))


logger = get_logger()

# create a device mesh based on the given world_size.
_world_size = int(os.environ.get("WORLD_SIZE", 1))
device_type = "cuda" if torch.cuda.is_available() else "cpu"

device_mesh = init_device_mesh(device_type=device_type, mesh_shape=(_world_size,))
_rank = device_mesh.get_rank()

print(f"Starting PyTorch TP example on rank {_rank}.")

rank_log(_rank, logger, f"Device Mesh created: {device_mesh=}")

# create model and move it to GPU - init_device_mesh has already mapped GPU ids.
tp_model = ToyModel().to(device_type)

# Create an optimizer for the parallelized module.
lr = 0.25
optimizer = torch.optim.AdamW(tp_model.parameters(), lr=lr, foreach=True)

# Custom parallelization plan for the model
tp_model = parallelize_module(
    module=tp_model,
    device_mesh=device_mesh,
    parallelize_plan={
        "in_proj": ColwiseParallel(),
        "out_proj": RowwiseParallel(),
    },
)
# Perform a num of iterations of forward/backward
# and optimizations for the sharded module.
num_iters = 10
rank_log(_rank, logger, "Tensor Parallel training starting...")

for i in range(num_iters):
    # For TP, input needs to be same across all TP ranks.
    # Setting the random seed is to mimic the behavior of dataloader.
    torch.manual_seed(i)
    inp = torch.rand(20, 10, device=device_type)
    output = tp_model(inp)
    output.sum().backward()
    optimizer.step()
    sys.stdout.write(f"rank {_rank} iter {i} output sum {output.sum().item():.6f}\n")
    sys.stdout.flush()
    rank_log(_rank, logger, f"Tensor Parallel iter {i} completed")

rank_log(_rank, logger, "Tensor Parallel training completed!")
