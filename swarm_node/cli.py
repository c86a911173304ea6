"""`swarm_node dht` and `swarm_node serve`.

A bad flag value, a model that cannot be found or read, or a span that does not fit ends the command the argparse
way (usage, then ``error: ...``, exit 2), never with a traceback.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from shared.errors import DhtLost, ModelLoadError
from shared.exit import skip_final_collection
from shared.logging_setup import configure_logging
from shared.settings import add_settings_arguments, settings_or_exit
from swarm_node.settings import DhtSettings, NodeSettings


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="swarm_node", description="A node of a swarmgate swarm.")
    commands = parser.add_subparsers(dest="command", required=True)
    dht_parser = commands.add_parser("dht", help=DhtSettings.__doc__, description=DhtSettings.__doc__)
    add_settings_arguments(dht_parser, DhtSettings)
    serve_parser = commands.add_parser("serve", help=NodeSettings.__doc__, description=NodeSettings.__doc__)
    add_settings_arguments(serve_parser, NodeSettings)
    args = parser.parse_args(argv)
    if args.command == "dht":
        dht_settings = settings_or_exit(dht_parser, DhtSettings, args)
        configure_logging()
        from swarm_node.dht_bootstrap import run_bootstrap

        try:
            run_bootstrap(dht_settings)
        except DhtLost:
            raise SystemExit(1) from None  # logged where it was found
        skip_final_collection()
        return
    settings = settings_or_exit(serve_parser, NodeSettings, args)
    configure_logging()
    from swarm_node.self_test import SelfTestFailed
    from swarm_node.server import SpanServer, serve

    try:
        server = SpanServer(settings)  # resolves the model and the span before anything starts
    except (ModelLoadError, ValueError) as exc:
        serve_parser.error(str(exc))
    try:
        serve(server)
    except SelfTestFailed as exc:
        logging.getLogger("swarm_node").error("self-test failed, not announcing this node: %s", exc)
        raise SystemExit(1) from None
    except DhtLost:
        raise SystemExit(1) from None  # logged where it was found
    skip_final_collection()


if __name__ == "__main__":
    main()
