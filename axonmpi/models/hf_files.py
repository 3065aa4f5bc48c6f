"""A Hugging Face model directory -- ``config.json`` + ``model.safetensors`` (or its shards) -- as the GPT-2
(:mod:`~axonmpi.models.hf_gpt2`) and Llama (:mod:`~axonmpi.models.hf_llama`) formats both write and read it."""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

__all__ = ["CONFIG_FILE", "torch_dtype_name", "check_target", "write", "read"]

CONFIG_FILE = "config.json"

_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.float64): "float64", np.dtype(np.float16): "float16"}
_CAST_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
               "fp32": "float32", "float32": "float32", "fp64": "float64", "float64": "float64"}


def torch_dtype_name(dtype, who: str, convert: str) -> str:
    """The config's ``dtype`` for parameters of ``dtype``; ``who`` and ``convert`` (the call that converts the
    model to float32) name the caller in the error."""
    name = _DTYPES.get(np.dtype(dtype))
    if name is None:
        raise ValueError(f"{who}: parameter dtype {np.dtype(dtype)} has no torch name here; convert the model "
                         f"to float32 ({convert}) first")
    return name


def check_target(directory: "str | os.PathLike", dtype: Optional[str], who: str) -> str:
    """``directory`` as a string, after refusing a ``.safetensors`` file name and an unknown ``dtype`` cast."""
    directory = os.fspath(directory)
    if directory.endswith(".safetensors"):
        raise ValueError(f"{who}: {directory!r} is a file name; pass a directory (config.json and "
                         "model.safetensors are written into it)")
    if dtype is not None and str(dtype).lower() not in _CAST_NAMES:
        raise ValueError(f"{who}: dtype={dtype!r}; expected one of bf16, fp16, fp32, fp64 (or None to keep the "
                         "model's)")
    return directory


def write(directory: str, sd: Dict[str, Any], cfg: Dict[str, Any], max_shard_size="5GB",
          dtype: Optional[str] = None) -> List[str]:
    """Write ``sd`` (cast to ``dtype`` when given, checked by :func:`check_target`) and ``cfg`` into
    ``directory``; a tied head is left out, as ``save_pretrained`` does. Returns the files written."""
    from ..checkpoint.safetensors_io import save_safetensors
    if dtype is not None:
        cfg["dtype"] = _CAST_NAMES[str(dtype).lower()]
    if cfg["tie_word_embeddings"]:
        sd.pop("lm_head.weight")      # a tied head is the embedding (one tensor in the file)
    os.makedirs(directory, exist_ok=True)
    written = save_safetensors(sd, directory, max_shard_size=max_shard_size, dtype=dtype)
    path = os.path.join(directory, CONFIG_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(path + ".tmp", path)
    return written + [path]


def read(directory: "str | os.PathLike", parse: Callable[[Dict[str, Any], str], Any], who: str,
         how: str) -> Tuple["OrderedDict[str, np.ndarray]", Any]:
    """(state dict, ``parse(config dict, its path)``) of a directory; ``how`` says how to write one."""
    from ..checkpoint.safetensors_io import load_safetensors
    directory = os.fspath(directory)
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{who}: {directory!r} has no {CONFIG_FILE} (write one with {how} or "
                                "transformers' save_pretrained)")
    with open(path) as f:
        parsed = parse(json.load(f), path)
    return load_safetensors(directory), parsed
