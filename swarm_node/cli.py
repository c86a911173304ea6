"""`swarm_node dht` and `swarm_node serve`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from shared.logging_setup import configure_logging
from shared.settings import add_settings_arguments, build_settings
from swarm_node.settings import DhtSettings, ServeSettings


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="swarm_node", description="A node of a swarmgate swarm.")
    commands = parser.add_subparsers(dest="command", required=True)
    add_settings_arguments(
        commands.add_parser("dht", help=DhtSettings.__doc__, description=DhtSettings.__doc__), DhtSettings
    )
    add_settings_arguments(
        commands.add_parser("serve", help=ServeSettings.__doc__, description=ServeSettings.__doc__), ServeSettings
    )
    args = parser.parse_args(argv)
    configure_logging()
    if args.command == "dht":
        from swarm_node.dht_bootstrap import run_bootstrap

        run_bootstrap(build_settings(DhtSettings, args))
    else:
        from swarm_node.server import serve

        serve(build_settings(ServeSettings, args))


if __name__ == "__main__":
    main()
