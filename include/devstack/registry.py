"""The dev stack's container registry: Debian's ``docker-registry`` (CNCF distribution).

``command(root, port)`` writes a registry config under ``root`` and returns the argv that
serves it; with ``htpasswd`` set, the registry requires basic auth from that file. The registry
mirror (mirror.py) serves another data directory read-only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

REGISTRY_BINARY = "docker-registry"


def command(
    root: Path,
    port: int,
    htpasswd: Path | None = None,
    *,
    data_dir: Path | None = None,
    readonly: bool = False,
) -> list[str]:
    """Write ``root/config.yml`` and return the argv that serves the registry on 127.0.0.1:``port``."""
    binary = shutil.which(REGISTRY_BINARY) or "/usr/bin/docker-registry"
    if not Path(binary).exists():
        raise FileNotFoundError(
            f"{REGISTRY_BINARY} is not installed: run `make setup` (it installs Debian's docker-registry package)"
        )
    root.mkdir(parents=True, exist_ok=True)
    config = {
        "version": 0.1,
        "log": {"level": "info", "formatter": "text"},
        "storage": {
            "filesystem": {"rootdirectory": str(data_dir or root / "data")},
            "delete": {"enabled": not readonly},
            "maintenance": {"readonly": {"enabled": readonly}},
        },
        "http": {"addr": f"127.0.0.1:{port}", "headers": {"X-Content-Type-Options": ["nosniff"]}},
    }
    if htpasswd is not None:
        config["auth"] = {"htpasswd": {"realm": "kubetrain", "path": str(htpasswd)}}
    path = root / "config.yml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return [binary, "serve", str(path)]
