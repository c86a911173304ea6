"""Settings shared by every process, and the argparse front end that turns a settings class into a CLI.

Each command has one frozen pydantic-settings class; its fields are the command's flags (and ``SWARMGATE_*`` env
vars). We build argparse from the fields ourselves because pydantic-settings' own CLI cannot take space-separated
lists (``--initial-peers A B``), which the brief's commands promise.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

from hivemind.utils.multiaddr import Multiaddr
from pydantic import BaseModel, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.dht_records import ModelRecord, ServerRecord
from shared.identity import load_identity, new_identity
from shared.membership import load_secret, record_validators

ENV_PREFIX = "SWARMGATE_"
LOOPBACK_MADDRS = ["/ip4/127.0.0.1/tcp/0"]


class ProcessSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", frozen=True)


class P2PSettings(ProcessSettings):
    """How a process joins the swarm's DHT."""

    initial_peers: list[str] = Field(
        default_factory=list, description="multiaddrs of DHT peers to join (as printed by `swarm_node dht`)"
    )
    host_maddrs: list[str] = Field(
        default_factory=lambda: list(LOOPBACK_MADDRS),
        description="multiaddrs to listen on; use /ip4/0.0.0.0/tcp/PORT to accept other machines",
    )
    announce_maddrs: list[str] = Field(default_factory=list, description="public multiaddrs to announce, if any")
    identity_path: str | None = Field(
        None,
        description="file with the peer's RSA private key (stable peer id; created when missing); default: a new key"
        " per start. The key also signs the peer's DHT records, which binds them to its peer id",
    )
    nat_port_map: bool = Field(
        False, description="ask the local router for a port mapping (UPnP/NAT-PMP); off so nothing leaves the host"
    )
    swarm_secret: SecretStr | None = Field(
        None, description="shared secret of a private swarm (>= 16 bytes); peers without it are ignored"
    )
    swarm_secret_file: str | None = Field(None, description="file holding the swarm secret (wins over --swarm-secret)")
    relay_hop: bool = Field(
        False,
        description="relay connections for peers that cannot be dialled (behind NAT), within the --relay-max-* limits",
    )
    relay_max_circuits: int = Field(16, gt=0, description="with --relay-hop: open relayed connections per peer")
    relay_max_reservations: int = Field(128, gt=0, description="with --relay-hop: peers holding a relay slot here")
    relay_data_limit: int = Field(
        1 << 30, gt=0, description="with --relay-hop: bytes relayed per connection and direction before it is reset"
    )
    relay_time_limit: int = Field(
        3600, gt=0, description="with --relay-hop: seconds a relayed connection lasts before it is reset (redialled)"
    )

    @field_validator("initial_peers", "host_maddrs", "announce_maddrs")
    @classmethod
    def _check_maddrs(cls, values: list[str]) -> list[str]:
        for value in values:
            Multiaddr(value)  # a ValueError naming what is wrong: a flag error at start, not a traceback later
        return values

    @model_validator(mode="after")
    def _check_secret(self) -> P2PSettings:
        try:
            self.secret()  # too short, or an unreadable --swarm-secret-file
        except OSError as exc:
            raise ValueError(f"cannot read --swarm-secret-file {self.swarm_secret_file}: {exc.strerror}") from None
        return self

    def secret(self) -> bytes | None:
        value = self.swarm_secret.get_secret_value() if self.swarm_secret else None
        return load_secret(value, self.swarm_secret_file)

    def dht_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "initial_peers": self.initial_peers,
            "host_maddrs": self.host_maddrs,
            "nat_port_map": self.nat_port_map,
            # AutoNAT probes outside peers; a swarm member learns its reachability from its own peers instead.
            "auto_nat": False,
        }
        if self.announce_maddrs:
            kwargs["announce_maddrs"] = self.announce_maddrs
        kwargs["daemon_flags"] = self.relay_service_flags(self.relay_hop)
        # One RSA key is both the libp2p identity and the records' signing key (see shared.identity).
        identity = load_identity(self.identity_path) if self.identity_path else new_identity()
        kwargs["identity"] = identity
        kwargs["record_validators"] = record_validators(self.secret(), (ServerRecord, ModelRecord), identity.key)
        return kwargs

    def relay_service_flags(self, serve: bool) -> dict[str, Any]:
        """p2pd's relay-service flags (it relays for anyone by default, with generous limits: we set ours)."""
        if not serve:
            return {"relayService": False}
        return {
            "relayService": True,
            "relayMaxCircuits": self.relay_max_circuits,
            "relayMaxReservations": self.relay_max_reservations,
            "relayDataLimit": self.relay_data_limit,
            "relayTimeLimit": f"{self.relay_time_limit}s",
        }

    def relay_client_kwargs(self) -> dict[str, Any]:
        """A peer nobody can dial: reserve a slot on the initial peers (our trusted relays) at once."""
        return {"use_auto_relay": True, "force_reachability": "private", "trusted_relays": self.initial_peers}


S = TypeVar("S", bound=BaseModel)


def positional(description: str) -> Any:
    """A required field given as a positional argument on the command line."""
    return Field(..., description=description, json_schema_extra={"positional": True})


def add_settings_arguments(parser: argparse.ArgumentParser, settings_cls: type[BaseModel]) -> None:
    for name, info in settings_cls.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        help_text = _help(name, info)
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "help": help_text}
        annotation = _strip_optional(info.annotation)
        origin = typing.get_origin(annotation)
        if extra.get("positional"):
            parser.add_argument(name, metavar=name.upper(), help=help_text)
            continue
        flag = "--" + name.replace("_", "-")
        if annotation is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        elif origin is list:
            (item,) = typing.get_args(annotation)
            parser.add_argument(flag, nargs="*", type=item, metavar=name.upper(), **kwargs)
        elif origin is Literal:
            parser.add_argument(flag, choices=list(typing.get_args(annotation)), **kwargs)
        else:
            parser.add_argument(flag, type=annotation if annotation in (int, float) else str, **kwargs)


def build_settings(settings_cls: type[S], namespace: argparse.Namespace) -> S:
    """Flags given on the command line win over env vars, which win over defaults."""
    given = {name: value for name, value in vars(namespace).items() if name in settings_cls.model_fields}
    return settings_cls(**given)


def settings_or_exit(parser: argparse.ArgumentParser, settings_cls: type[S], args: argparse.Namespace) -> S:
    """The command's settings, or argparse's usage + "error: ..." (exit 2) for a bad value: never a traceback."""
    try:
        return build_settings(settings_cls, args)
    except ValidationError as exc:
        parser.error(validation_message(settings_cls, exc))


def validation_message(settings_cls: type[BaseModel], exc: ValidationError) -> str:
    """One line naming each bad flag (or positional) and what is wrong with it."""
    parts = []
    for error in exc.errors():
        flag = _flag_name(settings_cls, str(error["loc"][0])) if error["loc"] else ""
        message = error["msg"].removeprefix("Value error, ")
        parts.append(f"{flag}: {message}" if flag and not message.startswith(flag) else message)
    return "; ".join(parts)


def _flag_name(settings_cls: type[BaseModel], name: str) -> str:
    info = settings_cls.model_fields.get(name)
    extra = info.json_schema_extra if info is not None and isinstance(info.json_schema_extra, dict) else {}
    return name.upper() if extra.get("positional") else "--" + name.replace("_", "-")


def parse_settings(settings_cls: type[S], argv: Sequence[str] | None, prog: str) -> S:
    parser = argparse.ArgumentParser(prog=prog, description=settings_cls.__doc__)
    add_settings_arguments(parser, settings_cls)
    return settings_or_exit(parser, settings_cls, parser.parse_args(argv))


def _help(name: str, info: FieldInfo) -> str:
    default = info.get_default(call_default_factory=True)
    shown = "required" if info.is_required() else f"default: {default!r}"
    return f"{info.description or ''} ({shown}; env {ENV_PREFIX}{name.upper()})".replace("%", "%%")


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation
