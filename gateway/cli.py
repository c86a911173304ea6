"""`gateway serve` (the OpenAI-compatible HTTP API) and `gateway generate` (one completion from the command line)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from gateway.settings import GenerateSettings, ServeSettings
from shared.logging_setup import configure_logging
from shared.settings import add_settings_arguments, build_settings


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gateway", description="The swarmgate gateway.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, settings_cls in (("serve", ServeSettings), ("generate", GenerateSettings)):
        add_settings_arguments(
            commands.add_parser(name, help=settings_cls.__doc__, description=settings_cls.__doc__), settings_cls
        )
    args = parser.parse_args(argv)
    configure_logging()
    if args.command == "serve":
        from gateway.app import serve

        asyncio.run(serve(build_settings(ServeSettings, args)))
    else:
        asyncio.run(_generate(build_settings(GenerateSettings, args)))


async def _generate(settings: GenerateSettings) -> None:
    from gateway.engine import GenerationEngine, GenerationRequest
    from gateway.sampling import SamplingParams

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
