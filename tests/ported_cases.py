"""Three model files written for PyTorch by others (or in their style), ported by the import rule alone, loaded
for the tests (issue 48): karpathy/nanoGPT's ``model.py`` (tests/ported/nanogpt), karpathy/minGPT's
``mingpt/model.py`` (tests/ported/mingpt) and a small ViT (tests/ported/vit).

``CASES[name]`` builds each tiny and in float64 (``.double()``, as a torch user does), with its own optimizer
(``configure_optimizers``), its own loss (nanoGPT's and minGPT's ``forward(idx, targets)`` return
``(logits, loss)``; the ViT's logits go to ``F.cross_entropy``) and a batch per step.  ``load(name, torch_module)``
loads the same file with the rule undone (``import torch``) for the parity tests under torch.

What the tests add from outside the files (a user's training script, not their model file): the Megatron plan
and the ``ModelPlan`` declaring their own modules for sequence parallelism, and, for the two GPTs, a
``pipeline_layers()`` written by the documented protocol (docs/parallelize.md) in a subclass.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys
import types

import numpy as np

import axonmpi
import axonmpi.nn as nn
import axonmpi.nn.functional as F
from axonmpi import Tensor

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ported")
FILES = {"nanogpt": os.path.join(ROOT, "nanogpt", "model.py"),
         "mingpt": os.path.join(ROOT, "mingpt", "mingpt", "model.py"),
         "vit": os.path.join(ROOT, "vit", "model.py")}
V, T, E, HEADS, LAYERS = 16, 8, 16, 2, 2
N_PATCH, PATCH, CLASSES = 4, 12, 5
WD, LR, BETAS, MAX_NORM = 0.1, 1e-2, (0.9, 0.95), 0.05


def undo_rule(line: str) -> str:
    if line.strip() == "import axonmpi as torch":
        return "import torch"
    return line.replace("axonmpi", "torch")


_LOADED = {}


def load(name: str, torch_version: bool = False) -> types.ModuleType:
    """The ported file as a module (``torch_version``: its import lines written back to torch's)."""
    key = (name, torch_version)
    if key in _LOADED:
        return _LOADED[key]
    mingpt_root = os.path.join(ROOT, "mingpt")
    if mingpt_root not in sys.path:
        sys.path.insert(0, mingpt_root)          # minGPT's `from mingpt.utils import CfgNode` (plain Python)
    text = open(FILES[name], encoding="utf-8").read()
    if torch_version:
        text = "\n".join(undo_rule(ln) if ln.startswith(("import ", "from ")) else ln for ln in text.splitlines())
        assert not any("axonmpi" in ln for ln in text.splitlines() if ln.startswith(("import ", "from ")))
    mod = types.ModuleType(f"ported_{name}_{'torch' if torch_version else 'axonmpi'}")
    mod.__file__ = FILES[name]
    sys.modules[mod.__name__] = mod
    exec(compile(text, FILES[name], "exec"), mod.__dict__)
    _LOADED[key] = mod
    return mod


def _quiet(fn):
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()):
        return fn()


# -- the models ----------------------------------------------------------------------------------------------
def build(name: str, torch_version: bool = False):
    """The model in float64 from the file's own constructor (its own init; seed it before)."""
    mod = load(name, torch_version)
    if name == "nanogpt":
        cfg = mod.GPTConfig(block_size=T, vocab_size=V, n_layer=LAYERS, n_head=HEADS, n_embd=E, dropout=0.0,
                            bias=True)
        model = _quiet(lambda: mod.GPT(cfg))
    elif name == "mingpt":
        cfg = mod.GPT.get_default_config()
        cfg.merge_from_dict(dict(model_type=None, n_layer=LAYERS, n_head=HEADS, n_embd=E, vocab_size=V,
                                 block_size=T, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0))
        model = _quiet(lambda: mod.GPT(cfg))
    else:
        model = mod.VisionTransformer(n_patch=N_PATCH, patch_dim=PATCH, dim=E, depth=LAYERS, num_heads=HEADS,
                                      num_classes=CLASSES)
    return model.double()


def optimizer(name: str, model):
    """The file's own ``configure_optimizers`` on the user's model object."""
    if name == "nanogpt":
        return _quiet(lambda: model.configure_optimizers(WD, LR, BETAS, "cpu"))
    if name == "mingpt":
        from mingpt.utils import CfgNode
        return model.configure_optimizers(CfgNode(weight_decay=WD, learning_rate=LR, betas=BETAS))
    return model.configure_optimizers(WD, LR, BETAS)


def batch(name: str, step: int, rows: int = 8):
    """``(x, y)`` host arrays of the global batch of ``step``."""
    rng = np.random.default_rng(100 + step)
    if name == "vit":
        return rng.standard_normal((rows, N_PATCH, PATCH)), rng.integers(0, CLASSES, rows)
    return rng.integers(0, V, (rows, T)), rng.integers(0, V, (rows, T))


def loss(name: str, model, x, y, F_=F, to=None):
    """The loss the file's own code computes (``to``: host array -> the framework's tensor)."""
    to = to or (lambda a: a if isinstance(a, Tensor) else Tensor(np.asarray(a)))
    if name == "vit":
        return F_.cross_entropy(model(to(x)), to(y))
    return model(to(x), to(y))[1]


def pipeline_loss(name: str):
    """The loss a pipeline applies to its last stage's output (the model's own loss code, by the PipelinePlan)."""
    if name == "vit":
        return lambda out, y: F.cross_entropy(out, _raw(y))
    return functools.partial(_lm_loss, ignore_index=-1)


def _lm_loss(logits, y, ignore_index=-100):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), _raw(y).reshape(-1), ignore_index=ignore_index)


def _raw(y):
    return y.data if isinstance(y, Tensor) else np.asarray(y)


# -- what a training script adds ------------------------------------------------------------------------------
class _GPTEmbed(nn.Module):
    """The embedding-plus-positions step of nanoGPT's / minGPT's ``forward``."""

    def __init__(self, tr):
        super().__init__()
        self.wte, self.wpe, self.drop = tr.wte, tr.wpe, tr.drop

    def forward(self, idx):
        pos = axonmpi.arange(0, idx.shape[1], dtype=axonmpi.long)
        return self.drop(self.wte(idx) + self.wpe(pos))


class _GPTHead(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.ln_f, self.lm_head = model.transformer.ln_f, model.lm_head

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


def with_pipeline_layers(model):
    """The two GPTs have no ``pipeline_layers()``: the documented protocol, given from outside the file (the
    class is kept: its name, its ``configure_optimizers``)."""
    cls = type(model)
    sub = type(cls.__name__, (cls,), {"pipeline_layers": lambda self: [_GPTEmbed(self.transformer),
                                                                      *self.transformer.h, _GPTHead(self)],
                                      "__module__": cls.__module__})
    model.__class__ = sub
    return model


def megatron_plan(name: str):
    """Megatron 1-D: the MLPs split (their attention is their own code: a fused qkv that ``split``-s by the
    whole width cannot take a column split; it stays replicated)."""
    if name == "vit":
        return {"blocks.*.mlp.fc1": "column", "blocks.*.mlp.fc2": "row"}
    return {"transformer.h.*.mlp.c_fc": "column", "transformer.h.*.mlp.c_proj": "row"}


def sequence_tp_plan(name: str):
    """The Megatron plan under sequence parallelism: the region leaves at the head, which all-gathers its output
    (``"column_gather"``); nanoGPT's head is tied to ``wte``, so both are split over the vocabulary."""
    plan = dict(megatron_plan(name))
    if name == "nanogpt":
        plan.update({"transformer.wte": "vocab", "lm_head": "column_gather"})
    elif name == "mingpt":
        plan["lm_head"] = "column_gather"
    return plan


def sequence_plan(name: str):
    """``ModelPlan`` for sequence parallelism: the GPTs' region after their embeddings (their own position
    numbering stays outside), their own modules declared: blocks, norms and activations ``token_local``, their
    attention ``whole_sequence``."""
    from axonmpi.parallel import ModelPlan, SequenceRegion
    mod = load(name)
    if name == "nanogpt":
        return ModelPlan(sequence_region=SequenceRegion(enter="transformer.drop", leave="lm_head",
                                                        outside=("transformer.wte", "transformer.wpe")),
                         token_local=(mod.GPT, mod.Block, mod.MLP, mod.LayerNorm, _GPTEmbed, _GPTHead),
                         whole_sequence=(mod.CausalSelfAttention,))
    if name == "mingpt":
        return ModelPlan(sequence_region=SequenceRegion(enter="transformer.drop", leave="lm_head",
                                                        outside=("transformer.wte", "transformer.wpe")),
                         token_local=(mod.GPT, mod.Block, mod.NewGELU, _GPTEmbed, _GPTHead),
                         whole_sequence=(mod.CausalSelfAttention,))
    # The ViT's own forward concatenates the class token and adds the positions by column before its first block
    # (a PatchEmbed made inside forward, so no named module's output is the token sequence a SequenceRegion could
    # enter at): it mixes tokens and is not declared token_local.  Refused, naming it.
    return ModelPlan(token_local=(mod.Block, mod.Mlp), whole_sequence=(mod.Attention,))


def context_plan(name: str):
    """``ModelPlan`` for context parallelism: the files' own modules declared (their attention ``whole_sequence``:
    gathered whole on every context rank).  The GPTs are still refused: their ``forward`` numbers its own
    positions and takes no ``positions=``; the ViT's ``forward`` concatenates the class token (not declared)."""
    from axonmpi.parallel import ModelPlan
    mod = load(name)
    if name == "nanogpt":
        return ModelPlan(token_local=(mod.GPT, mod.Block, mod.MLP, mod.LayerNorm),
                         whole_sequence=(mod.CausalSelfAttention,))
    if name == "mingpt":
        return ModelPlan(token_local=(mod.GPT, mod.Block, mod.NewGELU), whole_sequence=(mod.CausalSelfAttention,))
    return ModelPlan(token_local=(mod.Block, mod.Mlp), whole_sequence=(mod.Attention,))
