"""Llama on disk the way Hugging Face transformers reads it: ``config.json`` + ``model.safetensors``.

:meth:`Llama.save_hf <axonmpi.models.Llama.save_hf>` writes such a directory,
``transformers.LlamaForCausalLM.from_pretrained(directory)`` loads it, :meth:`Llama.from_hf
<axonmpi.models.Llama.from_hf>` reads it (or a ``LlamaForCausalLM`` state dict) back, and
:func:`export_checkpoint` does the same from a training checkpoint saved under any layout
(``axonmpi ckpt export CKPT OUT --format hf-llama``).

The module names are transformers' own, so the weights move by name with no transposition; the
rotary embedding uses transformers' half-split layout (``rotate_half``), so no q/k permutation is
needed either (see the note in :mod:`axonmpi.nn.rotary`).
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..backend import to_host

__all__ = ["CONFIG_FILE", "hf_config", "config_from_hf", "from_hf", "save", "read_directory", "export_checkpoint"]

from .hf_files import CONFIG_FILE, check_target, read, torch_dtype_name, write


def hf_config(config, dtype) -> Dict[str, Any]:
    """The ``config.json`` of transformers' ``LlamaConfig`` for a :class:`~axonmpi.models.LlamaConfig`.

    The rotary settings are written both ways transformers has read them: ``rope_parameters``
    (transformers 5) and ``rope_theta`` + ``rope_scaling`` (transformers 4), with equal values.
    """
    name = torch_dtype_name(dtype, "save_hf", "model.to(np.float32)")
    c = config
    scaling = dict(c.rope_scaling) if c.rope_scaling else None
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.n_embd, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head, "num_key_value_heads": c.n_kv_head,
        "head_dim": c.head_dim, "hidden_act": "silu", "max_position_embeddings": c.block_size,
        "initializer_range": c.initializer_range, "rms_norm_eps": c.rms_norm_eps, "use_cache": True,
        "tie_word_embeddings": bool(c.tie_word_embeddings), "attention_bias": bool(c.attention_bias),
        "attention_dropout": c.attention_dropout, "mlp_bias": bool(c.mlp_bias), "pretraining_tp": 1,
        "rope_theta": c.rope_theta, "rope_scaling": scaling,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta, **(scaling or {})},
        "dtype": name,
    }


def config_from_hf(cfg: Dict[str, Any], where: str = "config"):
    """A :class:`~axonmpi.models.LlamaConfig` from a transformers Llama ``config.json`` dict (transformers 4's
    ``rope_theta`` / ``rope_scaling`` or 5's ``rope_parameters``); a field our Llama cannot compute raises."""
    from .llama import LlamaConfig
    if cfg.get("model_type", "llama") != "llama":
        raise ValueError(f"from_hf: {where} has model_type={cfg.get('model_type')!r}, not 'llama'")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"from_hf: {where} has hidden_act={act!r}; axonmpi's Llama computes SwiGLU with 'silu'")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") if k not in cfg]
    if missing:
        raise ValueError(f"from_hf: {where} has no {missing}")
    theta = cfg.get("rope_theta")
    scaling = cfg.get("rope_scaling")
    params = cfg.get("rope_parameters")
    if params:
        p_theta = params.get("rope_theta", theta if theta is not None else 10000.0)
        if theta is not None and float(theta) != float(p_theta):
            raise ValueError(f"from_hf: {where} has rope_theta={theta} and rope_parameters.rope_theta={p_theta}; "
                             "transformers 4 and 5 would compute different models")
        theta, scaling = p_theta, params
    heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // heads
    try:
        return LlamaConfig(
            vocab_size=int(cfg["vocab_size"]), n_embd=int(cfg["hidden_size"]), n_layer=int(cfg["num_hidden_layers"]),
            n_head=heads, n_kv_head=int(cfg.get("num_key_value_heads") or heads),
            intermediate_size=int(cfg.get("intermediate_size", 11008)), head_dim=int(head_dim),
            block_size=int(cfg.get("max_position_embeddings", 2048)),
            rope_theta=float(theta if theta is not None else 10000.0), rope_scaling=scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
            attention_dropout=float(cfg.get("attention_dropout") or 0.0),
            initializer_range=float(cfg.get("initializer_range", 0.02)))
    except (ValueError, NotImplementedError) as e:
        raise type(e)(f"from_hf: {where}: {e}") from None


def _arrays(state_dict) -> "OrderedDict[str, np.ndarray]":
    """``LlamaForCausalLM`` names -> host NumPy arrays (torch tensors through ``.numpy()``); a ``LlamaModel``'s
    names get ``model.``; rotary ``inv_freq`` buffers (saved by old transformers versions) are dropped."""
    out = OrderedDict()
    bare = "embed_tokens.weight" in state_dict and "model.embed_tokens.weight" not in state_dict
    for k, v in state_dict.items():
        if k.endswith("rotary_emb.inv_freq"):
            continue
        if hasattr(v, "detach"):
            v = v.detach().cpu()
            v = v.float() if str(v.dtype) == "torch.bfloat16" else v
            v = v.numpy()
        out[("model." + k) if bare and k != "lm_head.weight" else k] = np.asarray(to_host(v))
    return out


def _as_config(config, where: str):
    from .llama import LlamaConfig
    if isinstance(config, LlamaConfig):
        return config
    if isinstance(config, dict):       # LlamaConfig.to_dict() or a transformers config.json
        return LlamaConfig.from_dict(config) if "n_embd" in config else config_from_hf(config, where)
    if hasattr(config, "to_dict"):             # a transformers LlamaConfig
        return config_from_hf(config.to_dict(), where)
    raise TypeError(f"from_hf: config must be a LlamaConfig, a config.json dict or a transformers LlamaConfig, "
                    f"got {type(config).__name__}")


def from_hf(cls, source, config=None, *, dtype=None, device=None):
    """:meth:`Llama.from_hf <axonmpi.models.Llama.from_hf>`."""
    if isinstance(source, (str, os.PathLike)):
        if config is not None:
            raise ValueError("from_hf: a directory brings its own config.json; pass config= only with a state dict")
        sd, config = read_directory(source)
        sd = _arrays(sd)
    else:
        if config is None:
            raise ValueError("from_hf: a state dict needs config= (a LlamaConfig, a config.json dict or the "
                             "transformers model's .config): the head counts and rotary settings are in no shape")
        sd, config = _arrays(source), _as_config(config, "config")
    if "model.embed_tokens.weight" not in sd:
        raise ValueError(f"from_hf: no model.embed_tokens.weight among the keys {list(sd)[:6]}...; pass a "
                         "LlamaForCausalLM or LlamaModel state dict")
    head, emb = sd.get("lm_head.weight"), sd["model.embed_tokens.weight"]
    if head is None:
        if not config.tie_word_embeddings:
            raise ValueError("from_hf: the config says tie_word_embeddings=false but the weights have no "
                             "lm_head.weight (transformers would initialise it at random)")
        sd["lm_head.weight"] = emb
    elif config.tie_word_embeddings and not (head.shape == emb.shape and np.array_equal(head, emb)):
        raise ValueError("from_hf: the config says tie_word_embeddings=true but lm_head.weight differs from "
                         "model.embed_tokens.weight (transformers would use the embedding as the head); set "
                         "tie_word_embeddings=false to keep the head")
    model = cls(config, dtype=dtype if dtype is not None else emb.dtype)
    model.load_state_dict(sd)
    if device is not None:
        model.to(device)
    return model


def read_directory(directory: "str | os.PathLike") -> Tuple["OrderedDict[str, np.ndarray]", Any]:
    """(state dict, :class:`~axonmpi.models.LlamaConfig`) of a directory written by ``save_pretrained`` or
    :func:`save`: ``config.json`` and ``model.safetensors`` (or its HF shards)."""
    return read(directory, config_from_hf, "from_hf", "model.save_hf(directory)")


def save(model, directory: "str | os.PathLike", max_shard_size="5GB", dtype: Optional[str] = None) -> List[str]:
    """Write ``config.json`` and ``model.safetensors`` (HF shards above ``max_shard_size``) for ``model``;
    ``dtype`` (``"bf16"``, ``"fp16"``, ``"fp32"``, ``"fp64"``) casts the stored weights and the config's dtype."""
    directory = check_target(directory, dtype, "save_hf")
    sd = model.to_hf()
    return write(directory, sd, hf_config(model.config, sd["model.embed_tokens.weight"].dtype), max_shard_size, dtype)


def _recorded_config(extra: Dict[str, Any]):
    """The LlamaConfig fields a checkpoint records under ``extra/config`` (or ``extra/config/llama``)."""
    from dataclasses import fields
    from .llama import LlamaConfig
    names = {f.name for f in fields(LlamaConfig)}
    src = extra.get("llama") if isinstance(extra.get("llama"), dict) else extra
    found = {k: v for k, v in src.items() if k in names}
    return found if "n_head" in found else None


def export_checkpoint(path: str, out: str, *, prefix: Optional[str] = None, dtype: Optional[str] = None,
                      max_shard_size="5GB", config: Optional[str] = None) -> List[str]:
    """A training checkpoint's Llama, saved under any layout, as a transformers Llama directory.

    The checkpoint keeps full shapes under the serial ``state_dict`` names whatever the layout (DDP,
    FSDP's flattened blocks, tensor-parallel shards are read back whole), so this reads the full model
    state, builds the serial :class:`~axonmpi.models.Llama` and calls :meth:`~axonmpi.models.Llama.save_hf`.
    The head counts, rotary settings and norm epsilon are in no shape: they come from the checkpoint's
    ``extra/config`` (save ``extra={"config": model.config.to_dict()}``; or the fields under
    ``extra/config/llama``), else from ``config``: a JSON file holding ``LlamaConfig.to_dict()`` or a
    transformers Llama ``config.json``.

    Returns:
        The paths written (safetensors files, then ``config.json``).
    """
    from ..checkpoint.safetensors_io import read_model_state
    from .llama import Llama, LlamaConfig
    sd, extra = read_model_state(path, prefix)
    if "model.embed_tokens.weight" not in sd:
        raise ValueError(f"--format hf-llama: the checkpoint {path!r} has no model.embed_tokens.weight among its "
                         f"model arrays {list(sd)[:6]}...; it does not hold an axonmpi Llama (pass --prefix if the "
                         "model is under another key)")
    if config is not None:
        with open(config) as f:
            d = json.load(f)
        cfg = config_from_hf(d, config) if "hidden_size" in d or d.get("model_type") == "llama" \
            else LlamaConfig.from_dict(d)
    else:
        recorded = _recorded_config(extra)
        if recorded is None:
            raise ValueError(f"--format hf-llama: the checkpoint {path!r} does not record the Llama's config (head "
                             "counts, rotary base, norm epsilon are in no shape): save it with "
                             "extra={'config': model.config.to_dict()}, or pass --config FILE (LlamaConfig.to_dict() "
                             "or a transformers config.json as JSON)")
        cfg = LlamaConfig.from_dict(recorded)
    head, emb = sd.get("lm_head.weight"), sd["model.embed_tokens.weight"]
    if cfg.tie_word_embeddings:       # a tied model saves both names holding one array
        if head is not None and not np.array_equal(head, emb):
            raise ValueError(f"--format hf-llama: the config of {path!r} ties the head but lm_head.weight differs "
                             "from model.embed_tokens.weight")
        sd["lm_head.weight"] = emb
    elif head is None:
        raise ValueError(f"--format hf-llama: the checkpoint {path!r} has no lm_head.weight but its config is untied")
    model = Llama(cfg, dtype=sd["model.embed_tokens.weight"].dtype)
    model.load_state_dict(sd)
    return model.save_hf(out, max_shard_size=max_shard_size, dtype=dtype)
