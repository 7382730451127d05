"""``python -m deferline.topics fetch-kafka-jars``: cache Apache Kafka's jars (for KRaftBroker)."""

from __future__ import annotations

import argparse
import sys

from ._errors import BrokerStartError
from ._kafka_runtime import KAFKA_VERSION, fetch_kafka_jars


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deferline.topics")
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch-kafka-jars", help="fetch Apache Kafka's jars through Maven")
    fetch.add_argument("--cache-dir", default=None, help="default: ~/.cache/deferline")
    fetch.add_argument("--version", default=KAFKA_VERSION)
    args = parser.parse_args(argv)
    try:
        lib = fetch_kafka_jars(args.cache_dir, version=args.version)
    except BrokerStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(lib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
