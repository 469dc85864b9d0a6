"""Processes kvobs starts end with their parent, whatever signal ends the parent.

Why: ``kvobs demo`` starts a ``kvobs serve``; when the demo was ended by anything but Ctrl-C (a
supervisor's SIGTERM, ``timeout``, a test's ``terminate()``, a closed terminal's SIGHUP, SIGKILL)
the sidecar was orphaned and kept the port, and the next demo refused to start. Two mechanisms,
because neither covers every case alone:

* :func:`start_child` (and :func:`run_child`, its ``subprocess.run``) asks the kernel (Linux
  ``prctl(PR_SET_PDEATHSIG, SIGTERM)``, set in the child before it runs anything) to send the child
  SIGTERM when the thread that started it ends, however that happens, SIGKILL included. A parent
  already gone by then is noticed (the child's parent pid is no longer the starter's) and the child
  ends at once.
* :func:`ends_with_signals` turns SIGTERM and SIGHUP into :class:`Stopped` (a ``KeyboardInterrupt``,
  as SIGINT already is), so the parent's ``finally`` blocks run and :func:`stop_child` ends each
  child in order, bounded, also where there is no ``prctl`` (not Linux).

Only the thread that starts a child should be the one that lives as long as the parent (the
main thread): the kernel's death signal follows that thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

PR_SET_PDEATHSIG = 1
STOP_TIMEOUT_S = 10.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """The process was asked to stop by ``signum``; raised where the main thread was."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


def _death_signal_setter() -> Callable[[], None] | None:
    """A function for the child to call between fork and exec; resolved here, in the parent, so the
    child calls one C function and nothing that could allocate or take a lock."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    kill, getppid, getpid = os.kill, os.getppid, os.getpid

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if getppid() != parent:  # the parent ended before the death signal was armed
            kill(getpid(), signal.SIGTERM)

    return in_child


def start_child(args: Sequence[str], **popen: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(args, **popen)`` whose process gets SIGTERM when this thread ends (Linux)."""
    return subprocess.Popen(list(args), preexec_fn=_death_signal_setter(), **popen)


def run_child(args: Sequence[str], *, check: bool = False, timeout: float | None = None,
              **popen: Any) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` through :func:`start_child`: the child ends with this process too, and is
    stopped (:func:`stop_child`) when this returns early, whatever the reason (its timeout, a stop signal)."""
    child = start_child(args, **popen)
    try:
        out, err = child.communicate(timeout=timeout)
    except BaseException:
        stop_child(child)
        raise
    done: subprocess.CompletedProcess[Any] = subprocess.CompletedProcess(list(args), child.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def stop_child(child: subprocess.Popen[Any], timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM, then SIGKILL after ``timeout``: the child is gone (and reaped) when this returns.
    A second stop signal meanwhile waits until then (it would otherwise cut this short)."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                child.kill()
        child.wait()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


@contextlib.contextmanager
def ends_with_signals(once: bool = False) -> Iterator[None]:
    """SIGTERM and SIGHUP raise :class:`Stopped` in the main thread while inside (the previous
    handlers come back after), so the caller's ``finally`` stops its children. ``once``: only the
    first raises, so a second signal cannot cut short the way out it started (``kvobs serve``'s exit
    checkpoint)."""

    def stop(signum: int, frame: FrameType | None) -> None:
        _stop_requested.append(signum)
        if not _deferring and not (once and len(_stop_requested) > 1):
            raise Stopped(signum)

    _stop_requested.clear()
    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_stop_requested: list[int] = []
_deferring: list[bool] = []


@contextlib.contextmanager
def stops_deferred() -> Iterator[None]:
    """Inside :func:`ends_with_signals`: a stop signal that comes in here is acted on when it ends.

    For imports: an exception raised in the middle of importing a C extension leaves that module
    unloadable for the rest of the process (numpy: "cannot load module more than once per process"),
    and a library's ``except ImportError`` around such an import swallows it, so the process went
    on as if never asked (seen: ``kvobs demo`` hung on a SIGHUP while importing vLLM)."""
    _deferring.append(True)
    try:
        yield
    finally:
        _deferring.pop()
    if _stop_requested and not _deferring:
        raise Stopped(_stop_requested[0])
