"""Host envs stepped in a pool of worker processes, concurrently, each call under a timeout.

    pool = HostEnvPool(make_env, num_workers=4, timeout_s=10.0)     # make_env: picklable, e.g. make_host(name)
    starts = pool.reset(row_seeds)          # list[Started | Failure], one per row (fresh env instances)
    steps = pool.step({row: text, ...})     # {row: HostStep | Failure}
    pool.close()

Row r lives in worker r % num_workers; a worker runs its rows one after another, the workers run in
parallel. Workers are started with the "spawn" method (never a fork of a process that has initialised
JAX), import nothing of the trainer, run with ``JAX_PLATFORMS=cpu`` (an env that uses JAX, such as
``TextEnvHost``, must not take the accelerator) and in their own process group (a Ctrl-C or a SIGTERM
sent to the trainer's group reaches the trainer, which closes the pool).

Faults end one episode, never the batch (``Failure.kind``):
  TIMEOUT    the call ran longer than ``timeout_s`` (reset and step alike): the worker is killed;
  EXCEPTION  reset / step raised (or step returned something that is not a ``HostStep``): the worker lives on;
  CRASH      the worker died during the call (os._exit, a segfault, the OOM killer).
A killed or dead worker is replaced at once; the other rows it held are rebuilt in the replacement by
replaying their episode so far (``reset(seed)``, then their past responses, in order), so their
trajectories are those of a fault-free run as long as the env is a function of its seed and the
responses (the HostEnv contract). A row whose replay fails ends with that failure at its next step.

``InProcessEnvs`` is the same interface without processes (``num_workers = 0``): no timeout can stop a
call that hangs there; exceptions are caught unless ``catch=False`` (the host-stepped reference).

(Past 400 lines: the worker loop and the dispatcher speak one message protocol, (op, row, payload) ->
(row, ok, value) per item in order, and are read together.)
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import pickle
import signal
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from envs.host import HostEnv, HostStep

NO_ERROR, TIMEOUT, EXCEPTION, CRASH = 0, 1, 2, 3
ERROR_KINDS = ("none", "timeout", "exception", "crash")  # indexed by the codes above
START_TIMEOUT_S = 120.0  # a worker's start-up: the interpreter, the factory's imports


@dataclasses.dataclass(frozen=True)
class Started:
    """One row after reset: its system message, first user message and response byte cap (or None)."""

    system_text: str
    user_text: str
    max_response_bytes: int | None


@dataclasses.dataclass(frozen=True)
class Failure:
    """A call that did not return: kind is TIMEOUT | EXCEPTION | CRASH; message says what happened."""

    kind: int
    message: str


class EnvBatch(Protocol):
    def reset(self, seeds: Sequence[int]) -> list[Started | Failure]: ...

    def step(self, texts: Mapping[int, str]) -> dict[int, HostStep | Failure]: ...

    def close(self) -> None: ...


def _started(env: HostEnv, seed: int) -> Started:
    user = env.reset(int(seed))
    return Started(env.system_text(), user, getattr(env, "max_response_bytes", None))


def _checked(result: Any) -> HostStep:
    if not isinstance(result, HostStep):
        raise TypeError(f"step returned {type(result).__name__}, not envs.host.HostStep")
    return result


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:500]


class InProcessEnvs:
    """The rows' envs in this process. make_env builds one per row at each reset; ``envs`` (instead)
    are given instances, reset in place (row i = envs[i])."""

    def __init__(self, make_env: Callable[[], HostEnv] | None = None, envs: Sequence[HostEnv] | None = None,
                 catch: bool = True) -> None:
        if (make_env is None) == (envs is None):
            raise ValueError("pass make_env or envs")
        self.make_env, self.given, self.catch = make_env, envs, catch
        self.envs: list[HostEnv] = list(envs or [])

    def _call(self, fn: Callable[[], Any]) -> Any:
        if not self.catch:
            return fn()
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - any env error ends that episode only
            return Failure(EXCEPTION, _describe(e))

    def reset(self, seeds: Sequence[int]) -> list[Started | Failure]:
        if self.given is None:
            self.envs = [self.make_env() for _ in seeds]
        elif len(self.given) < len(seeds):
            raise ValueError(f"{len(seeds)} rows but {len(self.given)} envs")
        return [self._call(lambda e=env, s=seed: _started(e, s)) for env, seed in zip(self.envs, seeds)]

    def step(self, texts: Mapping[int, str]) -> dict[int, HostStep | Failure]:
        return {row: self._call(lambda r=row, t=text: _checked(self.envs[r].step(t))) for row, text in texts.items()}

    def close(self) -> None:
        pass


def make_env_batch(make_env: Callable[[], HostEnv], num_workers: int, timeout_s: float) -> EnvBatch:
    """``InProcessEnvs(make_env)`` for num_workers = 0, else a ``HostEnvPool`` (its workers started)."""
    if num_workers == 0:
        return InProcessEnvs(make_env)
    return HostEnvPool(make_env, num_workers, timeout_s)


def error_counts(host_error: Any, sample_turn: Any) -> dict[str, float]:
    """{"host_errors": episodes ended by a failed env call, "host_errors/<kind>": per kind}; host_error and
    sample_turn int[R] of a Trajectories (a limited-window episode spans T rows: counted at its turn 0)."""
    codes = np.asarray(host_error)[np.asarray(sample_turn) <= 0]
    out = {"host_errors": float((codes != NO_ERROR).sum())}
    out.update({f"host_errors/{kind}": float((codes == code).sum()) for code, kind in enumerate(ERROR_KINDS) if code})
    return out


# ------------------------------------------------------------------------------------------------
# The worker process
# ------------------------------------------------------------------------------------------------
def _exit_with_parent(parent_pid: int) -> None:
    # A worker whose trainer was killed (SIGKILL: no chance to close the pool) must not linger.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


def _worker_main(conn: Connection, factory: bytes, parent_pid: int) -> None:
    """Serve (op, row, payload) batches; reply (row, ok, value) per item, in order, as each finishes."""
    os.environ["JAX_PLATFORMS"] = "cpu"  # before the factory's imports can initialise a JAX backend
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    try:
        make_env = pickle.loads(factory)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("failed", _describe(e)))
        return
    conn.send(("ready", os.getpid()))
    envs: dict[int, HostEnv] = {}
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):
            return
        if batch is None:
            return
        for op, row, payload in batch:
            try:
                if op == "reset":
                    envs[row] = make_env()
                    value: Any = _started(envs[row], payload)
                elif op == "step":
                    value = _checked(envs[row].step(payload))
                else:  # "replay": rebuild a row lost with another worker
                    seed, texts = payload
                    env = make_env()
                    env.reset(int(seed))
                    for text in texts:
                        env.step(text)
                    envs[row], value = env, None
                reply = (row, True, value)
            except BaseException as e:  # noqa: BLE001 - sys.exit in an env is an env error too
                reply = (row, False, _describe(e))
            conn.send(reply)


# ------------------------------------------------------------------------------------------------
# The pool
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Worker:
    process: Any
    conn: Connection
    ready: bool = False


class HostEnvPool:
    """``num_workers`` processes, each owning the envs of rows r with r % num_workers == its index.

    make_env: a picklable zero-argument callable returning a fresh ``HostEnv`` (a module-level class, or
    ``functools.partial`` of one: ``envs.registry.make_host``). timeout_s: the longest one reset or step
    call may run. ``errors`` counts the failures by kind over the pool's life.
    """

    def __init__(self, make_env: Callable[[], HostEnv], num_workers: int, timeout_s: float,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 (0 is InProcessEnvs), got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        try:
            self._factory = pickle.dumps(make_env)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"the host env factory must be picklable to run in worker processes (a module-level "
                             f"class or functools.partial of one, e.g. envs.registry.make_host): {_describe(e)}") from e
        self.num_workers, self.timeout_s, self.start_timeout_s = num_workers, float(timeout_s), start_timeout_s
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: list[_Worker | None] = [None] * num_workers
        self._seeds: dict[int, int] = {}  # row -> seed of its episode
        self._history: dict[int, list[str]] = {}  # row -> responses its env has stepped so far
        self._open: set[int] = set()  # rows whose env is alive and not done (replayed when their worker dies)
        self._lost: dict[int, Failure] = {}  # rows whose replay failed: reported at their next step
        self.errors = {kind: 0 for kind in ERROR_KINDS[1:]}
        self.restarts = 0
        for w in range(num_workers):
            self._spawn(w)
        self._await_ready(range(num_workers), fatal=True)

    # ---------------------------------------------------------------------------------- public API
    def reset(self, seeds: Sequence[int]) -> list[Started | Failure]:
        """Fresh envs for rows 0..len(seeds)-1, reset from their seeds."""
        self._seeds = {row: int(s) for row, s in enumerate(seeds)}
        self._history = {row: [] for row in self._seeds}
        self._open, self._lost = set(), {}
        results = self._run({row: ("reset", seed) for row, seed in self._seeds.items()})
        return [results[row] for row in range(len(seeds))]

    def step(self, texts: Mapping[int, str]) -> dict[int, HostStep | Failure]:
        """Step the envs of the given rows on their response texts."""
        lost = {row: self._lost.pop(row) for row in texts if row in self._lost}
        results = self._run({row: ("step", text) for row, text in texts.items() if row not in lost})
        return {**results, **lost}

    def close(self) -> None:
        """Stop every worker (politely, then by force); the pool cannot be used afterwards."""
        for w, worker in enumerate(self._workers):
            if worker is None:
                continue
            try:
                worker.conn.send(None)
            except (OSError, ValueError):
                pass
            worker.process.join(timeout=2.0)
            self._kill(w)
        self._workers = []

    def __enter__(self) -> "HostEnvPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def worker_pids(self) -> list[int | None]:
        return [None if w is None else w.process.pid for w in self._workers]

    # ---------------------------------------------------------------------------------- processes
    def _spawn(self, w: int) -> None:
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=_worker_main, args=(child, self._factory, os.getpid()),
                                    name=f"host-env-worker-{w}", daemon=True)
        process.start()
        child.close()
        self._workers[w] = _Worker(process, parent)

    def _kill(self, w: int) -> None:
        worker = self._workers[w]
        if worker is None:
            return
        if worker.process.is_alive():
            worker.process.kill()  # a hung env may ignore SIGTERM
        worker.process.join(timeout=5.0)
        worker.conn.close()
        self._workers[w] = None

    def _await_ready(self, indices: Sequence[int], fatal: bool) -> list[int]:
        """Wait for the start-up handshake of the given workers; returns those that did not start (raises
        when ``fatal``: the factory cannot be built in a worker at all)."""
        deadline = time.monotonic() + self.start_timeout_s
        failed = []
        for w in indices:
            worker = self._workers[w]
            if worker is None or worker.ready:
                continue
            message = "did not start in time"
            if worker.conn.poll(max(deadline - time.monotonic(), 0.0)):
                try:
                    tag, value = worker.conn.recv()
                    worker.ready = tag == "ready"
                    message = value
                except (EOFError, OSError):
                    message = "died while starting"
            if not worker.ready:
                self._kill(w)
                failed.append(w)
                if fatal:
                    self.close()
                    raise RuntimeError(f"host env worker {w} failed to start: {message} (a worker imports the env "
                                       "class by name: a module-level class on sys.path; a script that starts "
                                       "a pool needs the if __name__ == '__main__': guard)")
        return failed

    def _replace(self, w: int) -> None:
        self._kill(w)
        self.restarts += 1
        self._spawn(w)

    # ---------------------------------------------------------------------------------- dispatch
    def _fail(self, results: dict, pending: dict, row: int, failure: Failure) -> None:
        if isinstance(results.get(row), Failure):
            return  # already failed in this call (its replay), its own item then failed too
        self.errors[ERROR_KINDS[failure.kind]] += 1
        self._open.discard(row)
        if row in pending:
            pending.pop(row)
            results[row] = failure
        else:  # a row that had already answered this call, lost in a replay
            self._lost[row] = failure

    def _answered(self, results: dict, pending: dict, op: str, row: int, payload: Any, value: Any) -> None:
        """Book an item that returned: the rows with a live env, the responses each env has stepped."""
        if op == "replay":
            return
        if row not in pending:
            return  # its replay failed first: the reply of an env that does not exist
        pending.pop(row)
        results[row] = value
        if op == "reset":
            self._open.add(row)
        else:
            self._history[row].append(payload)
            if value.done:
                self._open.discard(row)

    def _run(self, items: dict[int, tuple[str, Any]]) -> dict[int, Any]:
        """Run every item (op, payload) of its row; returns {row: value | Failure}. Each round sends every
        worker its pending rows (after replaying the open rows of a replaced worker), then collects the
        replies until all arrived or a worker failed; the rows a failed worker had not run go to the next
        round, in its replacement. Every failure ends one row, so the rounds end."""
        results: dict[int, Any] = {}
        pending = dict(items)
        needs_replay: set[int] = set()
        while pending or needs_replay:
            by_worker: dict[int, list[tuple[str, int, Any]]] = {w: [] for w in needs_replay}
            for row in sorted(pending):
                by_worker.setdefault(row % self.num_workers, []).append((pending[row][0], row, pending[row][1]))
            for w in by_worker:
                if self._workers[w] is None:
                    self._spawn(w)
            for w in self._await_ready(sorted(by_worker), fatal=False):
                needs_replay.discard(w)
                for row in [r for r in self._open if r % self.num_workers == w] + [r for _, r, _ in by_worker.pop(w)]:
                    self._fail(results, pending, row, Failure(CRASH, "the replacement worker failed to start"))
            queues: dict[int, list[tuple[str, int, Any, float]]] = {}
            for w, batch in by_worker.items():
                if w in needs_replay:
                    batch = [("replay", row, (self._seeds[row], list(self._history[row])))
                             for row in sorted(self._open) if row % self.num_workers == w] + batch
                    needs_replay.discard(w)
                if not batch:
                    continue
                self._workers[w].conn.send(batch)
                queues[w] = [(op, row, payload, self.timeout_s * (1 + (len(payload[1]) if op == "replay" else 0)))
                             for op, row, payload in batch]
            needs_replay |= self._collect(queues, results, pending)
        return results

    def _collect(self, queues: dict[int, list[tuple[str, int, Any, float]]], results: dict, pending: dict) -> set[int]:
        """Read replies until every queue is empty; returns the workers that failed (replaced already)."""
        started = {w: time.monotonic() for w in queues}  # when each worker began its current item
        failed: set[int] = set()
        while any(queues.values()):
            live = {self._workers[w].conn: w for w, q in queues.items() if q}
            deadline = min(started[w] + queues[w][0][3] for w in live.values())
            for conn in wait(list(live), timeout=max(deadline - time.monotonic(), 0.0)):
                w = live[conn]
                op, row, payload, _ = queues[w][0]
                try:
                    reply_row, ok, value = conn.recv()
                except (EOFError, OSError):
                    process = self._workers[w].process
                    process.join(timeout=1.0)
                    self._fail(results, pending, row,
                               Failure(CRASH, f"the worker died during {op} (exit code {process.exitcode})"))
                    queues[w] = []
                    failed.add(w)
                    continue
                assert reply_row == row, (reply_row, row)
                queues[w].pop(0)
                started[w] = time.monotonic()
                if ok:
                    self._answered(results, pending, op, row, payload, value)
                else:
                    self._fail(results, pending, row, Failure(EXCEPTION, value))
            now = time.monotonic()
            for w, q in queues.items():
                if q and now > started[w] + q[0][3]:
                    op, row, _, limit = q[0]
                    self._fail(results, pending, row, Failure(TIMEOUT, f"{op} ran longer than {limit:g} s"))
                    queues[w] = []
                    failed.add(w)
        for w in failed:
            self._replace(w)
        return failed
