"""FSDP checkpoints: shards written without gathering, loaded at another world size (FSDP 4 -> FSDP 2 ->
DDP 3 -> serial 1), parameters and optimizer state equal (training continues identically)."""
import numpy as np
import pytest

import axonmpi
from axonmpi import Tensor, checkpoint, nn
from axonmpi.parallel import FSDP

GB = 12         # global batch (divides 1, 2, 3, 4)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(5, 7, dtype=np.float64)
        self.l2 = nn.Linear(7, 3, dtype=np.float64)
        self.scale = nn.Parameter(np.array([1.5, 0.5, 2.0]))

    def forward(self, x):
        return self.l2(self.l1(x).tanh()) * self.scale


def _make():
    axonmpi.manual_seed(0)
    return Net()


X = np.random.default_rng(1).standard_normal((8, GB, 5))
Y = np.random.default_rng(2).standard_normal((8, GB, 3))


def _steps(model, opt, steps, rank, size):
    b = GB // size
    for s in steps:
        opt.zero_grad()
        ((model(Tensor(X[s][rank * b:(rank + 1) * b])) - Tensor(Y[s][rank * b:(rank + 1) * b])) ** 2).mean().backward()
        if isinstance(model, FSDP):
            model.clip_grad_norm_(0.5)
        else:
            axonmpi.optim.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()


def _assert_close(a, b, what):
    assert np.max(np.abs(a - b)) <= 1e-10 * np.max(np.abs(b)), what


@pytest.mark.mpi(min_size=4)
def test_fsdp4_to_fsdp2_to_ddp3_to_serial(tmp_path_factory):
    world = axonmpi.init()
    path = axonmpi.broadcast_object(str(tmp_path_factory.mktemp("ckpt")) if world.rank == 0 else None) + "/fsdp"
    g4 = world.new_group([0, 1, 2, 3])
    g2 = world.new_group([0, 1])
    g3 = world.new_group([0, 1, 2])
    g1 = world.new_group([0])
    if g4.is_member:
        m = FSDP(_make(), group=g4)
        opt = axonmpi.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        _steps(m, opt, range(3), g4.rank, 4)
        checkpoint.save(path, {"model": m.sharded_state_dict(), "optim": m.optim_state_dict(opt)}, group=g4)
        _steps(m, opt, range(3, 6), g4.rank, 4)
        want = m.state_dict()
    want = axonmpi.broadcast_object(want if world.rank == 0 else None)
    if g2.is_member:                         # FSDP at 2 ranks resumes from the 4-rank shards
        m2 = FSDP(_make(), group=g2)
        opt2 = axonmpi.optim.AdamW(m2.parameters(), lr=1.0)
        state = {"model": m2.sharded_state_dict(), "optim": m2.optim_state_dict(opt2)}
        state["optim"]["state"] = {}         # no state yet: an empty dict loads everything saved under it
        state = checkpoint.load(path, state, group=g2)
        m2.load_state_dict(state["model"])
        m2.load_optim_state_dict(opt2, state["optim"])
        assert opt2.param_groups[0]["lr"] == 1e-2
        _steps(m2, opt2, range(3, 6), g2.rank, 2)
        for k, v in m2.state_dict().items():
            _assert_close(v, want[k], f"FSDP 2: {k}")
    if g3.is_member:                         # DDP at 3 ranks reads the full arrays and the named state
        ddp = axonmpi.DDP(_make(), group=g3)
        dopt = _load_full(ddp.module, checkpoint.load(path, None, group=g3))
        _steps(ddp, dopt, range(3, 6), g3.rank, 3)
        for k, v in ddp.state_dict().items():
            _assert_close(v, want[k], f"DDP 3: {k}")
    if g1.is_member:                         # a serial model (and a serial AdamW) from the same files
        ref = _make()
        ropt = _load_full(ref, checkpoint.load(path, None, group=g1))
        _steps(ref, ropt, range(3, 6), 0, 1)
        for k, v in ref.state_dict().items():
            _assert_close(v, want[k], f"serial: {k}")


def _load_full(model, full):
    """Load FSDP's named, flattened checkpoint into an unsharded model and a fresh AdamW."""
    sd = model.state_dict()
    model.load_state_dict({k: np.asarray(full["model"][k]).reshape(sd[k].shape) for k in sd})
    opt = axonmpi.optim.AdamW(model.parameters(), lr=1.0)
    names = [n for n, _ in model.named_parameters()]
    osd = full["optim"]
    opt.load_state_dict({
        "state": {i: {k: (np.asarray(v).reshape(sd[n].shape) if np.ndim(v) else v)
                      for k, v in osd["state"][n].items()} for i, n in enumerate(names)},
        "param_groups": [{**{k: v for k, v in osd["param_groups"][0].items() if k != "params"},
                          "params": list(range(len(names)))}]})
    return opt
