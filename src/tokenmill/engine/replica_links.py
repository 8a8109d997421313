"""How a data-parallel replica runs and talks to the front (engine/replicas.py): in a process of its own
over a pipe (PipeLink), or as a Ray actor (RayLink). Either way the replica side is serve_replica: an
EngineCore stepping while it has work, taking commands between steps, and sending after every step the
compact updates of the requests that changed; the front side is a link whose relay thread puts every
message, and finally DEAD with the reason, on the front's inbox (one queue for all replicas). Sending a
replica a command never blocks the front (PipeLink: a sender thread per replica, in order; Ray: submit).
A replica applies its commands in the order the front sent them (a pipe keeps it; a threaded Ray actor
does not, so RayLink numbers them and the actor puts them back in order: InOrder).

Messages from a replica: ("ready", (num_blocks, weight_bytes, step model)) once, or ("error", why); then
("updates", (updates, load, stats, step model or None)) per step; and (DEAD, why) last if serving failed
(an exception in its core: the front fails its requests with `why`; the replica serves no more). To a
replica: ("add", Request, serial), ("abort", ids, reason, stop_reason), ("shutdown",). Each update echoes
the serial of the add of its request (ReplicaUpdate.serial), so the front can tell a request from a later
one that reuses its id."""
from __future__ import annotations

import logging
import queue
import threading

import torch

logger = logging.getLogger("tokenmill")
DEAD = "dead"
_STOP_SENDING = object()                                  # a PipeLink sender thread's last item


def build_replica_core(index: int, config, threads: int):
    torch.set_num_threads(threads)
    from tokenmill.engine.calibration import seed_step_model
    from tokenmill.engine.engine_core import EngineCore
    from tokenmill.loaders import open_model_source
    core = EngineCore(config, open_model_source(config.model_path).iter_weights())
    if core.scheduler.policy.needs_step_model or core.draft_length is not None:
        seed_step_model(core)
    return core


def ready_message(core) -> tuple:
    return "ready", (core.config.cache.num_blocks, core.executor.weight_bytes(), core.step_model.describe())


def serve_replica(core, recv, poll, send) -> None:
    """recv() -> the next command (blocking), poll() -> whether one is queued, send(message)."""
    from tokenmill.engine.replicas import replica_load
    serials: dict[str, int] = {}          # request id -> its add's serial, while the core holds the request
    steps = 0
    while True:
        if not core.has_unfinished() or poll():
            while True:                                   # every queued command, then step
                command, *args = recv()
                if command == "shutdown":
                    return
                apply_command(core, serials, command, args)
                if not poll():
                    break
        if core.has_unfinished():
            updates = core.step()
            steps += 1
            model = core.step_model.describe() if steps % 64 == 1 else None     # its refit costs: now and then
            send(("updates", (compact_updates(updates, serials), replica_load(core), core.stats(), model)))


def apply_command(core, serials: dict[str, int], command: str, args: list) -> None:
    """An add or an abort, applied to the core; `serials` follows the requests the core holds."""
    if command == "add":
        request, serial = args
        core.add_request(request)
        serials[request.request_id] = serial
    elif command == "abort":
        core.abort(*args)
        for rid in args[0]:                               # (the front sends a list of ids)
            serials.pop(rid, None)


def compact_updates(updates, serials: dict[str, int]) -> list:
    """The step's updates as ReplicaUpdates, each with its request's serial; a finished one's is forgotten. An
    update of a request without a serial is dropped, never fatal: the front has aborted that request (the abort
    popped its serial) and forgotten it, so nothing waits for it. (Seen once in a full test run: replica 1 died
    of a KeyError here after the front aborted the requests of a generate that had failed on replica 0; the
    way an aborted request still reached a step was not found.)"""
    from tokenmill.engine.replicas import compact_update
    out = []
    for u in updates:
        rid = u.request.request_id
        serial = serials.pop(rid, None) if u.request.is_finished else serials.get(rid)
        if serial is not None:
            out.append(compact_update(u, serial))
    return out


def serve_or_report(core, recv, poll, send) -> None:
    """serve_replica; if it raises, (DEAD, the error) is the replica's last message (when the front is
    gone, sending it fails too: nothing more to do)."""
    try:
        serve_replica(core, recv, poll, send)
    except Exception as e:  # noqa: BLE001 - the replica's end, told to the front, which fails its requests
        if not isinstance(e, (EOFError, ConnectionError)):      # not merely the front gone
            logger.exception("tokenmill: a data-parallel replica stops serving")
        try:
            send((DEAD, f"failed: {type(e).__name__}: {e}"))
        except (OSError, ValueError):
            pass


def replica_main(index: int, config, threads: int, conn) -> None:
    """A replica's process (PipeLink)."""
    from tokenmill.executor.owned_process import become_owned_child
    become_owned_child()                                  # its front alone stops it: no terminal/group signal
    try:
        core = build_replica_core(index, config, threads)
    except BaseException as e:  # noqa: BLE001 - reported to the front, which fails start-up with it
        conn.send(("error", f"replica {index} could not start: {type(e).__name__}: {e}"))
        return
    conn.send(ready_message(core))
    try:
        serve_or_report(core, conn.recv, conn.poll, conn.send)
    finally:
        core.shutdown()                                   # its tensor-parallel workers, if any


class PipeLink:
    """A replica in a process of its own (multiprocessing spawn), over a pipe."""

    def __init__(self, index: int, config, threads: int, inbox: queue.Queue) -> None:
        import multiprocessing
        from tokenmill.executor.owned_process import start_owned
        ctx = multiprocessing.get_context("spawn")
        self.index, self.inbox = index, inbox
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=replica_main, args=(index, config, threads, child), daemon=True,
                                name=f"tokenmill-replica{index}")
        start_owned(self.proc)                            # it ignores SIGTERM: killed at our exit if left running
        child.close()
        self.pid = self.proc.pid
        # commands go out on a thread of their own: a replica reads its pipe only between its steps, and
        # one that is hung or in a long step must not block the front once the pipe's buffer is full
        self.outbox: queue.Queue = queue.Queue()          # commands in order, then _STOP_SENDING
        self.sender = threading.Thread(target=self._send_in_order, daemon=True,
                                       name=f"tokenmill-replica{index}-sender")
        self.sender.start()

    def wait_ready(self, timeout_s: float):
        """The ready message's payload; raises RuntimeError with the replica's reason if it did not start."""
        import time
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.2):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"replica {self.index} died or hung while starting")
        kind, value = self.conn.recv()
        if kind != "ready":
            raise RuntimeError(value)
        threading.Thread(target=self._relay, daemon=True, name=f"tokenmill-replica{self.index}-relay").start()
        return value

    def _relay(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                self.proc.join(1.0)
                code = self.proc.exitcode
                self.inbox.put((self.index, (DEAD, f"(pid {self.pid}) died" +
                                             (f" with exit code {code}" if code is not None else ""))))
                return
            self.inbox.put((self.index, message))
            if message[0] == DEAD:                        # its last: the process ends by itself
                return

    def send(self, message) -> None:
        """Queues the command for the sender thread; never blocks."""
        self.outbox.put(message)

    def _send_in_order(self) -> None:
        """Sends the queued commands in order until _STOP_SENDING. Once a send fails the link is broken:
        the rest are dropped and the replica is dead to the front (a closed pipe: the relay reports the
        death; any other error: reported here, and the process killed)."""
        broken = False
        while (message := self.outbox.get()) is not _STOP_SENDING:
            if broken:
                continue
            try:
                self.conn.send(message)
            except OSError:                               # the process is gone: the relay reports it
                broken = True
            except Exception as e:  # noqa: BLE001 - e.g. an unpicklable command: the replica misses it
                broken = True
                self.inbox.put((self.index, (DEAD, f"(pid {self.pid}) could not be sent a command: "
                                                   f"{type(e).__name__}: {e}")))
                self.proc.kill()

    def stop(self) -> None:
        if self.proc.is_alive():
            self.send(("shutdown",))
        self.proc.join(5.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(1.0)
        self.outbox.put(_STOP_SENDING)                    # after the process ended: no send blocks now
        if threading.current_thread() is not self.sender:  # (a finalizer may run on any thread, this one too)
            self.sender.join(5.0)
        self.conn.close()

    def kill(self) -> None:
        self.proc.kill()


class InOrder:
    """Hands on numbered items strictly in their numbers' order 0, 1, 2, ... whatever order put() gets them
    in: a threaded Ray actor (max_concurrency > 1) runs one caller's calls concurrently, so the submit of
    an abort may run before the submit of the add it aborts. An item waits here until every lower number
    has been handed on. Thread-safe; `deliver` is called under the lock, so deliveries never overlap."""

    def __init__(self, deliver) -> None:
        self.deliver = deliver
        self.next_seq = 0                                 # the number handed on next
        self.early: dict[int, object] = {}                # items put before their turn, by number
        self.lock = threading.Lock()

    def put(self, seq: int, item) -> None:
        with self.lock:
            if seq < self.next_seq or seq in self.early:
                raise ValueError(f"item number {seq} was put twice")
            self.early[seq] = item
            while self.next_seq in self.early:
                self.deliver(self.early.pop(self.next_seq))
                self.next_seq += 1


def _first_line(e: BaseException) -> str:
    """The exception's type and the first line of its message (Ray's run to many lines)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _replica_actor():
    import ray
    from tokenmill.platforms.host_threads import release_thread_pool

    @ray.remote(max_restarts=0, max_concurrency=4)
    class RayReplica:
        """serve_replica in a thread of the actor; submit() and collect() are the pipe's two ends. Calls run
        on several threads, in any order: submit() takes each command with its number (RayLink.send)."""

        def __init__(self, index: int, config, threads: int) -> None:
            self.commands, self.messages = queue.Queue(), queue.Queue()
            self.in_order = InOrder(self.commands.put)    # the commands as the front sent them
            self.core = build_replica_core(index, config, threads)
            release_thread_pool()            # serve_replica steps on another thread (host_threads.py)
            threading.Thread(target=serve_or_report, daemon=True,
                             args=(self.core, self.commands.get, lambda: not self.commands.empty(),
                                   self.messages.put)).start()

        def ready(self):
            return ready_message(self.core)[1]

        def submit(self, seq: int, message) -> None:
            self.in_order.put(seq, message)

        def collect(self, timeout_s: float) -> list:
            try:
                out = [self.messages.get(timeout=timeout_s)]
            except queue.Empty:
                return []
            while not self.messages.empty():
                out.append(self.messages.get_nowait())
            return out

    return RayReplica


class RayLink:
    """A replica as a Ray actor (one CPU per thread, or a GPU), its messages relayed by a polling thread."""

    def __init__(self, index: int, config, threads: int, inbox: queue.Queue, cuda: bool) -> None:
        self.index, self.inbox = index, inbox
        options = dict(num_gpus=1, num_cpus=0) if cuda else dict(num_cpus=threads)
        self.actor = _replica_actor().options(**options).remote(index, config, threads)
        self.pid = None
        self._stopped = False
        self._next_seq = 0                                # the next command's number (InOrder, on the actor)
        self._send_lock = threading.Lock()

    def wait_ready(self, timeout_s: float):
        import ray
        try:
            value = ray.get(self.actor.ready.remote(), timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - the actor's construction failed or timed out
            raise RuntimeError(f"replica {self.index} could not start: {getattr(e, 'cause', None) or e}") from None
        threading.Thread(target=self._relay, daemon=True, name=f"tokenmill-replica{self.index}-relay").start()
        return value

    def _relay(self) -> None:
        import ray
        while not self._stopped:
            try:
                messages = ray.get(self.actor.collect.remote(0.2))
            except Exception as e:  # noqa: BLE001 - RayActorError and the like: the replica is gone
                if not self._stopped:
                    self.inbox.put((self.index, (DEAD, f"(a Ray actor) died: {_first_line(e)}")))
                return
            for message in messages:
                self.inbox.put((self.index, message))
                if message[0] == DEAD:                    # its serving thread ended: the actor only holds resources
                    self.stop()
                    return

    def send(self, message) -> None:
        """Submits the command with the next number; the actor applies the commands in number order. One
        that Ray cannot submit (cannot serialize) raises here and takes no number: no later one waits on it."""
        with self._send_lock:
            self.actor.submit.remote(self._next_seq, message)
            self._next_seq += 1

    def stop(self) -> None:
        import ray
        self._stopped = True
        try:
            ray.kill(self.actor)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def kill(self) -> None:
        import ray
        try:
            ray.kill(self.actor)
        except Exception:  # noqa: BLE001 - already gone
            pass
