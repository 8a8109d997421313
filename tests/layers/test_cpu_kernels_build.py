"""The native build's lock: a build killed half-way must not block later starts forever."""
from __future__ import annotations

import subprocess
import sys

from tokenmill.platforms.cpu_native import _exclusive


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path):
    (tmp_path / "lock").write_text("")           # torch's FileBaton of a build that never finished
    with _exclusive(str(tmp_path)):
        assert not (tmp_path / "lock").exists()


def test_the_build_lock_is_released_when_its_holder_dies(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", f"""
import os, signal
from tokenmill.platforms.cpu_native import _exclusive
with _exclusive({str(tmp_path)!r}):
    print("held", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.wait(30)
    with _exclusive(str(tmp_path)):             # would block forever if the dead holder kept it
        pass
