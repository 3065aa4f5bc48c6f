"""safetensors both ways: byte-identical to the ``safetensors`` package, HF-style shards, an FSDP
checkpoint (saved at every world size, 4 included) exported and read back by a serial model and by
``safetensors.numpy.load_file``; ``consolidate`` writes full shapes with the umask's mode."""
import json
import os
import stat

import numpy as np
import pytest

import axonmpi
from axonmpi import Tensor, checkpoint, nn
from axonmpi.checkpoint import cli as ckpt_cli
from axonmpi.checkpoint.safetensors_io import from_bfloat16_bits, parse_size, to_bfloat16_bits
from axonmpi.parallel import FSDP

st = pytest.importorskip("safetensors.numpy")


def _state():
    rng = np.random.default_rng(0)
    return {"wte.weight": rng.standard_normal((7, 5)).astype(np.float32),
            "h.0.ln.bias": rng.standard_normal(5).astype(np.float32),
            "scale": rng.standard_normal((2, 3)),             # float64
            "count": np.arange(4, dtype=np.int64),
            "mask": np.array([True, False]),
            "half": rng.standard_normal(3).astype(np.float16),
            "empty": np.zeros((0, 3), np.float32)}


@pytest.mark.serial
def test_single_file_is_byte_identical_to_the_package(tmp_path):
    sd = _state()
    ours = tmp_path / "ours.safetensors"
    checkpoint.save_safetensors(sd, str(ours))
    assert ours.read_bytes() == st.save(sd, metadata={"format": "pt"})
    theirs = tmp_path / "theirs.safetensors"
    st.save_file(sd, str(theirs))
    back = checkpoint.load_safetensors(str(theirs))
    assert list(back) == sorted(sd, key=list(back).index) and set(back) == set(sd)
    for k, v in sd.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and np.array_equal(back[k], v), k


@pytest.mark.serial
def test_sharded_export_like_hugging_face(tmp_path):
    sd = _state()
    out = tmp_path / "hf"
    written = checkpoint.save_safetensors(sd, str(out), max_shard_size=100)
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(idx["weight_map"].values()))
    assert len(files) > 1 and [os.path.basename(p) for p in written[:-1]] == files
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert idx["metadata"]["total_size"] == sum(v.nbytes for v in sd.values())
    for f in files:   # each shard is what the package writes for its tensors
        names = [k for k, v in idx["weight_map"].items() if v == f]
        assert (out / f).read_bytes() == st.save({k: sd[k] for k in names}, metadata={"format": "pt"})
        assert sum(sd[k].nbytes for k in names) <= 100 or len(names) == 1
    back = checkpoint.load_safetensors(str(out))
    assert set(back) == set(sd) and all(np.array_equal(back[k], sd[k]) for k in sd)
    checkpoint.save_safetensors(sd, str(out))   # a re-export into the folder replaces the old shards
    assert sorted(os.listdir(out)) == ["model.safetensors"]


@pytest.mark.serial
def test_bfloat16_rounds_like_torch():
    # torch.tensor(x, dtype=torch.float32).to(torch.bfloat16).view(torch.int16) for these x
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3.4028235e38, 1e-40, np.inf, 0.1], np.float32)
    want = np.array([0x3F80, 0x3F80, 0x3F82, 0xC020, 0x7F80, 0x0001, 0x7F80, 0x3DCD], np.uint16)
    assert np.array_equal(to_bfloat16_bits(x), want)
    assert from_bfloat16_bits(want)[3] == -2.5 and np.isnan(from_bfloat16_bits(to_bfloat16_bits(np.float32([np.nan]))))
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 << 20
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("5 parsecs")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(5, 7, dtype=np.float64)
        self.l2 = nn.Linear(7, 3, dtype=np.float64)

    def forward(self, x):
        return self.l2(self.l1(x).tanh())


def _make():
    axonmpi.manual_seed(0)
    return Net()


@pytest.mark.mpi
def test_fsdp_checkpoint_to_safetensors_roundtrip(tmp_path_factory):
    world = axonmpi.init()
    root = axonmpi.broadcast_object(str(tmp_path_factory.mktemp("st")) if world.rank == 0 else None)
    m = FSDP(_make())
    opt = axonmpi.optim.AdamW(m.parameters(), lr=1e-2)
    x = np.random.default_rng(1).standard_normal((4, 5))
    opt.zero_grad()
    (m(Tensor(x)) ** 2).mean().backward()
    opt.step()
    checkpoint.save(root + "/ck", {"model": m.sharded_state_dict(), "optim": m.optim_state_dict(opt), "step": 1})
    want = m.state_dict()
    if world.rank == 0:
        old = os.umask(0o022)
        try:
            ckpt_cli.main(["export", root + "/ck", root + "/hf", "--max-shard-size", "200"])
            ckpt_cli.main(["consolidate", root + "/ck", root + "/full.h5"])
        finally:
            os.umask(old)
        import h5py
        with h5py.File(root + "/full.h5") as f:  # full shapes, readable by the group and others
            assert f["model/l1.weight"].shape == (7, 5) and f["optim/state/l1.weight/exp_avg"].shape == (7, 5)
            assert np.array_equal(f["model/l1.weight"][...], want["l1.weight"])
        assert stat.S_IMODE(os.stat(root + "/full.h5").st_mode) == 0o644
        files = json.loads(open(root + "/hf/model.safetensors.index.json").read())["weight_map"]
        assert set(files) == set(want) and len(set(files.values())) > 1
        assert stat.S_IMODE(os.stat(root + "/hf/" + files["l1.weight"]).st_mode) == 0o644
        theirs = {}
        for f in set(files.values()):
            theirs.update(st.load_file(root + "/hf/" + f))
        serial = Net()
        serial.load_state_dict(checkpoint.load_safetensors(root + "/hf"))
        for k, v in want.items():
            assert theirs[k].shape == v.shape and np.array_equal(theirs[k], v), k
            assert np.array_equal(serial.state_dict()[k], v), k
        ckpt_cli.main(["export", root + "/ck", root + "/bf", "--dtype", "bf16"])
        bf = checkpoint.load_safetensors(root + "/bf")
        assert np.array_equal(bf["l2.bias"], from_bfloat16_bits(to_bfloat16_bits(want["l2.bias"])))
    sub = world.new_group([0])
    if sub.is_member:   # a plain template of each parameter's own shape loads the flattened save in place
        tmpl = {k: np.zeros_like(v) for k, v in _make().state_dict().items()}
        out = checkpoint.load(root + "/ck", {"model": tmpl}, group=sub, strict=False)
        for k, v in want.items():
            assert out["model"][k] is tmpl[k] and np.array_equal(tmpl[k], v), k
    axonmpi.barrier()
