"""`kite keys ...`: make API keys and the SHA-256 digests the gateway is configured with.

    kite keys new TENANT     print a fresh random key (give it to the client, once) and the line to add
                             to KITE_API_KEYS (`tenant:sha256hex`) or to the keys file
    kite keys hash [KEY]     print the digest of KEY (read from stdin when omitted, so it stays out of
                             the shell history)

The gateway stores and compares digests only; the plaintext key is never written anywhere by KITE.
"""

from __future__ import annotations

import argparse
import sys

from kite_shared.security import hash_api_key, new_api_key


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kite keys", description="API keys of the KITE gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    new = sub.add_parser("new", help="make a random key for TENANT and print its config line")
    new.add_argument("tenant")
    hsh = sub.add_parser("hash", help="print the SHA-256 digest of a key (from stdin when omitted)")
    hsh.add_argument("key", nargs="?")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "new":
        key = new_api_key()
        print(f"key (give it to the client; KITE keeps only its digest): {key}")
        print(f"KITE_API_KEYS entry: {args.tenant}:{hash_api_key(key)}")
        print(f"keys file (YAML):    {args.tenant}: [{hash_api_key(key)}]")
        return 0
    key = args.key if args.key is not None else sys.stdin.readline().rstrip("\r\n")
    if not key:
        print("no key given", file=sys.stderr)
        return 2
    print(hash_api_key(key))
    return 0


if __name__ == "__main__":
    sys.exit(main())
