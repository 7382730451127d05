"""A throwaway PostgreSQL server from Debian's package, for Airflow's metadata database.

``initdb`` into a temporary directory, ``postgres`` on a free TCP port on 127.0.0.1 and a unix
socket in the same directory, stopped and removed at ``close()`` (or kept, for a benchmark
that reuses its seeded databases).
Databases are made with ``create_database``, optionally as a copy of another (``TEMPLATE``), so
a migrated Airflow schema is copied in a second rather than migrated again.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from deferline.topics import free_port

USER = "airflow"
# initdb refuses to run as root: as root, the server runs as the account Debian's package made.
OS_USER = "postgres"


def postgres_bin() -> Path | None:
    """The directory of Debian's newest PostgreSQL server binaries, or None when not installed."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda path: int(Path(path).parent.parent.name),
    )
    return Path(found[-1]).parent if found else None


class PostgresServer:
    """One PostgreSQL cluster running until ``close()``: in a temporary directory removed then,
    or in ``keep``, made there on first use and left there (its databases reused later)."""

    def __init__(self, bin_dir: Path, keep: Path | None = None) -> None:
        self._bin = bin_dir
        self._keep = keep is not None
        self.dir = keep or Path(tempfile.mkdtemp(prefix="deferline-pg-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(self.dir, OS_USER)
        self.port = free_port()
        data = self.dir / "data"
        if not data.exists():
            initdb = ("-D", str(data), "-U", USER, "--auth=trust", "--no-sync", "-E", "UTF8")
            self._run("initdb", *initdb)
        # Durability is not under test: no fsync, no waiting for the WAL.
        options = (
            f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        self._run(
            "pg_ctl",
            "start",
            "-w",
            "-t",
            "60",
            "-D",
            str(data),
            "-o",
            options,
            "-l",
            str(self.dir / "postgres.log"),
        )
        self._data = data

    @property
    def pid(self) -> int:
        """The postmaster's process id (the connections' backends are its children)."""
        return int((self._data / "postmaster.pid").read_text().split()[0])

    def _run(self, tool: str, *args: str) -> None:
        user = ["runuser", "-u", OS_USER, "--"] if os.geteuid() == 0 else []
        subprocess.run([*user, str(self._bin / tool), *args], check=True, capture_output=True)

    def url(self, database: str) -> str:
        """SQLAlchemy's URL for ``database`` over the unix socket (psycopg2)."""
        return f"postgresql+psycopg2://{USER}@/{database}?host={self.dir}&port={self.port}"

    def psql(self, sql: str, database: str = "postgres") -> str:
        """Run one SQL statement with psql; its unaligned output."""
        command = [str(self._bin / "psql"), "-h", str(self.dir), "-p", str(self.port)]
        command += ["-U", USER, "-d", database, "-v", "ON_ERROR_STOP=1", "-Atc", sql]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{sql}: {done.stderr.strip()}")
        return done.stdout.strip()

    def has_database(self, name: str) -> bool:
        return self.psql(f"SELECT count(*) FROM pg_database WHERE datname = '{name}'") == "1"

    def create_database(self, name: str, template: str | None = None) -> str:
        """Create ``name`` (a copy of ``template`` when given); its URL."""
        self.psql(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
        return self.url(name)

    def close(self) -> None:
        mode = "fast" if self._keep else "immediate"
        self._run("pg_ctl", "stop", "-w", "-m", mode, "-D", str(self._data))
        if not self._keep:
            shutil.rmtree(self.dir, ignore_errors=True)
