"""A service's NATS connection: credentials and TLS from the KITE_NATS_* settings, a client that never sends
them in plaintext, reconnects for ever with errors logged without flooding or leaking secrets, and the
confirmation that the server has a service's subscriptions.

Boundary: connecting and the connection's own health; what a service serves over it is
kite_shared.service.runtime (and kite_shared.endpoints).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from pathlib import Path
from typing import Any, Callable

import nats
from nats.aio.client import PING_PROTO
from nats.aio.client import Client as NATS
from prometheus_client import Counter

from kite_shared.config import CommonConfig, ConfigError
from kite_shared.security import redact_url

log = logging.getLogger(__name__)

NATS_RECONNECTS = Counter("kite_nats_reconnects_total", "Times this process reconnected to NATS")


def nats_auth_options(common: CommonConfig | None) -> dict[str, Any]:
    """nats.connect keyword arguments for credentials and TLS from the registry (KITE_NATS_*).

    User/password, token and NKey seed file are exclusive choices of NATS server auth; credentials may
    also be in the URL (nats://user:pass@host), which is never logged unredacted. A CA, client cert or
    key turns TLS on (a tls:// URL turns it on with the system CAs). Errors name the variable and the
    file, never a secret or a file's contents.
    """
    if common is None:
        return {}
    options: dict[str, Any] = {}
    if common.nats_password and not common.nats_user:
        raise ConfigError("KITE_NATS_PASSWORD is set but KITE_NATS_USER is empty")
    if common.nats_user or common.nats_password:
        options.update(user=common.nats_user, password=common.nats_password)
    if common.nats_token:
        options["token"] = common.nats_token
    if sum(bool(x) for x in (common.nats_user or common.nats_password, common.nats_token,
                             common.nats_nkey_seed_file)) > 1:
        raise ConfigError("set only one of KITE_NATS_USER/KITE_NATS_PASSWORD, KITE_NATS_TOKEN and "
                          "KITE_NATS_NKEY_SEED_FILE")
    if common.nats_nkey_seed_file:
        options["nkeys_seed"] = str(_check_nkey_seed_file(Path(common.nats_nkey_seed_file).expanduser()))
    if common.nats_tls_ca or common.nats_tls_cert or common.nats_tls_key:
        if bool(common.nats_tls_cert) != bool(common.nats_tls_key):
            raise ConfigError("KITE_NATS_TLS_CERT and KITE_NATS_TLS_KEY go together")
        ca = str(Path(common.nats_tls_ca).expanduser()) if common.nats_tls_ca else None
        try:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
        except OSError as exc:  # ssl.SSLError is an OSError too
            raise ConfigError(f"KITE_NATS_TLS_CA={ca!r}: cannot load a CA bundle from it: {exc}") from None
        if common.nats_tls_cert:
            cert, key = (str(Path(p).expanduser()) for p in (common.nats_tls_cert, common.nats_tls_key))
            _warn_if_others_can_read(Path(key), "KITE_NATS_TLS_KEY")
            try:
                # Without a password callback OpenSSL would prompt on the terminal for an encrypted key.
                context.load_cert_chain(cert, key, password=_refuse_encrypted_key)
            except OSError as exc:
                raise ConfigError(f"KITE_NATS_TLS_CERT={cert!r} / KITE_NATS_TLS_KEY={key!r}: cannot load "
                                  f"the client certificate and key: {exc}") from None
        options["tls"] = context
    return options


def _refuse_encrypted_key() -> bytes:
    raise ConfigError("KITE_NATS_TLS_KEY is encrypted: give an unencrypted key file (readable only by "
                      "the service, mode 0600)")


def _warn_if_others_can_read(path: Path, variable: str) -> None:
    try:
        mode = path.stat().st_mode
    except OSError:
        return  # the load that follows reports it
    if mode & 0o077:
        log.warning("%s=%s can be read by other users (mode %o): chmod 600 it", variable, path, mode & 0o777)


def _check_nkey_seed_file(path: Path) -> Path:
    """`path` if it holds a valid NKey seed (nats-py reads it again at every connect to sign the nonce)."""
    try:
        import nkeys  # nats-py signs the server's nonce with it
    except ImportError:
        raise ConfigError("KITE_NATS_NKEY_SEED_FILE needs the `nkeys` package (pip install nkeys)") from None
    try:
        seed = bytearray(path.read_bytes().strip())
    except OSError as exc:
        raise ConfigError(f"KITE_NATS_NKEY_SEED_FILE={str(path)!r}: cannot read it: {exc.strerror}") from None
    try:
        nkeys.from_seed(seed).wipe()
    except Exception:  # nkeys' errors carry no text; never echo the file's contents
        raise ConfigError(f"KITE_NATS_NKEY_SEED_FILE={str(path)!r}: does not hold an NKey seed (one line "
                          "starting with SU, as written by `nk -gen user`)") from None
    finally:
        seed[:] = b"\0" * len(seed)
    _warn_if_others_can_read(path, "KITE_NATS_NKEY_SEED_FILE")
    return path


class _KiteNatsClient(NATS):
    """A nats-py client that never sends CONNECT (credentials included) in plaintext when TLS is wanted,
    and whose flush() confirms every command sent before it.

    nats-py upgrades a connection to TLS only when the server's INFO says `tls_required`, even for a tls://
    URL or a `tls=` context: a server without TLS (or anyone in the middle rewriting INFO) would receive
    the password or token in the clear. With TLS configured this client refuses the server instead
    (nats.errors.SecureConnWantedError, "secure connection not available").

    nats-py 2.16 writes a PING straight to the socket while the commands before it (a SUB just made) wait
    in its buffer for its flusher task: the PONG could come back before the server had read them, so
    confirm_subscriptions confirmed a subscription the server did not have yet, and a message published
    at once found no subscriber. Here a PING takes its place in that buffer, behind them.
    """

    async def _send_ping(self, future: asyncio.Future | None = None) -> None:
        self._pongs.append(future if future is not None else asyncio.get_running_loop().create_future())
        await self._send_command(PING_PROTO)
        await self._flush_pending()

    def _connect_command(self) -> bytes:
        server = self._current_server
        scheme = server.uri.scheme if server is not None else ""
        wants_tls = "tls" in self.options or scheme == "tls"
        has_tls = bool(self.options.get("tls_handshake_first") or self._server_info.get("tls_required"))
        if wants_tls and not has_tls and scheme not in ("ws", "wss"):
            raise nats.errors.SecureConnWantedError()
        return super()._connect_command()


class NatsErrorLog:
    """The error callback of a NATS connection: logs each error, an unchanged repeat of one only with backoff.

    With max_reconnect_attempts=-1 nats-py's connect() itself retries for ever, the first connect included
    (it never raises while allow_reconnect is on), calling the error callback at every failed attempt, one
    each reconnect_time_wait: a wrong password would otherwise log two lines a second for as long as it
    stays wrong. A repeat is logged at its 2nd, 4th, 8th, ... occurrence and at least once a minute, with
    its count. An authorization violation or a refused TLS setup will not fix itself: logged at ERROR,
    the rest at WARNING. Secrets are scrubbed (_scrub). The counts restart at every (re)connect.
    """

    REPEAT_EVERY_S = 60.0

    def __init__(self, common: CommonConfig | None, clock: Callable[[], float] = time.monotonic) -> None:
        self._common = common
        self._clock = clock
        self._repeats: dict[str, tuple[int, float]] = {}  # error text -> (times seen, when last logged)
        self.failures = 0  # errors since the last (re)connect
        self.last = ""  # the last error's text (scrubbed)

    async def __call__(self, exc: Exception) -> None:
        text = _scrub(str(exc) or type(exc).__name__, self._common)
        if isinstance(exc, OSError) and self._common is not None:
            # A socket error names the address on asyncio's loop but not on uvloop's ("[Errno 111]
            # Connection refused"): say where the service was connecting, credentials left out.
            text += f" (connecting to {redact_url(self._common.nats_url)})"
        self.failures += 1
        self.last = text
        now = self._clock()
        seen, logged_at = self._repeats.get(text, (0, now))
        seen += 1
        if seen & (seen - 1) and now - logged_at < self.REPEAT_EVERY_S:  # not a power of two, not yet due
            self._repeats[text] = (seen, logged_at)
            return
        self._repeats[text] = (seen, now)
        level, hint = logging.WARNING, ""
        if "authorization violation" in text.lower() or isinstance(exc, nats.errors.AuthorizationError):
            level, hint = logging.ERROR, (" (the NATS server refuses this service's credentials: check "
                                          "KITE_NATS_USER/KITE_NATS_PASSWORD, KITE_NATS_TOKEN, "
                                          "KITE_NATS_NKEY_SEED_FILE or the user in KITE_NATS_URL)")
        elif isinstance(exc, (nats.errors.SecureConnWantedError, ssl.SSLCertVerificationError)):
            level = logging.ERROR
        repeats = f" ({seen} times)" if seen > 1 else ""
        log.log(level, "NATS error: %s%s%s", text, repeats, hint)

    def connected(self) -> None:
        self._repeats.clear()
        self.failures = 0


async def connect_nats(url: str, name: str, common: CommonConfig | None = None, *,
                       error_log: NatsErrorLog | None = None, **overrides: Any) -> NATS:
    """Connect with reconnects forever; credentials and TLS from `common` (nats_auth_options).

    Reconnects forever includes the first connect: this returns only once connected, however long that
    takes (a NATS server not up yet, a wrong password), logging why meanwhile (NatsErrorLog, or
    `error_log`). `overrides` replace nats.connect options (tests and CLIs: allow_reconnect=False, which
    makes a failed first attempt raise; connect_timeout=...).
    """
    options = nats_auth_options(common)
    errors = error_log or NatsErrorLog(common)

    async def on_error(exc: Exception) -> None:  # nats-py wants a coroutine function, not a callable object
        await errors(exc)

    async def on_disconnect() -> None:
        log.warning("NATS disconnected; reconnecting")

    async def on_reconnect() -> None:
        NATS_RECONNECTS.inc()
        errors.connected()
        log.info("NATS reconnected")

    options.update(
        servers=[u.strip() for u in url.split(",") if u.strip()],
        name=name,
        max_reconnect_attempts=-1,  # a NATS restart must never need a manual service restart
        reconnect_time_wait=0.5,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )
    options.update(overrides)
    nc = _KiteNatsClient()
    await nc.connect(**options)
    if errors.failures:
        log.info("NATS connected after %d failed attempt(s)", errors.failures)
    errors.connected()
    return nc


def _scrub(text: str, common: CommonConfig | None) -> str:
    """`text` with any configured NATS secret replaced, in case a client error echoes one."""
    if common is not None:
        for secret in (common.nats_password, common.nats_token):
            if secret:
                text = text.replace(secret, "***")
    return text


SUBSCRIPTIONS_CONFIRM_TIMEOUT_S = 5.0  # one PING round trip's wait (nats.py's default is 10 s)


async def confirm_subscriptions(nc: NATS) -> None:
    """Return once the server has processed every SUB sent so far (a PING round trip: it answers in order).
    A reconnect meanwhile drops the PING's pending answer (nats.py forgets its pongs) but sends every
    subscription again to the new connection: so an unanswered PING is asked again, until one is answered.
    Before, the flush's timeout ended the service's setup, and the process: a service that lost its
    connection while it started exited instead of serving once reconnected."""
    while True:
        try:
            await nc.flush(timeout=SUBSCRIPTIONS_CONFIRM_TIMEOUT_S)
            return
        except nats.errors.FlushTimeoutError:
            if nc.is_closed:
                raise
            log.warning("NATS did not confirm the subscriptions within %.0f s (connected: %s); asking again",
                        SUBSCRIPTIONS_CONFIRM_TIMEOUT_S, nc.is_connected)
