"""`gateway serve` (the OpenAI-compatible HTTP API), `gateway generate` (one completion from the command line) and
`gateway keys create|list|revoke` (API keys)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from gateway.settings import (
    GatewaySettings,
    GenerateSettings,
    KeyCreateSettings,
    KeyListSettings,
    KeyRevokeSettings,
    RedisSettings,
)
from shared.errors import DhtLost
from shared.exit import skip_final_collection
from shared.logging_setup import configure_logging
from shared.settings import add_settings_arguments, settings_or_exit


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gateway", description="The swarmgate gateway.")
    commands = parser.add_subparsers(dest="command", required=True)
    parsers: dict[str, argparse.ArgumentParser] = {}
    for name, settings_cls in (("serve", GatewaySettings), ("generate", GenerateSettings)):
        parsers[name] = commands.add_parser(name, help=settings_cls.__doc__, description=settings_cls.__doc__)
        add_settings_arguments(parsers[name], settings_cls)
    keys = commands.add_parser("keys", help="manage API keys", description="Manage the gateways' API keys.")
    key_commands = keys.add_subparsers(dest="keys_command", required=True)
    key_settings: dict[str, type[RedisSettings]] = {
        "create": KeyCreateSettings,
        "list": KeyListSettings,
        "revoke": KeyRevokeSettings,
    }
    for name, key_cls in key_settings.items():
        parsers[f"keys {name}"] = key_commands.add_parser(name, help=key_cls.__doc__, description=key_cls.__doc__)
        add_settings_arguments(parsers[f"keys {name}"], key_cls)
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve_settings = settings_or_exit(parsers["serve"], GatewaySettings, args)
        configure_logging()
        from gateway.app import serve

        try:
            asyncio.run(serve(serve_settings))
        except DhtLost:
            raise SystemExit(1) from None  # logged where it was found
        skip_final_collection()
    elif args.command == "keys":
        keys_settings = settings_or_exit(parsers[f"keys {args.keys_command}"], key_settings[args.keys_command], args)
        configure_logging()
        from gateway.keys_cli import KeysCommandError, run

        try:
            asyncio.run(run(keys_settings))
        except KeysCommandError as exc:
            parser.exit(1, f"gateway keys: {exc}\n")
    else:
        generate_settings = settings_or_exit(parsers["generate"], GenerateSettings, args)
        configure_logging()
        asyncio.run(_generate(generate_settings))


async def _generate(settings: GenerateSettings) -> None:
    from gateway.model.engine import GenerationEngine, GenerationRequest
    from gateway.model.sampling import SamplingParams

    engine = await GenerationEngine.create(settings)
    try:
        prompt_ids = engine.tokenizer.encode(settings.prompt)
        sampling = SamplingParams(temperature=settings.temperature, top_p=settings.top_p, seed=settings.seed)
        request = GenerationRequest(prompt_ids, settings.max_new_tokens, sampling)
        tokens = [token async for token in engine.generate(request)]
        text = str(engine.tokenizer.decode(tokens, skip_special_tokens=True))
        sys.stdout.write(text + "\n")
    finally:
        await engine.close()


if __name__ == "__main__":
    main()
