"""What the fault tests share: nothing left behind (children, socket dirs, /dev/shm entries), and
a guard that turns a hang of the code under test into a failure."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Callable, Iterator

import psutil

CLEANUP_S = 10.0  # how long children may take to notice that their parent is gone
GUARD_S = 120  # turns a hang of the code under test into a failure instead of a stuck suite


def alive(proc: psutil.Process) -> bool:
    """A zombie has released everything; only a running process counts."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for(cond: Callable[[], bool], timeout_s: float = CLEANUP_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def shm_entries() -> set[str]:
    """/dev/shm's entries, less multiprocessing's semaphores (`sem.mp-*`): nothing here makes them,
    and other programs on a shared machine come and go with theirs; and less l3worker's folders
    (`l3worker-<kind>-<pid>-*`) of a live process outside this one's tree: another pytest-xdist
    worker's, which comes and goes with its own tests."""
    if not os.path.isdir("/dev/shm"):
        return set()
    return {name for name in os.listdir("/dev/shm") if not name.startswith("sem.mp-") and not _elsewhere(name)}


def _elsewhere(name: str) -> bool:
    m = re.match(r"l3worker-[a-z]+-(\d+)-", name)
    if m is None:
        return False
    try:
        owner = psutil.Process(int(m[1]))
        mine = owner.pid == os.getpid() or any(p.pid == os.getpid() for p in owner.parents())
        return owner.is_running() and not mine and owner.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def assert_nothing_left(children: list[psutil.Process], socket_dir: str, shm_before: set[str]) -> None:
    """Polls up to CLEANUP_S for the children to exit and their socket dir and shm entries to go."""
    assert children, "no child processes were recorded"
    assert wait_for(lambda: not any(alive(p) for p in children)), \
        f"chip-children still running: {[p.pid for p in children if alive(p)]}"
    assert wait_for(lambda: not os.path.exists(socket_dir)), \
        f"socket dir left behind: {socket_dir} holding {os.listdir(socket_dir) if os.path.isdir(socket_dir) else '?'}"
    assert wait_for(lambda: not (shm_entries() - shm_before)), f"new /dev/shm entries: {sorted(shm_entries() - shm_before)}"


@contextlib.contextmanager
def guard(seconds: int = GUARD_S) -> Iterator[None]:
    """Raises TimeoutError in the main thread if the block runs longer than `seconds`."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
