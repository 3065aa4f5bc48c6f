"""Tokenize text files into token files for `examples/train_gpt.py --data DIR` (nanoGPT's layout).

    python examples/prepare_data.py input.txt --out data/mytext                      # bytes: vocabulary 256
    python examples/prepare_data.py input.txt --out data/mytext --tokenizer DIR      # a Hugging Face tokenizer
    python examples/prepare_data.py input.txt --out data/mytext --train-bpe 512      # a byte-level BPE built here

Writes DIR/train.bin and DIR/val.bin (the token ids, header-free little-endian uint16, or uint32 when the
vocabulary exceeds 65,536: axonmpi/data/tokens.py's note) and DIR/meta.json (dtype, vocab_size, the tokenizer,
token counts), and with a Hugging Face tokenizer a copy of it in DIR/tokenizer/ so the trainer can print its
sample as text.  Nothing is downloaded: --tokenizer reads a local directory (what `save_pretrained` wrote, e.g.
GPT-2's or a Llama's tokenizer folder next to its weights) or a tokenizer.json file, with the `tokenizers`
package (or `transformers` for folders without a tokenizer.json); --train-bpe builds GPT-2's kind of tokenizer
(byte-level BPE) on the input itself with `tokenizers`.  Without either, each UTF-8 byte is a token.

Several input files are documents: they are joined with the tokenizer's end-of-text token when it has one.  The
last --val-fraction of the tokens (default 0.1) is the held-out split.
"""
import argparse
import json
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from axonmpi.data.tokens import META_FILE, write_token_file  # noqa: E402


def _bytes_tokenizer():
    return {"kind": "bytes", "vocab_size": 256, "eos_id": None,
            "encode": lambda text: np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)}


def _need(module: str, what: str):
    try:
        return __import__(module)
    except ImportError:
        raise SystemExit(f"prepare_data: {what} needs the `{module}` package (pip install {module}); without it "
                         "leave --tokenizer/--train-bpe out to tokenize bytes (vocabulary 256)") from None


def _from_tokenizers(tok, kind: str):
    eos = next((tok.token_to_id(t) for t in ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
                if tok.token_to_id(t) is not None), None)
    return {"kind": kind, "vocab_size": tok.get_vocab_size(), "eos_id": eos, "object": tok,
            "encode": lambda text: np.asarray(tok.encode(text).ids, dtype=np.int64)}


def load_tokenizer(path: str):
    """A local Hugging Face tokenizer: a tokenizer.json file, a folder holding one, or (with transformers) any
    folder AutoTokenizer reads.  Never downloads."""
    js = path if os.path.isfile(path) else os.path.join(path, "tokenizer.json")
    if os.path.isfile(js):
        tokenizers = _need("tokenizers", "--tokenizer")
        return _from_tokenizers(tokenizers.Tokenizer.from_file(js), "tokenizer.json")
    if not os.path.isdir(path):
        raise SystemExit(f"prepare_data: --tokenizer {path!r}: no such file or folder (a local tokenizer folder "
                         "or tokenizer.json; nothing is downloaded)")
    _need("transformers", f"--tokenizer {path} (a folder without tokenizer.json)")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return {"kind": "transformers", "vocab_size": len(tok), "eos_id": tok.eos_token_id, "object": tok,
            "encode": lambda text: np.asarray(tok(text, add_special_tokens=False)["input_ids"], dtype=np.int64)}


def train_bpe(files, vocab_size: int):
    """GPT-2's kind of tokenizer (byte-level BPE with an <|endoftext|> token) trained on ``files`` here."""
    _need("tokenizers", "--train-bpe")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(list(files), trainer)
    return _from_tokenizers(tok, "tokenizer.json")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="UTF-8 text files (each one a document)")
    p.add_argument("--out", required=True, help="the folder to write train.bin, val.bin and meta.json into")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--tokenizer", default=None, metavar="PATH",
                     help="a local Hugging Face tokenizer folder or tokenizer.json (default: UTF-8 bytes)")
    how.add_argument("--train-bpe", type=int, default=None, metavar="N",
                     help="build a byte-level BPE tokenizer of N tokens on the inputs (needs `tokenizers`)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="the held-out share of the tokens (default 0.1)")
    p.add_argument("--dtype", choices=["auto", "uint16", "uint32"], default="auto",
                   help="token width on disk (auto: uint16 when the vocabulary fits, as nanoGPT)")
    args = p.parse_args(argv)
    if not 0 < args.val_fraction < 1:
        p.error(f"--val-fraction must lie in (0, 1), got {args.val_fraction}")
    if args.train_bpe is not None and args.train_bpe < 257:
        p.error(f"--train-bpe must be at least 257 (the 256 bytes and <|endoftext|>), got {args.train_bpe}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    for f in args.inputs:
        if not os.path.isfile(f):
            raise SystemExit(f"prepare_data: {f!r}: no such file")
    if args.tokenizer:
        tok = load_tokenizer(args.tokenizer)
    elif args.train_bpe:
        tok = train_bpe(args.inputs, args.train_bpe)
    else:
        tok = _bytes_tokenizer()
    parts = []
    for i, f in enumerate(args.inputs):
        with open(f, encoding="utf-8") as fh:
            parts.append(tok["encode"](fh.read()))
        if tok["eos_id"] is not None and i < len(args.inputs) - 1:
            parts.append(np.array([tok["eos_id"]], dtype=np.int64))
    ids = np.concatenate(parts)
    dtype = args.dtype if args.dtype != "auto" else ("uint16" if tok["vocab_size"] <= 1 << 16 else "uint32")
    n_val = max(2, int(round(len(ids) * args.val_fraction)))
    if len(ids) - n_val < 2:
        raise SystemExit(f"prepare_data: {len(ids)} tokens are too few to split into train and val")
    os.makedirs(args.out, exist_ok=True)
    n_train = write_token_file(os.path.join(args.out, "train.bin"), ids[:-n_val], dtype)
    write_token_file(os.path.join(args.out, "val.bin"), ids[-n_val:], dtype)
    saved = None
    if tok["kind"] == "tokenizer.json":
        saved = "tokenizer/tokenizer.json"
        os.makedirs(os.path.join(args.out, "tokenizer"), exist_ok=True)
        tok["object"].save(os.path.join(args.out, saved))
    elif tok["kind"] == "transformers":
        saved = "tokenizer"
        dest = os.path.join(args.out, saved)
        shutil.rmtree(dest, ignore_errors=True)
        tok["object"].save_pretrained(dest)
    meta = {"dtype": dtype, "vocab_size": int(tok["vocab_size"]), "tokenizer": tok["kind"], "tokenizer_path": saved,
            "eos_id": tok["eos_id"], "train_tokens": n_train, "val_tokens": int(n_val),
            "sources": [os.path.abspath(f) for f in args.inputs]}
    with open(os.path.join(args.out, META_FILE), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(f"{args.out}: {n_train:,} train + {n_val:,} val tokens ({dtype}), vocabulary {tok['vocab_size']:,} "
          f"({tok['kind']})")
    return meta


if __name__ == "__main__":
    main()
