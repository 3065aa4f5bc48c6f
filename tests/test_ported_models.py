"""issue 48: three model files written for PyTorch, ported by the import rule alone (tests/ported_cases.py), equal
PyTorch serially (float64): karpathy/minGPT's ``mingpt/model.py`` (its ``NewGELU`` written with ``math.sqrt`` /
``torch.tanh`` / ``torch.pow``, the ``register_buffer`` causal mask, ``configure_optimizers`` deciding decay by
module class and parameter name, ``torch.optim.AdamW(optim_groups, betas=...)``, ``generate`` with ``top_k``),
nanoGPT's ``model.py`` and a small ViT (class token, broadcast positions, a 0-d temperature, a gain shared by two
blocks).  From the same initial weights: the logits, then 3 steps of the file's own optimizer with clipping (each
loss, each clip norm, every parameter after), and ``generate``'s tokens.  Skipped without torch.
"""
import numpy as np
import pytest

import axonmpi
from axonmpi.nn.utils import clip_grad_norm_

import ported_cases as pc

TOL = 1e-10
NAMES = ("nanogpt", "mingpt", "vit")


def _rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300)) if b.size else 0.0


def test_mingpt_builds_its_groups_and_generates_without_torch():
    """minGPT's configure_optimizers by class and name: the Linear weights (9 of 29) decayed, as serially under
    torch's rule; its mask buffer is in the state dict; generate(top_k) greedy and sampled."""
    axonmpi.manual_seed(0)
    model = pc.build("mingpt")
    opt = pc.optimizer("mingpt", model)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = sorted(names[id(p)] for p in opt.param_groups[0]["params"])
    assert decayed == sorted(n for n in names.values() if n.endswith("weight") and ("c_" in n or "lm_head" in n))
    assert opt.param_groups[0]["weight_decay"] == pc.WD and opt.param_groups[1]["weight_decay"] == 0.0
    assert "transformer.h.0.attn.bias" in model.state_dict()
    x, _ = pc.batch("mingpt", 0, 2)
    model.eval()
    out = model.generate(axonmpi.tensor(x[:, :3]), 4, top_k=3)
    assert tuple(out.shape) == (2, 7)
    sampled = model.generate(axonmpi.tensor(x[:, :3]), 4, do_sample=True, top_k=2)
    assert tuple(sampled.shape) == (2, 7)


@pytest.mark.parametrize("name", NAMES)
def test_ported_file_equals_torch(name):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as TF
    axonmpi.manual_seed(0)
    ours = pc.build(name)
    torch.manual_seed(0)
    theirs = pc.build(name, torch_version=True)
    sd = {k: np.asarray(v) for k, v in ours.state_dict().items()}
    assert sorted(sd) == sorted(theirs.state_dict())
    theirs.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in sd.items()})
    o_opt, t_opt = pc.optimizer(name, ours), pc.optimizer(name, theirs)
    assert [len(g["params"]) for g in o_opt.param_groups] == [len(g["params"]) for g in t_opt.param_groups]
    to_t = lambda a: torch.from_numpy(np.asarray(a))
    for step in range(3):
        x, y = pc.batch(name, step)
        o_opt.zero_grad()
        t_opt.zero_grad()
        lo = pc.loss(name, ours, x, y)
        lt = pc.loss(name, theirs, x, y, F_=TF, to=to_t)
        assert _rel(lo.item(), lt.item()) <= TOL, (step, lo.item(), lt.item())
        lo.backward()
        lt.backward()
        no = float(clip_grad_norm_(ours.parameters(), pc.MAX_NORM))
        nt = float(torch.nn.utils.clip_grad_norm_(theirs.parameters(), pc.MAX_NORM))
        assert nt > pc.MAX_NORM and _rel(no, nt) <= TOL, (step, no, nt)
        o_opt.step()
        t_opt.step()
    t_sd = theirs.state_dict()
    for k, v in ours.state_dict().items():
        assert _rel(v, t_sd[k].detach().numpy()) <= TOL, k
    if name != "vit":
        ours.eval()
        theirs.eval()
        x, _ = pc.batch(name, 9, 2)
        k = 1 if name == "nanogpt" else 3          # nanoGPT's generate always samples: top_k=1 makes it greedy
        with torch.no_grad():
            want = theirs.generate(to_t(x[:, :3]), 4, top_k=k).numpy()
        got = np.asarray(ours.generate(axonmpi.tensor(x[:, :3]), 4, top_k=k).numpy())
        np.testing.assert_array_equal(got, want)
