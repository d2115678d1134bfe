"""One torchrun per Ray node: the entrypoint of a ``ray`` job with ``resources.nodes`` > 1.

Runs on the cluster (the node Ray picks for the job's entrypoint), as rendered by
:func:`trainforge.engines.ray.render.entrypoint`:

1. a ``STRICT_SPREAD`` placement group of ``--nodes`` bundles (one per Ray node), waited for
   within ``--startup-timeout-s``, else the job fails (transient) saying what the cluster has;
2. a probe task in bundle 0 picks the c10d rendezvous endpoint on that node;
3. one task per bundle runs the node's preflight (:mod:`trainforge.engines.node_preflight`)
   and then torchrun, with its own job folder and ``--local-addr``; every node's console goes
   to the job log;
4. once every node has ended, rank 0's result is printed as the ``TRAINFORGE_RESULT {...}``
   line and the launcher exits with the failing node's torchrun code (0 when all succeeded);
   when one node fails the others are cancelled at once.

Stopping the job (``ray job stop``: SIGTERM to this process) cancels every node task, each of
which stops its torchrun (SIGTERM, SIGKILL after a grace period); torchrun is also started with
``PR_SET_PDEATHSIG`` so that it gets SIGTERM if its Ray worker is killed outright. The command
line and every step in full: docs/ray.md, "Several nodes".

Imports only the job contract of trainforge (and, on the nodes, its node preflight); ``ray`` is
imported in :func:`main`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from trainforge.contract import EXIT_ERROR, RESULT_FILE_ENV, STATUS_ERROR
from trainforge.engines.ray import node_tasks, procs
from trainforge.engines.ray.node_loss import describe, lost_node

MODULE = "trainforge.engines.ray.launcher"
CONFIG_ENV = "TRAINFORGE_JOB_CONFIG"
RESULT_MARKER = "TRAINFORGE_RESULT "
# Placeholders of the torchrun command, filled in on each node.
JOB_DIR = "{job_dir}"
RDZV_ENDPOINT = "{rdzv_endpoint}"
LOCAL_ADDR = "{local_addr}"
IS_HOST = "{is_host}"

PENDING_REPORT_S = 30.0
"""How often the wait for the placement group says what it waits for, seconds."""
CANCEL_WAIT_S = 60.0
"""How long the other nodes get to stop after one failed, before their workers are killed."""
LOG_FLUSH_S = 2.0
"""Ray's log monitor forwards worker output about once a second: wait this long after the last
node ended so that its last lines reach the job log."""
PEER_END_S = 5.0
"""After a node failed, how long the others may take to end on their own before they are cancelled."""


def bundle(cpus: float, gpus: float, memory_bytes: int | None) -> dict[str, float]:
    """One node's share of the placement group (Ray resource names: ``CPU``, ``GPU``,
    ``memory`` in bytes)."""
    out = {"CPU": float(cpus)}
    if gpus:
        out["GPU"] = float(gpus)
    if memory_bytes:
        out["memory"] = float(memory_bytes)
    return out


def fill(argv: Sequence[str], values: dict[str, str]) -> list[str]:
    """``argv`` with each placeholder (:data:`JOB_DIR`, ...) replaced by its value."""
    out = []
    for arg in argv:
        for name, value in values.items():
            arg = arg.replace(name, value)
        out.append(arg)
    return out


def _say(line: str) -> None:
    print(f"trainforge: {line}", flush=True)


def _free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def node_marker(key: str) -> str:
    """What every process of job ``key`` on a node has on its command line (procs.py)."""
    return f"trainforge-{key}.node-"


def host_port(address: str, port: int) -> str:
    """An endpoint as torchrun reads it: an IPv6 address in brackets (``[fd00::10]:29500``)."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def probe(with_port: bool) -> dict[str, Any]:
    """Ray task: this node's address and name, and a free port on it when ``with_port``."""
    import ray

    address = ray.util.get_node_ip_address()
    return {"address": address, "host": socket.gethostname(),
            "port": _free_port(address) if with_port else None}


def run_node(node: int, nodes: int, key: str, config: str, argv: list[str],
             endpoint: str, deadline_epoch_s: float | None = None) -> dict[str, Any]:
    """Ray task: node ``node``'s preflight (:mod:`trainforge.engines.node_preflight`: socket
    interface, rendezvous reachable by ``deadline_epoch_s``, else exit 78 with a ``bad_config``
    result), then its torchrun, to its end; returns ``{"node", "address", "host", "exit_code",
    "result", "job_dir"}`` (``result``: the result file's JSON if rank 0 ran here)."""
    import ray

    from trainforge.engines import node_preflight

    address = ray.util.get_node_ip_address()
    job_dir = tempfile.mkdtemp(prefix=f"{node_marker(key)}{node}.")
    os.makedirs(os.path.join(job_dir, "ranks"), exist_ok=True)
    with open(os.path.join(job_dir, "job.json"), "w", encoding="utf-8") as out:
        out.write(config)
    result_file = os.path.join(job_dir, "result.json")
    command = fill(argv, {JOB_DIR: job_dir, RDZV_ENDPOINT: endpoint, LOCAL_ADDR: address,
                          IS_HOST: "true" if node == 0 else "false"})
    console = os.path.join(job_dir, "ranks", f"node-{node}.log")
    where = f"{node} of {nodes} on {socket.gethostname()} ({address})"
    _say(f"node {where}: job folder {job_dir}, console {console}")
    timeout_s = (node_preflight.DEFAULT_TIMEOUT_S if deadline_epoch_s is None
                 else max(1.0, deadline_epoch_s - time.time()))
    env = {**os.environ, RESULT_FILE_ENV: result_file}
    ready_at = time.time()
    try:
        net, extra = node_preflight.prepare(endpoint, node == 0, timeout_s, env)
    except (node_preflight.PreflightError, ValueError) as err:
        message = node_preflight.failure(where, getattr(err, "net", None), endpoint, timeout_s,
                                         str(err), time.time() - ready_at)
        _say(message)
        node_preflight.write_result(message, env)
        return {"node": node, "address": address, "host": socket.gethostname(),
                "exit_code": node_preflight.EXIT_CONFIG, "job_dir": job_dir,
                "result": {"status": node_preflight.STATUS_BAD_CONFIG,
                           "exit_code": node_preflight.EXIT_CONFIG, "message": message}}
    left = node_preflight.join_seconds(timeout_s, time.time() - ready_at, node == 0)
    command = node_preflight.with_join_timeout(command, left)
    _say(f"node {node} reaches the rendezvous {net.endpoint} from {net.own}; set "
         f"{' '.join(f'{k}={v}' for k, v in extra.items()) or 'nothing (set by the user)'}")
    env.update(extra)
    proc = subprocess.Popen(command, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, preexec_fn=procs.pdeathsig())
    pump = threading.Thread(target=_pump, args=(proc.stdout, console), daemon=True)
    pump.start()
    try:
        while proc.poll() is None:  # a loop, not wait(): Ray's cancel interrupts between polls
            time.sleep(0.2)
    except BaseException:  # cancelled (KeyboardInterrupt) or the worker is exiting
        procs.stop(proc)
        raise
    finally:
        pump.join(timeout=5)
    result = None
    if os.path.exists(result_file) and os.path.getsize(result_file):
        with open(result_file, encoding="utf-8") as fh:
            try:
                result = json.load(fh)
            except json.JSONDecodeError:
                result = None
    if result is None and proc.returncode and _said(console, b"RendezvousTimeoutError"):
        result = {"status": STATUS_ERROR, "exit_code": proc.returncode, "message": (
            f"the rendezvous timed out on node {where} at fault.startup_timeout ({left} s left "
            f"after its preflight): every node reached the store, but not all joined in time")}
    return {"node": node, "address": address, "host": socket.gethostname(),
            "exit_code": proc.returncode, "result": result, "job_dir": job_dir,
            "ended_at": time.time()}


def _said(path: str, words: bytes) -> bool:
    """Whether the console ``path`` contains ``words`` (a rendezvous timeout, once the preflight
    passed: named in the result)."""
    try:
        with open(path, "rb") as fh:
            return words in fh.read()
    except OSError:
        return False


def _pump(stream: Any, path: str) -> None:
    """Every line of ``stream`` to the file ``path`` and to this process's stdout."""
    with open(path, "ab") as log:
        for line in iter(stream.readline, b""):
            log.write(line)
            log.flush()
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()


def _cluster_nodes(ray: Any) -> str:
    """The cluster's alive nodes and their CPUs and GPUs, in words."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    parts = [f"{n.get('NodeManagerAddress')}: {n.get('Resources', {}).get('CPU', 0):g} CPU, "
             f"{n.get('Resources', {}).get('GPU', 0):g} GPU" for n in alive]
    return f"{len(alive)} alive node{'s' * (len(alive) != 1)} ({'; '.join(parts) or 'none'})"


def _print_result(result: dict[str, Any]) -> None:
    print(f"\n{RESULT_MARKER}{json.dumps(result, separators=(',', ':'))}", flush=True)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    parser.add_argument("--key", required=True, help="the job identity's key")
    parser.add_argument("--nodes", type=int, required=True, help="Ray nodes (bundles), >= 2")
    parser.add_argument("--cpus-per-node", type=float, required=True)
    parser.add_argument("--gpus-per-node", type=float, default=0.0)
    parser.add_argument("--memory-bytes", type=int, default=None)
    parser.add_argument("--startup-timeout-s", type=float, default=None,
                        help="how long the placement group may wait (default: no limit)")
    parser.add_argument("torchrun", nargs=argparse.REMAINDER,
                        help="-- and the torchrun command, with the placeholders")
    args = parser.parse_args(argv)
    if args.torchrun[:1] == ["--"]:
        args.torchrun = args.torchrun[1:]
    if args.nodes < 2 or not args.torchrun:
        parser.error(f"expected --nodes >= 2 and a torchrun command after -- (got --nodes "
                     f"{args.nodes}, command {args.torchrun!r})")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    config = os.environ.get(CONFIG_ENV)
    if not config:
        _say(f"${CONFIG_ENV} is empty: the job config travels in it (see docs/ray.md)")
        return 70
    # Worker output reaches the job log as it is: no colour codes, no lines merged across nodes.
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    def terminate(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, terminate)
    started = time.monotonic()
    ray.init(log_to_driver=True)
    shape = bundle(args.cpus_per_node, args.gpus_per_node, args.memory_bytes)
    asked = (f"{args.nodes} bundles of {shape}, strategy STRICT_SPREAD (one per Ray node)")
    pg = placement_group([dict(shape) for _ in range(args.nodes)], strategy="STRICT_SPREAD",
                         name=f"trainforge-{args.key}")
    refs: list[Any] = []
    try:
        _say(f"placement group {asked}")
        ready = pg.ready()
        while True:
            left = (None if args.startup_timeout_s is None
                    else args.startup_timeout_s - (time.monotonic() - started))
            wait_s = PENDING_REPORT_S if left is None else max(0.0, min(PENDING_REPORT_S, left))
            done, _ = ray.wait([ready], timeout=wait_s)
            if done:
                break
            waited = time.monotonic() - started
            if left is not None and left <= wait_s:
                message = (f"the placement group of job {args.key} ({asked}) could not be "
                           f"placed within the startup timeout ({args.startup_timeout_s:g} s); "
                           f"the cluster has {_cluster_nodes(ray)}")
                _say(message)
                _print_result({"status": STATUS_ERROR, "exit_code": EXIT_ERROR,
                               "message": message})
                return EXIT_ERROR
            _say(f"pending {waited:.0f} s: waiting for {asked}; the cluster has "
                 f"{_cluster_nodes(ray)}")
        _say(f"placement group placed after {time.monotonic() - started:.1f} s")

        def in_bundle(i: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)

        # By their module's name (not __main__'s), so Ray ships them by reference.
        from trainforge.engines.ray import launcher

        deadline = (None if args.startup_timeout_s is None
                    else time.time() + args.startup_timeout_s - (time.monotonic() - started))
        head = ray.get(ray.remote(launcher.probe).options(
            num_cpus=0, scheduling_strategy=in_bundle(0), max_retries=0).remote(True))
        # Every node's name, to name one whose task dies with it (node_loss.py).
        places = [head, *ray.get([ray.remote(launcher.probe).options(
            num_cpus=0, scheduling_strategy=in_bundle(i), max_retries=0).remote(False)
            for i in range(1, args.nodes)])]
        endpoint = host_port(head["address"], head["port"])
        _say(f"{args.nodes} nodes; c10d rendezvous on {endpoint} (node 0, {head['host']})")
        task = ray.remote(launcher.run_node)
        for i in range(args.nodes):
            refs.append(task.options(
                name=f"trainforge-node-{i}", num_cpus=args.cpus_per_node,
                num_gpus=args.gpus_per_node, memory=args.memory_bytes or None,
                scheduling_strategy=in_bundle(i), max_retries=0,
            ).remote(i, args.nodes, args.key, config, list(args.torchrun), endpoint, deadline))
        code = _collect(ray, refs, args.nodes, places,
                        lambda: node_tasks.rank_records(ray, args.nodes, node_marker(args.key), in_bundle))
        if code:  # a cancelled node's ranks may outlive its torchrun: none may outlive the job
            node_tasks.reap(ray, args.nodes, node_marker(args.key), in_bundle)
        return code
    except KeyboardInterrupt:
        _say("stopping: cancelling every node's torchrun")
        _cancel(ray, refs, wait_s=2.0)
        if refs:  # the node tasks had started
            node_tasks.reap(ray, args.nodes, node_marker(args.key), in_bundle)
        return 143
    finally:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - the job is ending either way
            pass


def _collect(ray: Any, refs: list[Any], nodes: int, places: Sequence[dict[str, Any]] = (),
             records: Any = None) -> int:
    """Wait for every node; cancel the rest when one fails; name a lost node (node_loss.py);
    print the result, with every node's rank records (``records()``) after a failure; the exit
    code. ``places``: each node's ``probe``, to name a node whose task died."""
    ended: list[dict[str, Any]] = []
    pending = list(refs)
    cancelled: set[int] = set()
    stop_at: float | None = None  # once a node failed: the others may still end on their own
    while pending:
        timeout = None if stop_at is None else max(0.0, stop_at - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not done:  # they did not: their results are what a cancel leaves
            _say(f"stopping the other node{'s' * (len(pending) > 1)}")
            cancelled.update(refs.index(ref) for ref in pending)
            _cancel(ray, pending, wait_s=CANCEL_WAIT_S)
            stop_at = None
        for ref in done:
            node = refs.index(ref)
            try:
                info = ray.get(ref)
            except Exception as err:  # noqa: BLE001 - the worker or its node died, cancelled
                place = places[node] if node < len(places) else {}
                info = {"node": node, "exit_code": None, "result": None,
                        "address": place.get("address"), "host": place.get("host"),
                        "error": f"{type(err).__name__}: "
                                 f"{(str(err).strip().splitlines() or [''])[0][:300]}"}
            info.update(seen_at=time.time(), cancelled=node in cancelled)
            ended.append(info)
            if info.get("exit_code") != 0 and pending and stop_at is None and not cancelled:
                # a consistent failure (a bad config, a divergence) ends every node within seconds,
                # rank 0's with its result: not cancelled before that
                _say(f"node {node} failed ({_ending(info)}): the other nodes have {PEER_END_S:g} s to end")
                stop_at = time.monotonic() + PEER_END_S
    time.sleep(LOG_FLUSH_S)
    for info in sorted(ended, key=lambda i: i["node"]):
        _say(f"node {info['node']} of {nodes} ended: {_ending(info)}")
    results = [i for i in ended if i.get("result")]
    result = results[0]["result"] if results else None
    failed = [i for i in ended if i.get("exit_code") != 0]  # in the order they ended
    rank0 = [i for i in failed if i.get("result")]
    first = (rank0 or failed or [{}])[0]
    code = (first["exit_code"] if first.get("exit_code") else EXIT_ERROR) if failed else 0
    loss = lost_node(ended, nodes) if failed else None
    if loss is not None:  # the lost node, never a survivor whose ranks noticed it
        _say(describe(loss))
        result = {**(result or {"status": STATUS_ERROR, "exit_code": code,
                                "message": describe(loss)}), "disruption": loss}
    found = records() if failed and records is not None else None
    if found:  # the engine names the rank that started it (trainforge.engines.root_cause)
        result = {**(result or {"status": STATUS_ERROR, "exit_code": code}), "rank_records": found}
    if result:
        _print_result(result)
    return code


def _ending(info: dict[str, Any]) -> str:
    where = f" on {info['address']}" if info.get("address") else ""
    if info.get("error"):
        return f"no exit code{where}: {info['error']}"
    return f"torchrun exit code {info['exit_code']}{where}"


def _cancel(ray: Any, refs: list[Any], wait_s: float) -> None:
    """Cancel node tasks (each stops its torchrun); kill their workers if still running after
    ``wait_s``."""
    for ref in refs:
        ray.cancel(ref)
    _, alive = ray.wait(refs, num_returns=len(refs), timeout=wait_s) if refs else ([], [])
    for ref in alive:
        ray.cancel(ref, force=True)


if __name__ == "__main__":
    sys.exit(main())
