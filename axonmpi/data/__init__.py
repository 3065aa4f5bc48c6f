"""Datasets, the deterministic DataLoader, distributed sampling and a download-free text corpus."""
from .corpus import CharDataset, CharTokenizer, load_stdlib_corpus, unigram_entropy
from .dataloader import DataLoader, default_collate
from .dataset import Dataset, Subset, TensorDataset
from .distributed import DistributedSampler, create_dataloader

__all__ = [
    "CharDataset",
    "CharTokenizer",
    "DataLoader",
    "Dataset",
    "DistributedSampler",
    "Subset",
    "TensorDataset",
    "create_dataloader",
    "default_collate",
    "load_stdlib_corpus",
    "unigram_entropy",
]
