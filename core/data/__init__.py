"""Data pipeline for pretraining: a byte tokenizer, an offline text corpus, fixed-length
next-token datasets and a deterministic, resumable data-parallel sampler (numpy only)."""

from core.data.text_dataset import (
    ByteTokenizer,
    DataParallelSampler,
    TextDataset,
    build_train_valid_datasets,
    get_batch,
    load_corpus,
    unigram_entropy,
)

__all__ = [
    "ByteTokenizer",
    "DataParallelSampler",
    "TextDataset",
    "build_train_valid_datasets",
    "get_batch",
    "load_corpus",
    "unigram_entropy",
]
