"""Model formats of other frameworks for ``axonmpi ckpt export --format``: the layer above both
:mod:`axonmpi.checkpoint` (which knows no model) and :mod:`axonmpi.models`.

``EXPORT_FORMATS`` maps each ``--format`` name to its exporter, ``fn(path, out, *, prefix, dtype,
max_shard_size, **options)`` returning the paths written; the ``axonmpi`` command and ``python -m
axonmpi.checkpoint`` hand it to :func:`axonmpi.checkpoint.cli.export`.

Example:
    >>> from axonmpi.interop import EXPORT_FORMATS
    >>> EXPORT_FORMATS["hf-llama"]("runs/llama/step-00001000", "llama-hf")     # config.json + model.safetensors
"""
from __future__ import annotations

from types import MappingProxyType
from typing import List, Optional

__all__ = ["EXPORT_FORMATS", "export_hf_gpt2", "export_hf_llama"]


def export_hf_gpt2(path: str, out: str, *, prefix: Optional[str] = None, dtype: Optional[str] = None,
                   max_shard_size="5GB", n_head: Optional[int] = None, config: Optional[str] = None) -> List[str]:
    """an axonmpi GPT as a directory transformers.GPT2LMHeadModel.from_pretrained loads (config.json + model.safetensors).

    See :func:`axonmpi.models.hf_gpt2.export_checkpoint`; ``n_head`` when the checkpoint does not record it.
    """
    if config is not None:
        raise ValueError("--config is read by --format hf-llama; hf-gpt2 takes the sizes from the shapes and "
                         "--n-head (or the checkpoint's extra/config/n_head)")
    from .models.hf_gpt2 import export_checkpoint
    return export_checkpoint(path, out, n_head=n_head, prefix=prefix, dtype=dtype, max_shard_size=max_shard_size)


def export_hf_llama(path: str, out: str, *, prefix: Optional[str] = None, dtype: Optional[str] = None,
                    max_shard_size="5GB", n_head: Optional[int] = None, config: Optional[str] = None) -> List[str]:
    """an axonmpi Llama as a directory transformers.LlamaForCausalLM.from_pretrained loads (config.json + model.safetensors).

    See :func:`axonmpi.models.hf_llama.export_checkpoint`: the config comes from the checkpoint's
    ``extra/config``, else ``config`` (a JSON file).
    """
    if n_head is not None:
        raise ValueError("--n-head is read by --format hf-gpt2; hf-llama reads the whole config from the checkpoint's "
                         "extra/config or --config FILE (the head counts and the rotary settings together)")
    from .models.hf_llama import export_checkpoint
    return export_checkpoint(path, out, prefix=prefix, dtype=dtype, max_shard_size=max_shard_size, config=config)


EXPORT_FORMATS = MappingProxyType({"hf-gpt2": export_hf_gpt2, "hf-llama": export_hf_llama})
