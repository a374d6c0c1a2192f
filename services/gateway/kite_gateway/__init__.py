"""KITE gateway: OpenAI-compatible HTTP API and gRPC API in front of the NATS request path."""
