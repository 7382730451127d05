"""Write the JSON Schema of every wire record: ``python -m deferline.schemas.export DIR``.

``make schemas`` runs it for ``docs/schemas``; ``--check`` only compares, for CI.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ._jsonschema import rendered_json_schemas

__all__ = ["main", "write_json_schemas"]


def write_json_schemas(directory: Path, *, check: bool = False) -> list[str]:
    """Write (or with ``check``, only compare) the schema files; returns the names that differed.

    A ``*.json`` file in ``directory`` that no record produces is reported as differing and
    left in place.
    """
    wanted = rendered_json_schemas()
    differing = [
        name
        for name, text in wanted.items()
        if not (directory / name).is_file() or (directory / name).read_text("utf-8") != text
    ]
    stale = sorted(p.name for p in directory.glob("*.json") if p.name not in wanted)
    if not check:
        directory.mkdir(parents=True, exist_ok=True)
        for name in differing:
            (directory / name).write_text(wanted[name], encoding="utf-8")
    return differing + stale


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deferline.schemas.export",
        description="Write one JSON Schema file per deferline wire record into DIRECTORY.",
    )
    parser.add_argument("directory", type=Path, help="target folder, e.g. docs/schemas")
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if any file is out of date"
    )
    args = parser.parse_args(argv)
    directory: Path = args.directory
    wanted = rendered_json_schemas()
    differing = write_json_schemas(directory, check=args.check)
    for name in sorted(set(wanted) | set(differing)):
        path = directory / name
        if name not in wanted:
            print(f"stale    {path} (no record kind produces it; delete it)")
        elif name in differing:
            print(f"{'outdated' if args.check else 'wrote   '} {path}")
        else:
            print(f"ok       {path}")
    if args.check and differing:
        print("JSON Schemas are out of date: run `make schemas`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
