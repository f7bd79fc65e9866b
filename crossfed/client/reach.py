"""How an admin or a site reaches a run's coordinator: its URL (the config's, or an embedded
coordinator's endpoint file), the caller's token, and a client that moves weights over the
configured number of streams."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:  # the client imports torch (weights on the wire): only clients need it
    from crossfed.client.http import CoordinatorClient
    from crossfed.config import RunConfig

#: the file in an embedded coordinator's state directory that names its URL and process
ENDPOINT = "endpoint.json"


class EndpointError(RuntimeError):
    """The coordinator cannot be located, started or reached."""


def token_for(config: RunConfig, who: str) -> str:
    """``CROSSFED_TOKEN`` if set, else ``who``'s token ('admin' or a site) from the secrets file."""
    env = os.environ.get("CROSSFED_TOKEN")
    if env:
        return env
    path = Path(config.coordinator.secrets)
    if not path.exists():
        raise EndpointError(f"no CROSSFED_TOKEN in the environment and no secrets file at {path}")
    data = yaml.safe_load(path.read_text()) or {}
    token = data.get("admin") if who == "admin" else data.get("sites", {}).get(who)
    if not token:
        raise EndpointError(f"secrets file {path} has no token for {who!r}")
    return str(token)


def coordinator_url(config: RunConfig) -> str:
    """The coordinator's URL: the config's, or the embedded one's from its endpoint file."""
    url = config.coordinator.url
    if url != "embedded":
        return url
    endpoint = Path(config.coordinator.state_dir) / ENDPOINT
    if not endpoint.exists():
        raise EndpointError(
            f"embedded coordinator not running: {endpoint} missing (start it with "
            "'crossfed coordinator start --config ...' or run the workflow)"
        )
    return json.loads(endpoint.read_text())["url"]


def client_for(config: RunConfig, who: str, **kwargs: Any) -> CoordinatorClient:
    """A client of the run's coordinator as ``who``, moving weights in ``transport.part_bytes``
    over ``transport.streams`` connections (a site's own ``streams`` first)."""
    from crossfed.client.http import CoordinatorClient

    kwargs.setdefault("part_bytes", config.transport.part_bytes)
    kwargs.setdefault("streams", site_streams(config, who))
    kwargs.setdefault("stream_min_bytes", config.transport.stream_min_bytes)
    kwargs.setdefault("blobs", config.blobs.backend)
    return CoordinatorClient(coordinator_url(config), token_for(config, who), **kwargs)


def site_streams(config: RunConfig, who: str) -> int:
    """Connections per large transfer of ``who``: its sites-file ``streams``, else the
    config's ``transport.streams``."""
    default = config.transport.streams
    if who == "admin":
        return default
    from crossfed.config import load_sites

    site = load_sites(config).get(who)
    return default if site is None or site.streams is None else site.streams
