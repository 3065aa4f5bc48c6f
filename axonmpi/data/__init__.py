"""Datasets, the deterministic DataLoader, distributed sampling, token files and a download-free text corpus."""
from .corpus import CharDataset, CharTokenizer, load_stdlib_corpus, unigram_entropy
from .dataloader import DataLoader, default_collate
from .dataset import Dataset, Subset, TensorDataset
from .distributed import DistributedSampler, create_dataloader
from .tokens import TokenFileDataset, read_token_meta, token_files, write_token_file

__all__ = [
    "CharDataset",
    "CharTokenizer",
    "DataLoader",
    "Dataset",
    "DistributedSampler",
    "Subset",
    "TensorDataset",
    "TokenFileDataset",
    "create_dataloader",
    "default_collate",
    "load_stdlib_corpus",
    "read_token_meta",
    "token_files",
    "unigram_entropy",
    "write_token_file",
]
