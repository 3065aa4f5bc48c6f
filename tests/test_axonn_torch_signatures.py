"""AxoNN's and PyTorch's signatures: init(G_inter, G_data, ...) positionally, create_dataloader with
micro_batch_size/num_workers, FSDP's PyTorch auto_wrap_policy callables, device_id, use_orig_params."""
import functools

import numpy as np
import pytest

import axonmpi
from axonmpi import Tensor, nn
from axonmpi.data import TensorDataset, create_dataloader
from axonmpi.parallel import FSDP
from axonmpi.parallel.fsdp import find_units, size_based_auto_wrap_policy, transformer_auto_wrap_policy


@pytest.mark.mpi
def test_init_axonn_positional_order_and_comm():
    from mpi4py import MPI
    world = axonmpi.init()
    n = world.world_size
    assert axonmpi.init(1, n) is world                  # AxoNN: init(G_inter, G_data, G_intra_r, ...)
    assert axonmpi.init(1, n, 1, 1, 1) is world and axonmpi.init(MPI.COMM_WORLD) is world
    with pytest.raises(TypeError, match="G_inter given twice"):
        axonmpi.init(1, n, G_inter=1)
    if n > 1:
        with pytest.raises(ValueError):
            axonmpi.init(1, 1, n)                        # another grid than the existing World's


@pytest.mark.mpi
def test_create_dataloader_axonn_signature():
    world = axonmpi.init()
    n = world.world_size
    ds = TensorDataset(np.arange(48 * n, dtype=np.float64).reshape(-1, 1))
    dl = create_dataloader(ds, 8 * n, 2, 2)             # AxoNN's positional order, 2 worker threads
    assert dl.batch_size == 8 and dl.micro_batch_size == 2 and dl.micro_batches == 4 and dl.num_workers == 2
    ref = create_dataloader(ds, global_batch_size=8 * n)
    assert ref.micro_batch_size == 8 and ref.micro_batches == 1
    for a, b in zip(dl, ref):
        assert np.array_equal(a[0], b[0])
    with pytest.raises(ValueError, match="micro_batch_size=3 must be a positive int dividing the per-replica batch 8"):
        create_dataloader(ds, 8 * n, 3)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6, dtype=np.float64)
        self.b = nn.Linear(6, 6, dtype=np.float64)

    def forward(self, x):
        return self.b(self.a(x).tanh())


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(6, 2, dtype=np.float64)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.mark.serial
def test_torch_style_policies_pick_units():
    net = Net()
    names = lambda p: [q for q, _ in find_units(net, p)]   # noqa: E731
    assert names(functools.partial(size_based_auto_wrap_policy, min_num_params=50)) == ["blocks.0", "blocks.1"]
    assert names(functools.partial(size_based_auto_wrap_policy, min_num_params=40)) == [
        "blocks.0.a", "blocks.0.b", "blocks.1.a", "blocks.1.b"]
    assert names(functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})) == ["blocks.0", "blocks.1"]
    assert names(lambda module, recurse, nonwrapped_numel: recurse or isinstance(module, nn.Linear)) == [
        "blocks.0.a", "blocks.0.b", "blocks.1.a", "blocks.1.b", "head"]


@pytest.mark.mpi
def test_fsdp_torch_policy_trains_like_serial():
    axonmpi.init()
    axonmpi.manual_seed(0)
    ref = Net()
    axonmpi.manual_seed(0)
    m = FSDP(Net(), auto_wrap_policy=lambda module, recurse, nonwrapped_numel: recurse or nonwrapped_numel >= 50,
             device_id="cpu", sync_module_states=True)
    assert [u.name for u in m._all_units if u.name] == ["blocks.0", "blocks.1"]
    x = np.random.default_rng(0).standard_normal((4, 6))
    a = m(Tensor(x)).sum().item()
    b = ref(Tensor(x)).sum().item()
    assert abs(a - b) <= 1e-12 * abs(b)
    with pytest.raises(NotImplementedError, match="use_orig_params=True"):
        FSDP(Net(), use_orig_params=True)
    with pytest.raises(TypeError, match="device_id"):
        FSDP(Net(), device_id=1.5)
