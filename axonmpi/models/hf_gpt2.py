"""GPT-2 on disk the way Hugging Face transformers reads it: ``config.json`` + ``model.safetensors``.

:meth:`GPT.save_hf_gpt2 <axonmpi.models.GPT.save_hf_gpt2>` writes such a directory,
``transformers.GPT2LMHeadModel.from_pretrained(directory)`` loads it (the config says whether
``lm_head`` is tied to ``wte``: ``tie_word_embeddings``, so an untied GPT is not silently tied
by transformers' default config), :meth:`GPT.from_hf_gpt2 <axonmpi.models.GPT.from_hf_gpt2>`
reads it back, and :func:`export_checkpoint` does the same from a training checkpoint saved
under any layout (``axonmpi ckpt export CKPT OUT --format hf-gpt2``).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

__all__ = ["CONFIG_FILE", "hf_config", "save", "read_directory", "config_from_hf", "export_checkpoint"]

from .hf_files import CONFIG_FILE, check_target, read, torch_dtype_name, write

# transformers' GPT2Config fields that change the math; ours is fixed to these values
_FIXED = {"activation_function": ("gelu_new", "gelu_pytorch_tanh"), "layer_norm_epsilon": (1e-5,),
          "scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,),
          "reorder_and_upcast_attn": (False,), "add_cross_attention": (False,)}


def hf_config(config, dtype) -> Dict[str, Any]:
    """The ``config.json`` of transformers' ``GPT2Config`` for a :class:`~axonmpi.models.GPTConfig`."""
    name = torch_dtype_name(dtype, "save_hf_gpt2", "gpt.to(np.float32)")
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.block_size, "n_ctx": config.block_size,
        "n_embd": config.n_embd, "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
        "initializer_range": 0.02, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "use_cache": True,
        "bos_token_id": config.vocab_size - 1, "eos_token_id": config.vocab_size - 1,
        "tie_word_embeddings": bool(config.tie_word_embeddings),
        "dtype": name,
    }


def save(gpt, directory: "str | os.PathLike", max_shard_size="5GB", dtype: Optional[str] = None) -> List[str]:
    """Write ``config.json`` and ``model.safetensors`` (HF shards above ``max_shard_size``) for ``gpt``;
    ``dtype`` (``"bf16"``, ``"fp16"``, ``"fp32"``, ``"fp64"``) casts the stored weights and the config's dtype."""
    directory = check_target(directory, dtype, "save_hf_gpt2")
    sd = gpt.to_hf_gpt2()
    return write(directory, sd, hf_config(gpt.config, sd["transformer.wte.weight"].dtype), max_shard_size, dtype)


def config_from_hf(cfg: Dict[str, Any], where: str) -> Dict[str, Any]:
    """GPTConfig keyword arguments from a GPT-2 ``config.json``; a field our GPT cannot express raises."""
    if cfg.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"from_hf_gpt2: {where} has model_type={cfg.get('model_type')!r}, not 'gpt2'")
    for k, allowed in _FIXED.items():
        if k in cfg and cfg[k] not in allowed:
            raise ValueError(f"from_hf_gpt2: {where} has {k}={cfg[k]!r}; axonmpi's GPT computes "
                             f"{k}={allowed[0]!r} (GPT-2's), so this model would give other logits")
    c = int(cfg["n_embd"])
    if cfg.get("n_inner") not in (None, 4 * c):
        raise ValueError(f"from_hf_gpt2: {where} has n_inner={cfg['n_inner']}; axonmpi's GPT has an MLP of "
                         f"4 * n_embd = {4 * c}")
    return {"n_head": int(cfg["n_head"]), "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
            "n_layer": int(cfg["n_layer"]), "n_embd": c, "vocab_size": int(cfg["vocab_size"]),
            "block_size": int(cfg["n_positions"])}


def read_directory(directory: "str | os.PathLike") -> Tuple["OrderedDict[str, np.ndarray]", Dict[str, Any]]:
    """(state dict, GPTConfig keyword arguments) of a directory written by ``save_pretrained`` or
    :func:`save`: ``config.json`` and ``model.safetensors`` (or its HF shards)."""
    return read(directory, config_from_hf, "from_hf_gpt2", "gpt.save_hf_gpt2(directory)")


def export_checkpoint(path: str, out: str, *, n_head: Optional[int] = None, prefix: Optional[str] = None,
                      dtype: Optional[str] = None, max_shard_size="5GB") -> List[str]:
    """A training checkpoint's GPT, saved under any layout, as a transformers GPT-2 directory.

    The checkpoint keeps full shapes under the serial ``state_dict`` names whatever the layout
    (FSDP's flattened blocks, tensor-parallel and pipeline shards are read back whole), so this
    reads the full model state, builds the serial :class:`~axonmpi.models.GPT` from it and calls
    :meth:`~axonmpi.models.GPT.save_hf_gpt2`.  The number of heads is in no shape: ``n_head``,
    else the ``extra/config/n_head`` that ``examples/train_gpt.py`` saves, else ``n_embd // 64``
    (GPT-2's head width).  ``dtype`` (``"bf16"``, ``"fp16"``, ``"fp32"``, ``"fp64"``) casts the
    stored weights (the config's ``dtype`` says which).  The head is tied when ``lm_head.weight`` is absent or equal to
    ``wte.weight`` (a tied model saves both names holding one array).

    Returns:
        The paths written (safetensors files, then ``config.json``).
    """
    from ..checkpoint.safetensors_io import read_model_state
    from .gpt import GPT, GPTConfig
    sd, extra = read_model_state(path, prefix)
    missing = [k for k in ("wte.weight", "wpe.weight", "ln_f.weight") if k not in sd]
    if missing:
        raise ValueError(f"--format hf-gpt2: the checkpoint {path!r} has no {missing} among its model arrays "
                         f"{list(sd)[:6]}...; it does not hold an axonmpi GPT (pass --prefix if the model is "
                         "under another key)")
    if any(".mlp.router." in k or ".mlp.experts." in k for k in sd):
        raise ValueError(f"--format hf-gpt2: the checkpoint {path!r} holds a mixture-of-experts GPT; GPT-2 has "
                         "dense MLPs only (export --format safetensors instead)")
    real = extra.get("vocab_size")             # a padded vocabulary (--make-vocab-size-divisible-by): its tokens only
    if real is not None and int(real) < sd["wte.weight"].shape[0]:
        for k in ("wte.weight", "lm_head.weight"):
            if k in sd:
                sd[k] = sd[k][:int(real)]
    vocab, c = sd["wte.weight"].shape
    layers = sorted({int(k.split(".")[1]) for k in sd if k.startswith("blocks.")})
    if n_head is None:
        n_head = extra.get("n_head")
    if n_head is None:
        if c % 64:
            raise ValueError(f"--format hf-gpt2: the checkpoint {path!r} does not record n_head and n_embd={c} "
                             "is not a multiple of 64 (GPT-2's head width); pass --n-head")
        n_head = c // 64
    head = sd.get("lm_head.weight")
    tied = head is None or np.array_equal(head, sd["wte.weight"])
    bias = "ln_f.bias" in sd
    cfg = GPTConfig(vocab_size=int(vocab), block_size=int(sd["wpe.weight"].shape[0]), n_layer=len(layers),
                    n_head=int(n_head), n_embd=int(c), bias=bias, tie_word_embeddings=bool(tied))
    gpt = GPT(cfg, dtype=sd["wte.weight"].dtype)
    if tied:
        sd["lm_head.weight"] = sd["wte.weight"]
    gpt.load_state_dict(sd)
    return gpt.save_hf_gpt2(out, max_shard_size=max_shard_size, dtype=dtype)
