"""KITE fingerprinter: tokenizes once (chat template applied here) and attaches the computation fingerprint."""
