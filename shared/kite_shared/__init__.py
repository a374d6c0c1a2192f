"""KITE's common library: config registry, message schemas, NATS subjects, fingerprints, RU format."""
