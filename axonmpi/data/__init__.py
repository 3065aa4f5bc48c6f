"""Datasets, the deterministic DataLoader and a download-free text corpus."""
from .corpus import CharDataset, CharTokenizer, load_stdlib_corpus, unigram_entropy
from .dataloader import DataLoader, default_collate
from .dataset import Dataset, Subset, TensorDataset

__all__ = [
    "CharDataset",
    "CharTokenizer",
    "DataLoader",
    "Dataset",
    "Subset",
    "TensorDataset",
    "default_collate",
    "load_stdlib_corpus",
    "unigram_entropy",
]
