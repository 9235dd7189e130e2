"""Materialise the Kafka, Cassandra and JMX-exporter runtime classpaths with Maven.

Each pom under ``infra/local/<name>/`` is resolved with ``dependency:copy-dependencies`` into
``.local/lib/<name>/``. When ``../shared/m2`` (a file mirror of Maven Central) exists, a settings file routes
every repository there; elsewhere the same poms resolve from Maven Central. A stamp with the pom's hash makes
re-runs free.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from ops.stack.services import INFRA, StackError
from runtime.settings import StackSettings

CLASSPATHS = ("kafka", "cassandra", "jmx")


def _stamp(pom: Path) -> str:
    return hashlib.sha256(pom.read_bytes()).hexdigest()


def jars_ready(stack: StackSettings, name: str) -> bool:
    stamp = stack.lib_dir / name / ".pom-sha256"
    return stamp.exists() and stamp.read_text() == _stamp(INFRA / name / "pom.xml")


def materialise(stack: StackSettings, name: str) -> Path:
    """Resolve one classpath unless its stamp says it is current. Returns the lib folder."""
    pom = INFRA / name / "pom.xml"
    out = stack.lib_dir / name
    if jars_ready(stack, name):
        return out
    mvn = shutil.which("mvn")
    if mvn is None:
        raise StackError("Maven is not installed (apt-get install maven); it fetches the Kafka and Cassandra jars")
    if out.exists():
        shutil.rmtree(out)
    cmd = [mvn, "-B", "-q", f"-Dmaven.repo.local={stack.root / 'm2repo'}", "-f", str(pom),
           "dependency:copy-dependencies", "-DincludeScope=runtime", f"-DoutputDirectory={out}"]
    env = dict(os.environ)
    if stack.shared_m2 is not None:
        cmd[2:2] = ["-s", str(INFRA / "maven-settings.xml")]
        env["SHARED_M2"] = str(stack.shared_m2.resolve())
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise StackError(f"Maven could not resolve {pom}:\n{result.stdout[-3000:]}{result.stderr[-2000:]}")
    (out / ".pom-sha256").write_text(_stamp(pom))
    return out


def materialise_all(stack: StackSettings) -> None:
    for name in CLASSPATHS:
        materialise(stack, name)
