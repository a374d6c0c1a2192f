"""The `kite` command line: run the local stack, benchmarks and admin tools."""
