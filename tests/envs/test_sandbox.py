"""The code sandbox: escapes are contained and score as failures; without bwrap the env refuses to start.

Every attack program prints "ok" only after its attack worked, and is graded against one stdin/stdout
test expecting "ok"; a contained attack therefore scores 0, and the host checks the attack left no trace.
The containment tests skip (with the reason) only where bwrap cannot run on this machine.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import stat
import tempfile
import time

import pytest

from envs import sandbox as sandbox_module
from envs.code_data import CodeProblem, CodeTest
from envs.code_exec import CodeExecEnv
from envs.code_grading import grade
from envs.sandbox import Sandbox, SandboxLimits, SandboxUnavailable

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRINT_OK = CodeProblem("Print ok.", (CodeTest("", "ok", False),))


@pytest.fixture(scope="module")
def box() -> Sandbox:
    try:
        return Sandbox()
    except SandboxUnavailable as error:
        pytest.skip(f"bubblewrap cannot run on this machine: {error}")


def score(box: Sandbox, program: str) -> float:
    return grade(box, PRINT_OK, program).reward


def test_harmless_program_passes(box):
    assert score(box, "print('ok')") == 1.0


def test_write_outside_scratch(box, tmp_path):
    targets = [str(tmp_path / "escaped.txt"), os.path.join(REPO, "escaped.txt"), "/usr/escaped.txt",
               "/sandbox/program.py", "/escaped.txt"]
    program = f"for path in {targets!r}:\n    open(path, 'w').write('x')\nprint('ok')\n"
    assert score(box, program) == 0.0
    for path in targets[:3] + ["/escaped.txt"]:
        assert not os.path.exists(path)
    # The scratch directory itself is writable (and private to the run).
    assert score(box, "open('/tmp/scratch.txt', 'w').write('x')\nprint(open('/tmp/scratch.txt').read() and 'ok')") == 1.0


def test_network_socket(box):
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    try:
        program = ("import socket\n"
                   f"s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('ok')\n")
        assert score(box, program) == 0.0
        assert score(box, "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\nprint('ok')") == 0.0
        with pytest.raises(socket.timeout):
            server.accept()  # nothing from the sandbox reached the host's loopback
    finally:
        server.close()


def _processes_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_fork_bomb(box):
    marker = f"{time.time_ns() % 10**6}.{os.getpid()}"
    program = ("import os\n"
               "while True:\n"
               "    if os.fork() == 0:\n"
               f"        os.execv('/usr/bin/sleep', ['sleep', '{marker}'])\n"
               "print('ok')\n")
    start = time.monotonic()
    assert score(box, program) == 0.0
    assert time.monotonic() - start < 3.5
    assert _processes_with(marker) == []  # every forked process died with the sandbox


def test_allocate_10_gb(box):
    assert score(box, "x = bytearray(10 * 2**30)\nprint('ok')") == 0.0
    assert box.run("stdio", "x = bytearray(10 * 2**30)", "").stderr.strip().endswith("MemoryError")


def test_sleep_forever_hits_the_3s_wall(box):
    start = time.monotonic()
    assert score(box, "import time\ntime.sleep(10**6)\nprint('ok')") == 0.0
    assert 2.9 < time.monotonic() - start < 4.5


def test_cpu_loop_hits_the_cpu_limit():
    try:
        quick = Sandbox(SandboxLimits(wall_seconds=5.0, cpu_seconds=1))
    except SandboxUnavailable as error:
        pytest.skip(f"bubblewrap cannot run on this machine: {error}")
    run = quick.run("stdio", "while True: pass", "")
    assert not run.ok and not run.timed_out and run.returncode != 0  # killed by RLIMIT_CPU before the wall


def test_print_1_gb(box):
    program = "import sys\nfor _ in range(2**14):\n    sys.stdout.write('x' * 2**16)\nprint('ok')\n"
    start = time.monotonic()
    run = box.run("stdio", program, "")
    assert run.output_exceeded and not run.ok
    assert len(run.stdout) == box.limits.output_bytes
    assert time.monotonic() - start < 2.5
    assert score(box, program) == 0.0


def test_read_host_files(box, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("ok")
    home = os.path.expanduser("~")
    for program in (
        "print(open('/etc/shadow').read() and 'ok')",
        "print(open('/etc/passwd').read() and 'ok')",
        f"print(open({str(secret)!r}).read())",
        f"print(open({os.path.join(REPO, 'pyproject.toml')!r}).read() and 'ok')",
        f"import os\nprint(os.listdir({home!r}) is not None and 'ok')",
    ):
        assert score(box, program) == 0.0, program


def test_refuses_to_start_without_bwrap(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap") as info:
        CodeExecEnv()
    assert "\n" not in str(info.value)


def test_refuses_to_start_when_bwrap_cannot_run():
    # Not pytest's tmp_path: run as root, the sandbox starts as nobody, who cannot enter that directory.
    with tempfile.TemporaryDirectory() as folder:
        os.chmod(folder, 0o755)
        _check_broken_bwrap(pathlib.Path(folder))


def _check_broken_bwrap(tmp_path: pathlib.Path) -> None:
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    with pytest.raises(SandboxUnavailable, match="uid map: Permission denied") as info:
        CodeExecEnv(bwrap=str(fake))
    assert "\n" not in str(info.value) and "apt-get install bubblewrap" in str(info.value)
    with pytest.raises(SandboxUnavailable, match="cannot be started"):
        Sandbox(bwrap=str(tmp_path / "missing-bwrap"))
    assert sandbox_module.INSTALL_HINT in str(info.value)
