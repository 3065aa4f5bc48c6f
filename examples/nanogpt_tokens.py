"""Write nanoGPT's token files (``train.bin`` / ``val.bin``, uint16, as its ``data/*/prepare.py`` writes them, and
``meta.pkl`` with the vocabulary size) from the download-free corpus: the Python standard library's sources,
character-level (``axonmpi.data.CharTokenizer``), 90% train and 10% validation.

    python examples/nanogpt_tokens.py --out data/stdlib_char
    mpiexec -n 2 python tests/ported/nanogpt/train.py --dataset=stdlib_char --compile=False --device=cpu ...

``--tokens N`` keeps the first N tokens of each split (a small file for tests: with N = block_size + 1 every
window nanoGPT's ``get_batch`` draws is the same one, so two frameworks' random streams cannot differ in it).
"""
from __future__ import annotations

import argparse
import os
import pickle

import numpy as np

from axonmpi.data import CharTokenizer, load_stdlib_corpus


def write_tokens(out: str, max_bytes: int = 1 << 20, tokens: int = 0) -> dict:
    """Write ``train.bin``, ``val.bin`` and ``meta.pkl`` under ``out``; returns the meta dict."""
    text = load_stdlib_corpus(max_bytes)
    tok = CharTokenizer(text)
    ids = np.asarray(tok.encode(text), dtype=np.int64)
    if tok.vocab_size > np.iinfo(np.uint16).max + 1:
        raise ValueError(f"a vocabulary of {tok.vocab_size} does not fit nanoGPT's uint16 token files")
    n = int(0.9 * len(ids))
    os.makedirs(out, exist_ok=True)
    for name, part in (("train", ids[:n]), ("val", ids[n:])):
        part = part[:tokens] if tokens else part
        part.astype(np.uint16).tofile(os.path.join(out, f"{name}.bin"))
    meta = {"vocab_size": int(tok.vocab_size)}
    with open(os.path.join(out, "meta.pkl"), "wb") as f:
        pickle.dump(meta, f)
    return meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory to write train.bin, val.bin and meta.pkl into")
    ap.add_argument("--max-bytes", type=int, default=1 << 20, help="corpus size in bytes (default 1 MiB)")
    ap.add_argument("--tokens", type=int, default=0, help="keep the first N tokens of each split (0: all)")
    a = ap.parse_args(argv)
    meta = write_tokens(a.out, a.max_bytes, a.tokens)
    print(f"wrote {a.out}/train.bin, val.bin (uint16) and meta.pkl: vocab_size {meta['vocab_size']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
