"""Container HEALTHCHECK for the KITE images: exit 0 only if this container's own endpoint answers 200.

    python /opt/kite/healthcheck.py gateway   # GET /health on KITE_GATEWAY_HTTP_PORT (503 = no live worker)
    python /opt/kite/healthcheck.py metrics   # GET /metrics on KITE_METRICS_PORT

It probes 127.0.0.1, never a NATS subject: a NATS ping is answered by any replica of a service, so it
cannot tell whether *this* container is healthy. Ports come from the config registry, so the probe
follows the same variables and defaults as the service it checks.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from typing import Mapping

from kite_shared.config import setting

TIMEOUT_S = 3.0


def probe_url(mode: str, environ: Mapping[str, str]) -> str:
    if mode == "gateway":
        spec = setting("KITE_GATEWAY_HTTP_PORT")
        path = "/health"
    elif mode == "metrics":
        spec = setting("KITE_METRICS_PORT")
        path = "/metrics"
    else:
        raise ValueError(f"unknown probe {mode!r}: expected gateway or metrics")
    port = spec.parse(environ.get(spec.env, spec.default))
    if port == 0:
        # Nothing listens on port 0; report it instead of calling a disabled endpoint healthy.
        raise ValueError(f"{spec.env}=0 disables the endpoint this health check probes")
    return f"http://127.0.0.1:{port}{path}"


def main(argv: list[str], environ: Mapping[str, str] = os.environ) -> int:
    if len(argv) != 1:
        print("usage: healthcheck.py gateway|metrics", file=sys.stderr)
        return 2
    try:
        url = probe_url(argv[0], environ)
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            status = response.status
    except urllib.error.HTTPError as exc:  # 503 from the gateway's /health lands here
        print(f"unhealthy: {exc.url} answered {exc.code}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"unhealthy: {url} answered {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
