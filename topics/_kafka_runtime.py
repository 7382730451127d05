"""Apache Kafka from its jars: fetching them from Maven Central, the JVM command line, storage
formatting."""

from __future__ import annotations

import asyncio
import base64
import fcntl
import logging
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

from ._errors import BrokerStartError

logger = logging.getLogger(__name__)

KAFKA_VERSION = "4.1.1"
SCALA_VERSION = "2.13"
_LOG4J_VERSION = "2.24.3"


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/deferline`` (``~/.cache/deferline``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deferline"


def fetch_kafka_jars(
    cache_dir: str | os.PathLike[str] | None = None, *, version: str = KAFKA_VERSION
) -> Path:
    """Return the folder of Apache Kafka's runtime jars, fetching them with Maven if needed.

    Blocking; safe against concurrent callers (file lock). Raises BrokerStartError naming
    what is missing when the jars are not cached and cannot be fetched.
    """
    root = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / f"kafka-{version}"
    lib = root / "lib"
    if (lib / ".complete").exists():
        return lib
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerStartError(
            f"Apache Kafka {version} jars are not cached in {lib} and mvn is not on PATH to "
            "fetch them from Maven Central (Debian: apt-get install -y maven)"
        )
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (lib / ".complete").exists():
            return lib
        (root / "pom.xml").write_text(_POM.format(kafka=version, scala=SCALA_VERSION))
        partial = root / "lib.partial"
        shutil.rmtree(partial, ignore_errors=True)
        began = time.monotonic()
        logger.info("fetching Apache Kafka %s jars into %s", version, lib)
        try:
            result = subprocess.run(
                [
                    mvn,
                    "-q",
                    "-B",
                    "-f",
                    str(root / "pom.xml"),
                    "dependency:copy-dependencies",
                    f"-DoutputDirectory={partial}",
                    "-DincludeScope=runtime",
                ],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=900,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise BrokerStartError(
                f"fetching Apache Kafka {version} jars with Maven timed out"
            ) from exc
        main_jar = partial / f"kafka_{SCALA_VERSION}-{version}.jar"
        if result.returncode != 0 or not main_jar.exists():
            output = (result.stdout + result.stderr).strip().splitlines()[-25:]
            raise BrokerStartError(
                f"fetching Apache Kafka {version} jars with Maven failed "
                f"(exit {result.returncode}; pom: {root / 'pom.xml'}):\n" + "\n".join(output)
            )
        (partial / ".complete").write_text(f"{time.monotonic() - began:.1f}s\n")
        shutil.rmtree(lib, ignore_errors=True)
        partial.rename(lib)
    return lib


def _new_cluster_id() -> str:
    """A random cluster id, never starting with "-" (as Kafka's own ``Uuid.randomUuid``):
    ``kafka-storage format -t -x...`` would read such an id as an option."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cluster_id.startswith("-"):
            return cluster_id


def _jvm(
    java: str, lib: Path, workdir: Path, heap: str, request_log: Path | None = None
) -> list[str]:
    """The JVM command line of a broker (or one of its tools) from ``lib``'s jars; with
    ``request_log``, the broker writes a line per request it completed there (Kafka's
    ``kafka.request.logger`` at DEBUG: its API, and the time it spent queued, working,
    waiting in purgatory and sending)."""
    log4j = _LOG4J2_PROPERTIES
    if request_log is not None:
        log4j += _REQUEST_LOG_PROPERTIES.format(path=request_log)
    (workdir / "log4j2.properties").write_text(log4j)
    return [
        java,
        f"-Xms{min(256, _megabytes(heap))}m",
        f"-Xmx{heap}",
        "-XX:+UseG1GC",
        "-XX:MaxGCPauseMillis=20",
        "-XX:TieredStopAtLevel=1",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={workdir / 'log4j2.properties'}",
        f"-Dkafka.logs.dir={workdir / 'logs'}",
        "-cp",
        f"{lib}/*",
    ]


def _megabytes(heap: str) -> int:
    unit = heap[-1].lower()
    number = int(heap[:-1]) if unit in "kmg" else int(heap)
    return {"k": number // 1024, "m": number, "g": number * 1024}.get(unit, number // 2**20)


async def _format_storage(
    jvm: list[str], properties: Path, cluster_id: str, extra: list[str]
) -> None:
    fmt = await asyncio.create_subprocess_exec(
        *jvm,
        "kafka.tools.StorageTool",
        "format",
        "-t",
        cluster_id,
        "-c",
        str(properties),
        *extra,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(fmt.communicate(), timeout=120)
    except TimeoutError:
        fmt.kill()
        await fmt.wait()
        raise BrokerStartError("kafka.tools.StorageTool format timed out") from None
    if fmt.returncode != 0:
        raise BrokerStartError(
            f"kafka.tools.StorageTool format failed (exit {fmt.returncode}):\n"
            + out.decode(errors="replace")[-3000:]
        )


_POM = (
    """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <!-- Throwaway project: only used to resolve Apache Kafka's runtime jars. -->
  <modelVersion>4.0.0</modelVersion>
  <groupId>deferline.local</groupId>
  <artifactId>kafka-jars</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_{scala}</artifactId>
      <version>{kafka}</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j-impl</artifactId>
      <version>"""
    + _LOG4J_VERSION
    + """</version>
    </dependency>
  </dependencies>
</project>
"""
)


_LOG4J2_PROPERTIES = """\
status = error
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.out.ref = OUT
"""

_REQUEST_LOG_PROPERTIES = """\
appender.requests.type = File
appender.requests.name = REQUESTS
appender.requests.fileName = {path}
appender.requests.layout.type = PatternLayout
appender.requests.layout.pattern = %m%n
logger.requests.name = kafka.request.logger
logger.requests.level = DEBUG
logger.requests.additivity = false
logger.requests.appenderRef.requests.ref = REQUESTS
"""
