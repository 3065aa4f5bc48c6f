"""``ax.init`` and ``ax.create_dataloader`` at one process (see the package's docstring)."""
import torch

import axonmpi
from axonmpi.data import DistributedSampler


def init(G_inter=1, G_data=1, G_intra_r=1, G_intra_c=1, G_intra_d=1, **kw):
    sizes = dict(G_inter=G_inter, G_data=G_data, G_intra_r=G_intra_r, G_intra_c=G_intra_c, G_intra_d=G_intra_d)
    if any(v != 1 for v in sizes.values()):
        raise ValueError(f"this stand-in runs AxoNN's API on one process; got {sizes}")
    axonmpi.manual_seed(0)


def create_dataloader(dataset, global_batch_size, micro_batch_size=None, num_workers=0, *args, **kwargs):
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True)
    return torch.utils.data.DataLoader(dataset, batch_size=global_batch_size, sampler=sampler,
                                       num_workers=num_workers, drop_last=True)
