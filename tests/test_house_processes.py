"""A test ends only the processes it started (docs/testing.md, "Processes a test may end").

The checker reads every Python file under tests/ and fails on a sweep by command line: a
``pkill``/``killall`` (or ``pgrep | xargs kill``) command, or a function that lists the machine's
processes (``psutil.process_iter``, ``psutil.pids``, ``/proc``) and ends those whose command
line matches only fixed text, such as a module name every trainer on the machine shares. A
selection is anchored, and allowed, when its match names something the test made (a job folder,
a temporary path, a key: any value that is not a constant).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# pkill or killall where a shell runs a command; pgrep's pids handed to kill.
SWEEP_COMMAND = re.compile(r"(?:^|[;&|(`]\s*|\b(?:sudo|exec|xargs)\s+)(?:pkill|killall)\b"
                           r"|\bpgrep\b.*\|\s*xargs\s+kill\b|\bkill\b[^\n]*\$\(\s*pgrep\b")
PROC_LISTING = re.compile(r"^/proc/?(?:\*.*)?$")  # "/proc", "/proc/*/cmdline"; not one pid's
ENUMERATORS = {"process_iter", "pids"}  # psutil's: every process of the machine
KILLS = {"kill", "killpg", "terminate", "send_signal"}
MATCHERS = {"search", "match", "fullmatch", "startswith", "endswith", "find", "index"}


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _lists_all(node: ast.AST) -> bool:
    """``node`` is a call that lists every process: ``process_iter()``, ``psutil.pids()``."""
    if not isinstance(node, ast.Call) or _name(node.func) not in ENUMERATORS:
        return False
    owner = getattr(node.func, "value", None)
    return _name(node.func) == "process_iter" or getattr(owner, "id", "psutil") == "psutil"


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}


def _constants(tree: ast.Module) -> set[str]:
    """Module-level names bound to fixed text (strings, tuples of them, compiled patterns)."""
    fixed = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and not any(
                isinstance(n, ast.Name) and n.id not in ("re", "compile")
                for n in ast.walk(node.value)):
            fixed |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return fixed


class _Function:
    """One function's process handling: does it list the machine's processes, end processes,
    and select by command line without an anchor?"""

    def __init__(self, fn: ast.AST, constants: set[str]):
        self.fn, self.constants = fn, constants
        self.calls = {_name(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)}
        in_fstring = {id(v) for n in ast.walk(fn) if isinstance(n, ast.JoinedStr) for v in n.values}
        self.lists = any(_lists_all(n) for n in ast.walk(fn)) or any(
            isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in in_fstring
            and PROC_LISTING.match(n.value) for n in ast.walk(fn))
        self.kills = bool(self.calls & KILLS)
        self.derived: set[str] = set()
        for _ in range(3):  # names bound from a command line, and from those
            for node in ast.walk(fn):
                for target, value in self._bindings(node):
                    if self._mentions(value):
                        self.derived |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}

    @staticmethod
    def _bindings(node: ast.AST):
        if isinstance(node, ast.Assign):
            return [(t, node.value) for t in node.targets]
        if isinstance(node, (ast.For, ast.comprehension)):
            return [(node.target, node.iter)]
        if isinstance(node, ast.NamedExpr):
            return [(node.target, node.value)]
        return []

    def _mentions(self, expr: ast.AST) -> bool:
        if _lists_all(expr):
            return False  # the listing itself, not a process's command line
        return "cmdline" in ast.unparse(expr) or any(
            isinstance(n, ast.Name) and n.id in self.derived for n in ast.walk(expr))

    def _made_here(self, expr: ast.AST) -> bool:
        """``expr`` holds a value the test made, not only fixed text."""
        called = {id(n.func) for n in ast.walk(expr) if isinstance(n, ast.Call)}
        return any(isinstance(n, ast.Name) and id(n) not in called and n.id not in self.constants
                   and n.id not in self.derived for n in ast.walk(expr))

    def _test(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            return self._mentions(node.comparators[0])
        return (isinstance(node, ast.Call) and _name(node.func) in MATCHERS
                and any(self._mentions(a) for a in [*node.args, getattr(node.func, "value", node)]))

    def _has_test(self, expr: ast.AST) -> bool:
        return any(self._test(n) for n in ast.walk(expr))

    def anchored(self, expr: ast.AST) -> bool:
        """A condition that selects by command line only together with a value made here."""
        if isinstance(expr, ast.Compare) and self._test(expr):
            return isinstance(expr.ops[0], ast.In) and self._made_here(expr.left)
        if isinstance(expr, ast.Call) and self._test(expr):
            pattern = [expr.func.value] if _name(expr.func) in ("search", "match", "fullmatch") \
                else expr.args
            return any(self._made_here(p) and not self._mentions(p) for p in pattern)
        if isinstance(expr, ast.BoolOp):
            parts = [self.anchored(v) for v in expr.values if self._has_test(v)]
            return any(parts) if isinstance(expr.op, ast.And) else all(parts)
        if isinstance(expr, ast.Call) and _name(expr.func) in ("any", "all") and expr.args \
                and isinstance(expr.args[0], ast.GeneratorExp):
            gen = expr.args[0]
            return self.anchored(gen.elt) or any(self.anchored(c) for g in gen.generators
                                                 for c in g.ifs if self._has_test(c))
        return False

    def unanchored(self) -> list[ast.AST]:
        conditions = []
        for node in ast.walk(self.fn):
            if isinstance(node, (ast.If, ast.IfExp, ast.While)):
                conditions.append(node.test)
            elif isinstance(node, ast.comprehension):
                conditions += node.ifs
        return [c for c in conditions if self._has_test(c) and not self.anchored(c)]


def sweeps(source: str) -> list[str]:
    """Each place in ``source`` that ends processes chosen machine-wide by command line, as
    ``line N: what``; empty when there is none."""
    tree = ast.parse(source)
    found = []
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docstrings
                and (node.value in ("pkill", "killall") or SWEEP_COMMAND.search(node.value))):
            found.append(f"line {node.lineno}: runs {node.value[:80]!r}")
    constants = _constants(tree)
    functions = {n.name: _Function(n, constants) for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for name, fn in functions.items():
        loose = fn.unanchored() if fn.lists else []
        if not loose:
            continue
        ended_by = [name] if fn.kills else [
            other for other, g in functions.items() if g.kills and name in g.calls]
        if ended_by:
            found += [f"line {c.lineno}: {name}() lists every process and selects by "
                      f"`{ast.unparse(c)[:80]}`, ended in {', '.join(ended_by)}()" for c in loose]
    return sorted(set(found), key=lambda f: int(f.split(":")[0].split()[1]))


def _test_sources() -> list[Path]:
    return sorted(p for p in (ROOT / "tests").rglob("*.py") if p != Path(__file__).resolve())


def test_no_test_ends_processes_it_did_not_start():
    found = [f"{path.relative_to(ROOT)} {hit}" for path in _test_sources()
             for hit in sweeps(path.read_text(encoding="utf-8"))]
    assert not found, ("end only what the test started: select by the process group, session "
                       "or job folder it created (tests/proctree.py)\n" + "\n".join(found))


PLANTED = {
    "pkill by pattern": 'import subprocess\nsubprocess.run(["pkill", "-f", "trainer.train"])\n',
    "killall in a shell line": 'import os\nos.system("sleep 1; killall python")\n',
    "pgrep into kill": 'import os\nos.system("pgrep -f train | xargs kill -9")\n',
    "process_iter killed by module name": '''
import psutil
def stop_trainers():
    for proc in psutil.process_iter(["cmdline"]):
        if "trainforge.trainer.train" in " ".join(proc.info["cmdline"] or []):
            proc.kill()
''',
    "a listing helper whose caller kills": '''
import os, signal, psutil
TRAINER = "trainforge.trainer.train"
def trainers():
    return [p.pid for p in psutil.process_iter() if any(TRAINER in c for c in p.cmdline())]
def test_x():
    for pid in trainers():
        os.kill(pid, signal.SIGKILL)
''',
    "/proc read by pattern": '''
import os, re
JOB = re.compile(r"trainer[.]train")
def stop():
    for pid in os.listdir("/proc"):
        cmdline = open(f"/proc/{pid}/cmdline").read()
        if JOB.search(cmdline):
            os.kill(int(pid), 9)
''',
    "psutil.pids by pattern": '''
import os, psutil
def stop():
    for pid in psutil.pids():
        if "trainer.train" in " ".join(psutil.Process(pid).cmdline()):
            os.kill(pid, 9)
''',
    "an exclusion alone": '''
import psutil
def stop():
    for p in psutil.process_iter():
        if "pytest" not in " ".join(p.cmdline()):
            p.terminate()
''',
}

ALLOWED = {
    "by its job folder": '''
import psutil
def stop(job_dir):
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "trainforge.trainer.train" in cmdline and str(job_dir) in cmdline:
            proc.kill()
''',
    "by its process group": '''
import os, psutil
def stop(group):
    for proc in psutil.process_iter():
        if os.getpgid(proc.pid) == group:
            proc.kill()
''',
    "among the hosts it started": '''
import os
def stop(hosts):
    for pid in hosts.pids(0):
        if "trainer.train" in open(f"/proc/{pid}/cmdline").read():
            os.kill(pid, 9)
''',
    "looking without ending": '''
import psutil
def trainers():
    return [p for p in psutil.process_iter() if "trainer.train" in " ".join(p.cmdline())]
''',
    "a docstring that names the rule": '''
def stop(popen):
    """Never pkill -f: ends only its own child."""
    popen.kill()
''',
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_the_checker_finds_a_planted_sweep(case):
    assert sweeps(PLANTED[case]), case


@pytest.mark.parametrize("case", sorted(ALLOWED))
def test_the_checker_allows_a_selection_by_what_the_test_made(case):
    assert sweeps(ALLOWED[case]) == []
