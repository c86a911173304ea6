#!/usr/bin/env python3
"""`swarmgate-identity KEY_FILE [--announce MADDR --write-peers FILE]`: a stable identity for the DHT bootstrap.

Creates KEY_FILE (a libp2p private key, written exactly as hivemind's ``--identity-path`` expects it) unless it
already exists, and prints its peer id. With ``--announce /dns4/HOST/tcp/PORT`` it also writes the JSON list
``["/dns4/HOST/tcp/PORT/p2p/PEER_ID"]`` to ``--write-peers``: the file other containers join with (see
``swarmgate-entrypoint``). Operators use it to make a key for a Kubernetes Secret:

    docker run --rm -v "$PWD:/out" swarmgate swarmgate-identity /out/dht-identity.key
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from hivemind.p2p import P2P, PeerID


def ensure_identity(key_file: str) -> str:
    """Returns the base58 peer id of the key in `key_file`, creating the key first if the file is missing."""
    if not os.path.isfile(key_file):
        P2P.generate_identity(key_file)  # writes the file with mode 0400
    with open(key_file, "rb") as file:
        return str(PeerID.from_identity(file.read()).to_base58())


def bootstrap_peers(announce: list[str], peer_id: str) -> list[str]:
    return [f"{maddr.rstrip('/')}/p2p/{peer_id}" for maddr in announce]


def main() -> None:
    parser = argparse.ArgumentParser(prog="swarmgate-identity", description=__doc__.splitlines()[0])
    parser.add_argument("key_file", help="the private key file; created when missing")
    parser.add_argument("--announce", nargs="*", default=[], help="the bootstrap's announced multiaddrs")
    parser.add_argument("--write-peers", help="write the bootstrap's full multiaddrs here, as a JSON list")
    args = parser.parse_args()
    if bool(args.announce) != bool(args.write_peers):
        parser.error("--announce and --write-peers go together")
    peer_id = ensure_identity(args.key_file)
    if args.write_peers:
        partial = args.write_peers + ".tmp"
        with open(partial, "w", encoding="utf-8") as file:
            json.dump(bootstrap_peers(args.announce, peer_id), file)
        os.replace(partial, args.write_peers)  # readers never see half a file
    sys.stdout.write(peer_id + "\n")


if __name__ == "__main__":
    main()
