"""The `kite` command line: run the local stack, benchmarks and admin tools."""

import os

# This package starts its children through a fork that runs code before exec (local_servers.die_with_parent
# as preexec_fn), so the fork runs the pthread_atfork handlers. gRPC's handlers restart its event engine in
# the child, whose poller then fails once the child closes inherited descriptors before exec: about 1 child
# in 100 was killed (SIGSEGV, or SIGABRT after "epoll_wait error: Bad file descriptor") when the starting
# process held a gRPC connection, and a CI run lost a ru-pool that way. gRPC reads the setting once, at its
# first use: hence here, before this package or its users can import grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
