"""The AxoNN user guide's steps (docs/user_guide.rst of axonn-ai/axonn: init torch.distributed, ax.init,
ax.create_dataloader, a model built under auto_parallelize, training), ported to axonmpi by changing
only the imports.

    AXONN_GRID=G_data,G_intra_r,G_intra_c,G_intra_d mpiexec -n N python tests/ported/axonn_guide.py

tests/test_ported.py runs it at 1, 2 and 4 ranks and runs the same file with PyTorch's and AxoNN's
imports under torch at one process (AxoNN needs CUDA and NCCL, so there ``axonn`` is a one-process
stand-in, tests/ported/torch_axonn: the guide's meaning on one GPU, with axonmpi's initial weights
and sample order). Tensor parallelism is exact, so every grid prints the one-process losses.

Two choices of this file that the guide leaves open: ``sync_gradients(net, mean=True)`` (AxoNN's
default sums over the data replicas; the mean keeps the serial global-batch loss's gradient), and
the reported loss is the mean over all ranks (ranks of one tensor-parallel block hold the same loss).
"""
import os

import numpy as np
# --- IMPORTS (PyTorch and AxoNN: the block the test swaps in) ---
import axonmpi as torch
import axonmpi.nn as nn
import axonmpi.distributed as dist
import axonmpi as ax
from axonmpi.intra_layer import auto_parallelize, sync_gradients
from axonmpi.utils.data import TensorDataset
# --- IMPORTS end ---

G_data, G_intra_r, G_intra_c, G_intra_d = (int(v) for v in os.environ.get("AXONN_GRID", "1,1,1,1").split(","))
EPOCHS, GLOBAL_BATCH = 2, 32

# Step 1: initialize torch.distributed, then AxoNN's grid
dist.init_process_group(backend="gloo")          # the guide: backend='nccl'
ax.init(G_data=G_data, G_intra_r=G_intra_r, G_intra_c=G_intra_c, G_intra_d=G_intra_d, G_inter=1)
torch.manual_seed(0)

# Step 2: a dataset and AxoNN's dataloader (the global batch over all GPUs)
rng = np.random.default_rng(0)
centers = rng.standard_normal((4, 16))
labels = rng.integers(0, 4, 256)
inputs = (centers[labels] + 0.8 * rng.standard_normal((256, 16))).astype(np.float32)
dataset = TensorDataset(torch.from_numpy(inputs), torch.from_numpy(labels.astype(np.int64)))
train_loader = ax.create_dataloader(dataset, global_batch_size=GLOBAL_BATCH, num_workers=0)

# Step 3: the model, its Linear layers tensor parallel
with auto_parallelize():
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))

optimizer = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
loss_fn = nn.CrossEntropyLoss()
world = dist.get_world_size()
for epoch in range(EPOCHS):
    train_loader.sampler.set_epoch(epoch)
    for step, (x, y) in enumerate(train_loader):
        optimizer.zero_grad()
        loss = loss_fn(net(x), y)
        loss.backward()
        sync_gradients(net, mean=True)
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if dist.get_rank() == 0:
            print(f"epoch {epoch} step {step} loss {mean.item() / world:.7f}", flush=True)
dist.destroy_process_group()
