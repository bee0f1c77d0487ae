"""Data pipeline for pretraining (numpy only).

* ``text_dataset``: a byte tokenizer, an offline text corpus, fixed-length next-token datasets
  and a deterministic, resumable data-parallel sampler (what ``launch/pretrain.py`` uses).
* Megatron-LM's data layer (``launch/pretrain.py --data-path PREFIX ...``): ``indexed_dataset``
  (the mmap ``.bin``/``.idx`` format), ``gpt_dataset`` (``GPTDataset``, ``--split``),
  ``blended_dataset`` (``--data-path`` weights), ``dataset_builder`` (train/valid/test from
  both) and ``tokenizers`` (``--tokenizer-type``); ``tools/preprocess_data.py`` writes datasets.
* ``launch/pretrain.py --sft``: ``chat_template`` (a Hugging Face tokenizer's Jinja2 chat template)
  and ``sft_dataset`` (chat conversations from JSONL, the loss on the assistant's tokens, packed).
"""

from core.data.blended_dataset import BlendedDataset, parse_data_path
from core.data.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from core.data.dataset_builder import build_gpt_datasets
from core.data.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    build_on_rank0_then_share,
    get_segment_ids,
    get_split_document_ids,
)
from core.data.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder, max_token_id
from core.data.sft_dataset import Conversation, SFTDataError, SFTDataset, read_conversations, tokenize_conversation
from core.data.text_dataset import (
    ByteTokenizer,
    DataParallelSampler,
    TextDataset,
    build_train_valid_datasets,
    get_batch,
    load_corpus,
    unigram_entropy,
)
from core.data.tokenizers import MegatronTokenizer, build_tokenizer

__all__ = [
    "BlendedDataset",
    "ByteTokenizer",
    "ChatTemplate",
    "ChatTemplateError",
    "Conversation",
    "DType",
    "DataParallelSampler",
    "GPTDataset",
    "GPTDatasetConfig",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MegatronTokenizer",
    "SFTDataError",
    "SFTDataset",
    "TextDataset",
    "build_gpt_datasets",
    "build_on_rank0_then_share",
    "build_tokenizer",
    "build_train_valid_datasets",
    "get_batch",
    "get_segment_ids",
    "get_split_document_ids",
    "load_chat_template",
    "load_corpus",
    "max_token_id",
    "parse_data_path",
    "read_conversations",
    "tokenize_conversation",
    "unigram_entropy",
]
