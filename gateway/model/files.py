"""The gateway's local share of the model: tokenizer, embeddings, final norm and LM head — nothing else."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from gateway.model.head import ModelHead, build_head
from shared.config_cache import cached_tokenizer
from shared.errors import ModelLoadError
from shared.families import context_length
from shared.model_source import ModelSource
from shared.weights import open_weights

# generation_config.json fields that are sampling defaults, as the request parameter each one stands for.
_SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "repetition_penalty")


def load_tokenizer(
    source: ModelSource, chat_template: Path | None = None, cache_dir: Path | None = None
) -> PreTrainedTokenizerBase:
    """The model's tokenizer; ``chat_template``: a Jinja file that replaces the template it ships with.

    With ``cache_dir``, a GGUF file's tokenizer comes from there once transformers has converted it
    (``shared.config_cache``)."""

    def convert() -> PreTrainedTokenizerBase:
        converted: PreTrainedTokenizerBase = source.load(AutoTokenizer.from_pretrained, "the tokenizer")
        return converted

    if source.kind == "gguf" and cache_dir is not None:
        tokenizer = cached_tokenizer(Path(source.location), cache_dir, convert)
    else:
        tokenizer = convert()
    if chat_template is not None:
        try:
            tokenizer.chat_template = chat_template.read_text(encoding="utf-8")
        except OSError as exc:
            raise ModelLoadError(f"cannot read the chat template {chat_template}: {exc}") from exc
    return tokenizer


def sampling_defaults(source: ModelSource) -> dict[str, float]:
    """The sampling parameters the model's generation_config.json sets (as vLLM's ``--generation-config auto``),
    for requests that leave them out; {} when it has none."""
    try:
        if source.kind == "gguf":  # a GGUF has none inside; one may lie beside it
            folder = Path(source.location).parent
            if not (folder / "generation_config.json").is_file():
                return {}
            config = GenerationConfig.from_pretrained(str(folder))
        else:
            config = GenerationConfig.from_pretrained(source.location, revision=source.revision or "main")
    except (OSError, ValueError):
        return {}  # no generation_config.json: OpenAI's defaults
    # Only what the file sets: transformers' class defaults (top_k 50, ...) are not the model's advice.
    found = config.to_diff_dict()
    return {
        name: float(found[name])
        for name in _SAMPLING_DEFAULTS
        if isinstance(found.get(name), int | float) and not isinstance(found.get(name), bool)
    }


def model_len(config: PretrainedConfig, max_model_len: int | None) -> int:
    """Prompt + completion tokens a request may use: the model's window, or ``max_model_len`` within it."""
    window = context_length(config)
    if max_model_len is None:
        return window
    if max_model_len > window:
        raise ModelLoadError(f"--max-model-len {max_model_len} is over the model's context window of {window} tokens")
    return max_model_len


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
