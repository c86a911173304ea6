"""The gateway's local share of the model: tokenizer, embeddings, final norm and LM head — nothing else."""

from __future__ import annotations

from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from gateway.model.head import ModelHead, build_head
from shared.model_source import ModelSource
from shared.weights import open_weights


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    tokenizer: PreTrainedTokenizerBase = source.load(AutoTokenizer.from_pretrained, "the tokenizer")
    return tokenizer


def load_head(source: ModelSource, config: PretrainedConfig) -> ModelHead:
    return build_head(config, open_weights(source, config))


def stop_token_ids(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """End-of-sequence ids, as transformers' generate would stop on them."""
    ids: set[int] = set()
    for source in (getattr(config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(int(i) for i in source)
    return frozenset(ids)
