"""The serving knobs users know from vLLM: --chat-template FILE, sampling defaults from generation_config.json,
--max-model-len, and the flags and env vars that set them (and --allowed-origins)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import GenerationConfig, LlamaConfig

from gateway.api.serving.common import ServingConfig
from gateway.app import create_app
from gateway.model.files import load_tokenizer, model_len, sampling_defaults
from gateway.model.tokens import HFTokenCodec
from gateway.settings import GatewaySettings
from shared.errors import ModelLoadError
from shared.model_source import ModelSource
from shared.settings import parse_settings
from tests.helpers.processes import save_tiny_tokenizer
from tests.helpers.scripted_engine import CharCodec, ScriptedEngine
from tests.tiny_models import VOCAB


def test_chat_template_file_replaces_the_tokenizers_own(tmp_path: Path) -> None:
    save_tiny_tokenizer(tmp_path, VOCAB)
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}t5 {{ m['content'] }} {% endfor %}t7")
    source = ModelSource("folder", str(tmp_path))
    plain = HFTokenCodec(load_tokenizer(source), VOCAB)
    with pytest.raises(Exception, match="no chat template"):
        plain.render_chat([{"role": "user", "content": "t3"}])
    codec = HFTokenCodec(load_tokenizer(source, template), VOCAB)
    assert codec.render_chat([{"role": "user", "content": "t3"}]) == "t5 t3 t7"
    with pytest.raises(ModelLoadError, match="chat template"):
        load_tokenizer(source, tmp_path / "missing.jinja")


def test_sampling_defaults_are_what_generation_config_sets(tmp_path: Path) -> None:
    assert sampling_defaults(ModelSource("folder", str(tmp_path))) == {}  # no file: OpenAI's defaults
    GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, repetition_penalty=1.05).save_pretrained(tmp_path)
    expected = {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.05}  # top_k not set: not transformers' 50
    assert sampling_defaults(ModelSource("folder", str(tmp_path))) == expected
    # A GGUF has none inside, but one may lie beside it.
    assert sampling_defaults(ModelSource("gguf", str(tmp_path / "model.gguf"))) == expected


def test_max_model_len_caps_the_context_window_and_never_exceeds_the_model() -> None:
    config = LlamaConfig(max_position_embeddings=128)
    assert model_len(config, None) == 128
    assert model_len(config, 64) == 64
    with pytest.raises(ModelLoadError, match="over the model's context window"):
        model_len(config, 256)


class ChatCodec(CharCodec):
    def render_chat(self, messages: list[dict[str, Any]], *args: Any) -> str:
        return "".join(message["content"] for message in messages)


async def test_requests_that_leave_sampling_out_get_the_models_defaults() -> None:
    seen = []

    class Recording(ScriptedEngine):
        async def stream(self, request):  # type: ignore[no-untyped-def]
            seen.append(request.sampling)
            async for event in super().stream(request):
                yield event

    engine = Recording(codec=ChatCodec(), script="ab")
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20.0, "repetition_penalty": 1.1}
    app = create_app(engine, ServingConfig(engine.model_name, sampling_defaults=defaults))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        chat = {"model": "scripted", "messages": [{"role": "user", "content": "ab"}], "max_tokens": 2}
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
        explicit = {**chat, "temperature": 0, "top_p": 1, "top_k": 0, "repetition_penalty": 1}
        assert (await client.post("/v1/chat/completions", json=explicit)).status_code == 200
        assert (await client.post("/v1/responses", json={"model": "scripted", "input": "ab"})).status_code == 200
    first, second, third = seen
    assert (first.temperature, first.top_p, first.top_k, first.repetition_penalty) == (0.6, 0.9, 20, 1.1)
    assert (second.temperature, second.top_p, second.top_k, second.repetition_penalty) == (0, 1, 0, 1)
    assert third == first


def test_flags_and_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    argv = ["m", "--allowed-origins", "http://a", "http://b", "--chat-template", str(template)]
    settings = parse_settings(GatewaySettings, [*argv, "--max-model-len", "512"], "gateway serve")
    assert settings.allowed_origins == ["http://a", "http://b"]
    assert (settings.chat_template, settings.max_model_len) == (template, 512)
    monkeypatch.setenv("SWARMGATE_ALLOWED_ORIGINS", '["*"]')
    assert parse_settings(GatewaySettings, ["m"], "gateway serve").allowed_origins == ["*"]
    defaults = parse_settings(GatewaySettings, ["m"], "x")
    assert (defaults.chat_template, defaults.max_model_len) == (None, None)
