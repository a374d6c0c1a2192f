"""KITE worker: runs the model, reuses cached prefix KV (Upcycle), streams tokens, hands new blocks on."""
