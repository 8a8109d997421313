"""Child processes whose lifetime their parent owns: executor/mp.py's tensor-parallel ranks and
engine/replica_links.py's data-parallel replicas (multiprocessing, spawn).

A terminal's Ctrl-C (SIGINT to the foreground process group), `kill -TERM -<pgid>` and a service
manager's stop (systemd signals every process of the unit) reach these children together with the
server, whose drain (server/launcher.py) needs them alive to finish or end its in-flight requests. So:
- the child calls `become_owned_child()` first thing: it starts a session of its own (out of the
  terminal's and the process group's reach) and ignores SIGINT and SIGTERM, as multiprocessing's own
  resource tracker does. Only its parent stops it: over its pipe ("shutdown"), or with SIGKILL
  (Process.kill);
- it exits when its parent dies, however it dies (SIGKILL included): a thread waits on the parent's
  sentinel. A pipe's EOF alone misses a child that reads no pipe for a while (loading weights, in a
  step, in a collective that will never complete);
- the parent starts it with `start_owned(proc)`: since SIGTERM no longer stops it, multiprocessing's exit
  function (it terminates the daemon children, then joins them) would wait for ever on one still running
  when its parent exits without stopping it; such children are killed first.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.util
import os
import signal
import threading
import weakref

logger = logging.getLogger("tokenmill")
_owned: weakref.WeakSet = weakref.WeakSet()        # started here with start_owned; may have ended since


def start_owned(proc: multiprocessing.process.BaseProcess) -> None:
    """Starts `proc`, whose target calls become_owned_child() first; kills it at this process's exit if it
    is still running then."""
    proc.start()
    _owned.add(proc)


def _kill_owned_left_running() -> None:
    for proc in list(_owned):
        try:
            if proc.is_alive():
                proc.kill()                       # multiprocessing's exit function joins it next
        except ValueError:                        # closed (Process.close): nothing left to stop
            pass


# multiprocessing's exit function (at interpreter exit, and in a spawned process once its target returns)
# runs the finalizers of priority >= 0 before it terminates and joins the daemon children
multiprocessing.util.Finalize(None, _kill_owned_left_running, exitpriority=10)


def become_owned_child() -> None:
    """In the child, before anything slow: out of reach of the signals meant for the parent's process
    group, and bound to the parent's life. Call from the main thread (signal handlers)."""
    if hasattr(os, "setsid"):
        try:
            os.setsid()
        except OSError:                           # already a group leader: not as multiprocessing starts it
            pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_when_gone, args=(parent,), daemon=True,
                         name="tokenmill-parent-watch").start()


def _exit_when_gone(parent) -> None:
    parent.join()                                 # returns once the parent's end of the sentinel pipe closed
    logger.warning("tokenmill: parent process (pid %s) is gone; process %d exits", parent.pid, os.getpid())
    os._exit(1)
