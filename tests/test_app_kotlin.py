"""The app's Kotlin that needs no Android framework, compiled and run on this host's JVM.

`StageConfig.kt`, `NativeRunner.kt`, `NativeRunnerException.kt` and `DeviceReadings.kt` use only the JDK and
org.json, so their unit tests (android_app/app/app/src/test, the ones `./gradlew test` runs) run here too: compiled with
Debian's `kotlinc` against Android's own org.json (`libandroid-json-org-java`) and JUnit 4, and run with
libzl_jni.so built for the host on java.library.path, so `NativeRunnerHostTest` drives the real JNI library
through the app's own `NativeRunner` object. Debian ships Kotlin 1.3, which predates trailing commas (the
app builds with Kotlin 1.9): the copies compiled here have them removed, nothing else changes.

Skips when kotlinc, JUnit 4 or the org.json jar is missing (`apt install kotlin junit4
libandroid-json-org-java`), or libzl_jni.so is not built (no JDK at configure time).

    .venv/bin/python -m pytest tests/test_app_kotlin.py
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from test_runner import jni_host_classes

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "android_app" / "app" / "app" / "src"
# no android.* imports:
MAIN_SOURCES = ("StageConfig.kt", "NativeRunner.kt", "NativeRunnerException.kt", "DeviceReadings.kt")
JARS = {name: Path("/usr/share/java") / name for name in
        ("junit4.jar", "hamcrest-core.jar", "json-android.jar", "kotlin-stdlib.jar")}


def without_trailing_commas(text: str) -> str:
    """Kotlin 1.4+ source as Kotlin 1.3 parses it: a comma before `)` removed."""
    return re.sub(r",(\s*\))", r"\1", text)


def test_app_kotlin_unit_tests_on_the_host_jvm(tmp_path):
    kotlinc = shutil.which("kotlinc")
    missing = [str(p) for p in JARS.values() if not p.is_file()]
    if kotlinc is None or missing:
        pytest.skip(f"needs kotlinc and {', '.join(missing) or 'the jars'}: "
                    "apt install kotlin junit4 libandroid-json-org-java")
    library, _ = jni_host_classes()
    src = tmp_path / "src"
    src.mkdir()
    package = Path("java") / "com" / "zerolock" / "zl"
    sources = [APP / "main" / package / name for name in MAIN_SOURCES]
    sources += sorted((APP / "test" / package).glob("*.kt"))
    for path in sources:
        (src / path.name).write_text(without_trailing_commas(path.read_text()))
    classpath = ":".join(str(p) for p in JARS.values())
    out = tmp_path / "classes"
    compiled = subprocess.run([kotlinc, "-cp", classpath, "-d", str(out), *map(str, sorted(src.glob("*.kt")))],
                              capture_output=True, text=True, timeout=300)
    assert compiled.returncode == 0, compiled.stderr[-4000:]

    tests = [f"com.zerolock.zl.{p.stem}" for p in sorted((APP / "test" / package).glob("*Test.kt"))]
    assert "com.zerolock.zl.NativeRunnerHostTest" in tests
    run = subprocess.run(["java", f"-Djava.library.path={library.parent}", "-Dzl.test.hostJni=1",
                          "-cp", f"{out}:{classpath}", "org.junit.runner.JUnitCore", *tests],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert re.search(r"OK \((\d+) tests\)", run.stdout), run.stdout[-2000:]
    count = int(re.search(r"OK \((\d+) tests\)", run.stdout).group(1))
    assert count == 12, run.stdout[-2000:]  # every test ran: none skipped by an assumption
