"""PyTorch's "Writing Distributed Applications with PyTorch" (dist_tuto: the run.py template, blocking and
non-blocking point-to-point, all-reduce over new_group, dataset partitioning, distributed synchronous SGD with
average_gradients, the hand-written ring all-reduce), ported to axonmpi by the import rule of docs/porting.md.

    WORLD_SIZE=4 mpiexec -n 4 python tests/ported/dist_tuto.py      # axonmpi: each rank plays one Process
    WORLD_SIZE=4 python dist_tuto_torch.py                          # the same file with torch's imports

What differs from the tutorial's text, in both versions alike:
- the tutorial defines `run` once per section; here each section's keeps its body under its own name
  (run_blocking, run_nonblocking, run_allreduce, run: the SGD) and `run_all` calls them in turn; the two-process
  examples run on ranks 0 and 1 (the tutorial starts two processes), the rest on every rank;
- `partition_dataset` reads `synthetic_mnist` in place of `datasets.MNIST` (no download); `Net` is the small
  MNIST net of PyTorch's examples (the tutorial names it without showing it);
- the ring all-reduce gets a caller (`run_ring`) and the SGD prints its final parameters' checksum, the
  tutorial's "same model on every rank" promise made visible;
- `size` comes from the environment when set (the tutorial starts 2), and so does `MASTER_PORT` (so that
  two torch runs on one machine do not collide);
- `average_gradients` reduces `param.grad` (the Tensor, in place in both frameworks), not `param.grad.data`:
  here `.data` is the NumPy array, which the collectives reduce out of place (docs/porting.md).
"""
import os
from math import ceil
from random import Random
# --- IMPORTS (PyTorch's, by the rule: the test writes them back) ---
import axonmpi as torch
import axonmpi.distributed as dist
import axonmpi.nn as nn
import axonmpi.nn.functional as F
import axonmpi.optim as optim
from axonmpi.multiprocessing import Process
# --- IMPORTS end ---


def run_blocking(rank, size):
    """Blocking point-to-point communication."""
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        # Send the tensor to process 1
        dist.send(tensor=tensor, dst=1)
    else:
        # Receive tensor from process 0
        dist.recv(tensor=tensor, src=0)
    print('Rank ', rank, ' has data ', tensor[0])


def run_nonblocking(rank, size):
    """Non-blocking point-to-point communication."""
    tensor = torch.zeros(1)
    req = None
    if rank == 0:
        tensor += 1
        # Send the tensor to process 1
        req = dist.isend(tensor=tensor, dst=1)
        print('Rank 0 started sending')
    else:
        # Receive tensor from process 0
        req = dist.irecv(tensor=tensor, src=0)
        print('Rank 1 started receiving')
    req.wait()
    print('Rank ', rank, ' has data ', tensor[0])


def run_allreduce(rank, size):
    """All-Reduce example."""
    group = dist.new_group([0, 1])
    tensor = torch.ones(1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    print('Rank ', rank, ' has data ', tensor[0])


def run_allreduce_max(rank, size):
    """The tutorial's other operators: MAX over every rank."""
    tensor = torch.ones(1) * (rank + 1)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    print('Rank ', rank, ' has max ', tensor[0])


class Partition(object):
    """ Dataset partitioning helper """

    def __init__(self, data, index):
        self.data = data
        self.index = index

    def __len__(self):
        return len(self.index)

    def __getitem__(self, index):
        data_idx = self.index[index]
        return self.data[data_idx]


class DataPartitioner(object):

    def __init__(self, data, sizes=[0.7, 0.2, 0.1], seed=1234):
        self.data = data
        self.partitions = []
        rng = Random()
        rng.seed(seed)
        data_len = len(data)
        indexes = [x for x in range(0, data_len)]
        rng.shuffle(indexes)

        for frac in sizes:
            part_len = int(frac * data_len)
            self.partitions.append(indexes[0:part_len])
            indexes = indexes[part_len:]

    def use(self, partition):
        return Partition(self.data, self.partitions[partition])


class Net(nn.Module):
    """The small MNIST net of PyTorch's examples (two convolutions, two linear layers)."""

    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def synthetic_mnist(n=512, seed=1):
    """The data source, replaced: n 1x28x28 images, each its digit's fixed template plus noise."""
    templates = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 10, (n,), generator=g)
    data = templates[target] + torch.randn(n, 1, 28, 28, generator=g)
    return torch.utils.data.TensorDataset(data, target)


def partition_dataset():
    """ Partitioning MNIST """
    dataset = synthetic_mnist()
    size = dist.get_world_size()
    bsz = 128 // size
    partition_sizes = [1.0 / size for _ in range(size)]
    partition = DataPartitioner(dataset, partition_sizes)
    partition = partition.use(dist.get_rank())
    train_set = torch.utils.data.DataLoader(partition,
                                            batch_size=bsz,
                                            shuffle=True)
    return train_set, bsz


def average_gradients(model):
    """ Gradient averaging. """
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad.data /= size


def run(rank, size):
    """ Distributed Synchronous SGD Example """
    torch.manual_seed(1234)
    train_set, bsz = partition_dataset()
    model = Net()
    optimizer = optim.SGD(model.parameters(),
                          lr=0.01, momentum=0.5)

    num_batches = ceil(len(train_set.dataset) / float(bsz))
    for epoch in range(10):
        epoch_loss = 0.0
        for data, target in train_set:
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            epoch_loss += loss.item()
            loss.backward()
            average_gradients(model)
            optimizer.step()
        print('Rank ', dist.get_rank(), ', epoch ',
              epoch, ': ', epoch_loss / num_batches)
    checksum = sum(float(p.sum()) for p in model.parameters())
    print('Rank ', rank, ' parameter checksum ', '{:.6f}'.format(checksum))


def allreduce(send, recv):
    """ Implementation of a ring-reduce with addition. """
    rank = dist.get_rank()
    size = dist.get_world_size()
    send_buff = send.clone()
    recv_buff = send.clone()
    accum = send.clone()

    left = ((rank - 1) + size) % size
    right = (rank + 1) % size

    for i in range(size - 1):
        if i % 2 == 0:
            # Send send_buff
            send_req = dist.isend(send_buff, right)
            dist.recv(recv_buff, left)
            accum[:] += recv_buff[:]
        else:
            # Send recv_buff
            send_req = dist.isend(recv_buff, right)
            dist.recv(send_buff, left)
            accum[:] += send_buff[:]
        send_req.wait()
    recv[:] = accum[:]


def run_ring(rank, size):
    """The ring all-reduce's caller: rank r sends [r, 2r, 3r]; every rank gets the sum."""
    send = torch.tensor([1.0, 2.0, 3.0]) * rank
    recv = torch.zeros(3)
    allreduce(send, recv)
    print('Rank ', rank, ' ring sum ', ' '.join('{:.1f}'.format(v) for v in recv.tolist()))


def run_all(rank, size):
    if size >= 2:
        if rank < 2:
            run_blocking(rank, size)
            run_nonblocking(rank, size)
        run_allreduce(rank, size)
    run_allreduce_max(rank, size)
    run_ring(rank, size)
    run(rank, size)


def init_process(rank, size, fn, backend='gloo'):
    """ Initialize the distributed environment. """
    os.environ['MASTER_ADDR'] = '127.0.0.1'
    os.environ['MASTER_PORT'] = os.environ.get('MASTER_PORT', '29500')
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)


if __name__ == "__main__":
    size = int(os.environ.get("WORLD_SIZE", 2))
    processes = []
    for rank in range(size):
        p = Process(target=init_process, args=(rank, size, run_all))
        p.start()
        processes.append(p)

    for p in processes:
        p.join()
