"""Stopping a throwaway server the tests started: its process groups and every descendant.

:func:`stop_tree` signals each root's process group (SIGTERM), waits, polling and bounded, only
until nothing is left but processes whose graceful exit is not worth waiting for (the server's
own: its state is thrown away with its folder), then SIGKILLs whatever remains (a process forked
meanwhile included) and fails if anything survives.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable

import psutil


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _with_descendants(procs: Iterable[psutil.Process], groups: set[int]) -> list[psutil.Process]:
    """``procs`` still alive, the members of the process ``groups`` and all their descendants."""
    found = {p.pid: p for p in procs if _alive(p)}
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) in groups:
                found.setdefault(proc.pid, proc)
        except OSError:
            continue
    for proc in list(found.values()):
        try:
            for child in proc.children(recursive=True):
                if child.pid != os.getpid():
                    found.setdefault(child.pid, child)
        except psutil.Error:
            continue
    return [p for p in found.values() if _alive(p)]


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> None:
    """Poll until none of ``procs`` runs (a zombie counts as gone), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())[:120]}"
    except psutil.Error:
        return str(proc.pid)


def stop_tree(roots: Iterable[subprocess.Popen], grace_s: float = 15.0,
              no_grace: Callable[[psutil.Process], bool] = lambda p: False) -> None:
    """Stop ``roots`` (each started with ``start_new_session=True``) and all their descendants.

    SIGTERM goes to each root's process group; this then polls until every process left is one
    ``no_grace`` names (or ``grace_s`` passed), SIGKILLs the groups and every process still
    there, reaps the roots and raises AssertionError naming any process that survives.
    """
    roots = [r for r in roots if r is not None]
    groups = {r.pid for r in roots}  # a root that exited may have left its group behind
    tree = _with_descendants([], groups)
    for group in groups:
        try:
            os.killpg(group, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while True:
        tree = _with_descendants(tree, groups)
        if all(_safe(no_grace, p) for p in tree) or time.monotonic() >= deadline:
            break
        time.sleep(0.05)  # the poll's interval
    for _ in range(3):  # a process forked while we kill gets the same treatment
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in tree:
            try:
                proc.kill()
            except psutil.Error:
                pass
        _wait_gone(tree, timeout_s=10)
        tree = _with_descendants(tree, groups)
        if not tree:
            break
    for root in roots:
        try:
            root.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    assert not tree, "processes left after stopping: " + "; ".join(map(_describe, tree))


def _safe(predicate: Callable[[psutil.Process], bool], proc: psutil.Process) -> bool:
    try:
        return bool(predicate(proc))
    except psutil.Error:
        return True  # gone meanwhile
