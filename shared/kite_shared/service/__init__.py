"""What every KITE service process does the same way, one module per concern:

    runtime          ServiceRuntime (connect, serve endpoints, heartbeats, pings, periodic work, drain) and
                     run_service, the entrypoint body every service shares
    nats_connection  credentials and TLS, the connection that reconnects for ever, its error log, the
                     confirmation of subscriptions
    logs             JSON log lines carrying the request context
    heap             the garbage collector: the startup heap frozen, full collections timed
    process          signals before NATS is connected, the immediate exit, stopping child processes

How endpoints decode, reply, trace and count: kite_shared.endpoints. runtime imports the other modules;
they import nothing of this package.

Import from here what services and tools use (`from kite_shared.service import ServiceRuntime`); a test
that patches a module attribute patches it in the module that defines it.
"""

from kite_shared.endpoints import cancel_and_wait, request_id_var, tenant_var
from kite_shared.service.heap import GC_FULL_COLLECTION_SECONDS, freeze_startup_heap, time_full_collections
from kite_shared.service.logs import JsonLogFormatter, RequestContextFilter, setup_package_logging
from kite_shared.service.nats_connection import NatsErrorLog, connect_nats, nats_auth_options
from kite_shared.service.process import exit_on_signal_until_connected, terminate_children
from kite_shared.service.runtime import ServiceRuntime, run_service

__all__ = [
    "GC_FULL_COLLECTION_SECONDS", "JsonLogFormatter", "NatsErrorLog", "RequestContextFilter", "ServiceRuntime",
    "cancel_and_wait", "connect_nats", "exit_on_signal_until_connected", "freeze_startup_heap",
    "nats_auth_options", "request_id_var", "run_service", "setup_package_logging", "tenant_var",
    "terminate_children", "time_full_collections",
]
