"""The ``slurm`` engine's pure parts: the sbatch script of a job, and Slurm's vocabulary.

:func:`render_script` turns a :class:`~trainforge.engines.base.TrainingJob` into the exact batch
script that :class:`~trainforge.engines.slurm.backend.SlurmBackend` writes and hands to ``sbatch``:

* ``#SBATCH`` lines: the job name is the identity's key (what ``find`` looks for), the comment
  carries the full identity; one task per node (``--ntasks-per-node=1``) with every CPU of the
  node's ranks (``--cpus-per-task`` = processes per node x threads per process), GPUs per node,
  memory, the time limit (``fault.run_timeout`` rounded up to whole minutes, Slurm's unit),
  ``--output`` into the job folder, ``--no-requeue`` (Airflow retries, and a retry resumes from
  the newest valid checkpoint: Slurm must not run the same job a second time on its own), and
  the engine block's partition, account, QOS, reservation, constraint and ``--exclusive``;
* the environment of every rank, then the engine block's ``setup`` lines;
* ``srun`` starting one torchrun per node; torchrun's c10d rendezvous runs on the job's first
  node (``scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1``) on port
  ``29500 + SLURM_JOB_ID % 10000`` unless the block sets one; the first node's console (its local
  rank 0) goes to the job log, the other nodes' consoles to ``ranks/node-<N>.log``;
* an exit record ``exit.json`` with srun's exit code, so the outcome is known even where the
  cluster keeps no accounting (``sacct``) and the controller has forgotten the job.

An elastic job (``TrainingJob.min_nodes``) asks for ``--nodes=MIN-MAX`` with ``--no-kill`` and
runs torchrun with ``--nnodes=MIN:<allocated>``: a lost node's task ends, the others go on.

Slurm's job states and pending reasons are mapped in :data:`STATES` and :data:`PENDING_REASONS`.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Any

from trainforge.engines.base import JobState, TrainingJob
from trainforge.engines.launch import python_torchrun, rank_env, torchrun_argv
from trainforge.engines.node_preflight import DEFAULT_TIMEOUT_S as DEFAULT_PREFLIGHT_TIMEOUT_S
from trainforge.engines.node_preflight import MODULE as PREFLIGHT_MODULE

SCRIPT_NAME = "job.sbatch"
LOG_NAME = "job.log"

# Slurm job state (squeue %T, sacct State; sacct may add "by <uid>") -> neutral state.
# Terminal Slurm states that are not a success map to FAILED; the failure kind comes from the
# trainer's result and exit code (78 bad config, 79 diverged: permanent), else transient.
STATES: dict[str, JobState] = {
    "PENDING": JobState.PENDING,         # queued, waiting for resources / priority / limits
    "CONFIGURING": JobState.PENDING,     # nodes allocated, still booting or being set up
    "REQUEUED": JobState.PENDING,        # back in the queue (an admin requeued it)
    "REQUEUE_HOLD": JobState.PENDING,    # requeued and held
    "REQUEUE_FED": JobState.PENDING,     # requeued by a federation
    "RESV_DEL_HOLD": JobState.PENDING,   # held because its reservation was deleted
    "RUNNING": JobState.RUNNING,
    "COMPLETING": JobState.RUNNING,      # the script ended; Slurm still cleans up its nodes
    "SUSPENDED": JobState.RUNNING,       # paused (gang scheduling / admin); resumes later
    "STOPPED": JobState.RUNNING,         # SIGSTOPped; its allocation is kept
    "SIGNALING": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING,       # burst buffer stage-out after the script
    "RESIZING": JobState.RUNNING,
    "COMPLETED": JobState.SUCCEEDED,     # every node exited 0
    "CANCELLED": JobState.CANCELLED,     # scancel (ours or anyone's)
    "FAILED": JobState.FAILED,           # the script exited non-zero
    "TIMEOUT": JobState.FAILED,          # hit --time (fault.run_timeout)
    "NODE_FAIL": JobState.FAILED,        # a node died under the job
    "PREEMPTED": JobState.FAILED,        # preempted by a higher-priority job (no requeue)
    "OUT_OF_MEMORY": JobState.FAILED,    # a step exceeded its memory (--mem)
    "BOOT_FAIL": JobState.FAILED,        # a node failed to boot for the job
    "DEADLINE": JobState.FAILED,         # missed its --deadline
    "REVOKED": JobState.FAILED,          # a federation sibling ran it instead
    "SPECIAL_EXIT": JobState.FAILED,     # held after a special exit code
}

# Why a job pends (squeue %r), in words; shown while it waits and when it fails to start.
PENDING_REASONS: dict[str, str] = {
    "Resources": "waiting for nodes with the requested CPUs, GPUs or memory to become free",
    "Priority": "jobs of higher priority are ahead of it in the queue",
    "ReqNodeNotAvail": "a node it needs is down, drained or reserved",
    "PartitionDown": "its partition is down",
    "PartitionInactive": "its partition is inactive",
    "NodeDown": "a node it needs is down",
    "Dependency": "waiting for a job it depends on to finish",
    "BeginTime": "its earliest start time has not come yet",
    "JobHeldUser": "held by its user (scontrol release <job id>)",
    "JobHeldAdmin": "held by an administrator",
    "Reservation": "waiting for its reservation to start",
    "Licenses": "waiting for licenses",
    "QOSMaxJobsPerUserLimit": "the QOS allows no more running jobs of this user now",
    "AssocGrpCpuLimit": "the account's CPU limit is in use by other jobs",
    "AssocGrpGRES": "the account's GPU (GRES) limit is in use by other jobs",
    "AssocGrpMemLimit": "the account's memory limit is in use by other jobs",
    "AssocGrpNodeLimit": "the account's node limit is in use by other jobs",
    "QOSGrpCpuLimit": "the QOS's CPU limit is in use by other jobs",
    "QOSGrpGRES": "the QOS's GPU (GRES) limit is in use by other jobs",
    "QOSGrpNodeLimit": "the QOS's node limit is in use by other jobs",
    "None": "not evaluated by the scheduler yet",
}

# Reasons that mean the job can never start as submitted: it is cancelled at once and fails
# permanently (a retry would wait just the same), instead of waiting out the startup timeout.
NEVER_RUNS: dict[str, str] = {
    "PartitionTimeLimit": "its time limit (fault.run_timeout) exceeds the partition's MaxTime",
    "PartitionNodeLimit": "it asks for more nodes than the partition allows",
    "BadConstraints": "no node has the requested features or resources (training.slurm."
                      "constraint, resources)",
    "InvalidAccount": "the account does not exist or the user may not use it "
                      "(training.slurm.account)",
    "InvalidQOS": "the QOS does not exist or the account may not use it (training.slurm.qos)",
    "DependencyNeverSatisfied": "a job it depends on failed",
    "AssocMaxWallDurationPerJobLimit": "its time limit exceeds the account's per-job maximum",
    "QOSMaxWallDurationPerJobLimit": "its time limit exceeds the QOS's per-job maximum",
    "AssocMaxNodesPerJobLimit": "it asks for more nodes than the account allows per job",
    "QOSMaxNodePerJobLimit": "it asks for more nodes than the QOS allows per job",
    "AssocMaxCpuPerJobLimit": "it asks for more CPUs than the account allows per job",
    "QOSMaxCpuPerJobLimit": "it asks for more CPUs than the QOS allows per job",
    "AssocMaxGRESPerJob": "it asks for more GPUs (GRES) than the account allows per job",
    "QOSMaxGRESPerJob": "it asks for more GPUs (GRES) than the QOS allows per job",
}

DEFAULT_RENDEZVOUS_PORT = 29500
#: In torchrun's arguments, replaced on each node by ``true`` (the first node) or ``false``.
IS_HOST = "@TRAINFORGE_IS_HOST@"
IS_HOST_CONF = f"is_host={IS_HOST}"
"""torchrun's default rendezvous port; a job without a fixed one uses 29500 + job id % 10000."""


RENDEZVOUS_TIMEOUT = ("the rendezvous timed out at fault.startup_timeout ({timeout} s): every "
                      "node reached the store in its preflight, but not all nodes joined in time "
                      "(a node slow to start, or one that failed before joining: see ranks/)")
"""The job's message when torchrun's rendezvous timed out after the preflight passed."""


def preflight_timeout(job: TrainingJob) -> int:
    """The preflight's ``--timeout``: ``fault.startup_timeout`` in whole seconds, else the
    preflight's default (torchrun's join timeout)."""
    if job.startup_timeout_s:
        return math.ceil(job.startup_timeout_s)
    return math.ceil(DEFAULT_PREFLIGHT_TIMEOUT_S)


def reason_text(reason: str) -> str:
    """Slurm's pending reason with its meaning, e.g. ``"Resources (waiting for nodes ...)"``."""
    code = reason.split(",")[0].strip()
    meaning = PENDING_REASONS.get(code) or NEVER_RUNS.get(code)
    return f"{reason} ({meaning})" if meaning else reason


def time_limit(seconds: float) -> str:
    """``--time`` for a limit in seconds: whole minutes rounded up, as ``D-HH:MM:SS``."""
    minutes = max(1, math.ceil(seconds / 60.0))
    days, rest = divmod(minutes, 24 * 60)
    return f"{days}-{rest // 60:02d}:{rest % 60:02d}:00"


def render_script(job: TrainingJob, job_dir: Path, exclude: tuple[str, ...] = ()) -> str:
    """The batch script of ``job`` whose files live in ``job_dir`` (shared storage), kept off
    the ``exclude`` nodes. Pure.

    ``job.engine_options`` is the spec's ``training.slurm`` block (see
    :class:`trainforge.engines.slurm.spec.SlurmEngine`); absent keys take that block's defaults.
    """
    opts = job.engine_options or {}
    identity = job.identity
    q = shlex.quote
    folder = str(job_dir)
    comment = " ".join(f"{k}={_comment_value(v)}" for k, v in (
        ("trainforge_key", identity.key), ("dag_id", identity.dag_id),
        ("run_id", identity.run_id), ("task_id", identity.task_id),
        ("try", identity.try_number)))
    directives = [
        f"--job-name={identity.key}",
        f'--comment="{comment}"',
        # An elastic job takes as many nodes as Slurm can give now, between its fewest and
        # most: with --ntasks-per-node Slurm would count its tasks from the fewest and give those.
        *([f"--nodes={job.min_nodes}-{job.nodes}"] if job.elastic
          else [f"--nodes={job.nodes}", "--ntasks-per-node=1"]),
        f"--cpus-per-task={job.processes_per_node * job.threads_per_process}",
    ]
    if job.gpus_per_node:
        gpu_type = opts.get("gpu_type")
        directives.append(f"--gpus-per-node={gpu_type + ':' if gpu_type else ''}"
                          f"{job.gpus_per_node}")
    if job.memory_gib:
        directives.append(f"--mem={math.ceil(job.memory_gib * 1024)}M")
    if job.max_runtime_s:
        directives.append(f"--time={time_limit(job.max_runtime_s)}")
    directives += [
        f"--output={folder}/{LOG_NAME}",
        "--open-mode=append",
        f"--chdir={opts.get('working_dir') or folder}",
        "--no-requeue",
    ]
    for key in ("partition", "account", "qos", "reservation", "constraint"):
        if opts.get(key):
            directives.append(f"--{key}={opts[key]}")
    if opts.get("exclusive"):
        directives.append("--exclusive")
    if job.elastic:  # a lost node leaves the allocation; the job goes on with the others
        directives.append("--no-kill")
    if exclude:  # nodes an earlier try of this task lost (SlurmBackend.submit)
        directives.append(f"--exclude={','.join(exclude)}")

    env = {
        **rank_env(job, f"{folder}/result.json", job_dir=folder),
        **{str(k): str(v) for k, v in (opts.get("env_vars") or {}).items()},
        **job.env,
    }
    port = opts.get("rendezvous_port")
    python = q(opts.get("python") or "python3")
    # The first node hosts the c10d store and is told so (is_host, filled in on each node by
    # the preamble), never left to decide from its host name (which may resolve to 127.0.1.1).
    conf = [f"join_timeout={math.ceil(job.startup_timeout_s)}"] if job.startup_timeout_s else []
    # (join_timeout: a node slower to start than the others, e.g. a module load or a slow shared
    # file system, is waited for as long as the job may take to start, not torchrun's 600 s.)
    rendezvous = ["--rdzv-backend=c10d", '--rdzv-endpoint="$rdzv_host:$rdzv_port"',
                  '--rdzv-id="$SLURM_JOB_ID"', f"--rdzv-conf={','.join([*conf, IS_HOST_CONF])}"]
    # Each node's preflight (trainforge.engines.node_preflight) runs first and execs torchrun.
    preflight = [python, "-m", PREFLIGHT_MODULE, f"--timeout={preflight_timeout(job)}", "--"]
    torchrun = torchrun_argv(
        job, q(f"{folder}/job.json"),
        launcher=(*preflight, *python_torchrun(python)),
        standalone=False,
        # elastic: torchrun's MIN:MAX, the most being what Slurm allocated
        nnodes=f'{job.min_nodes}:"$SLURM_NNODES"' if job.elastic else '"$SLURM_NNODES"',
        rendezvous=tuple(rendezvous),
        log_dir=q(folder + "/ranks"), module=q(job.module))
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {d}" for d in directives]
    lines += [
        "#",
        f"# trainforge job {identity.key}: torchrun on every allocated node, one srun task per "
        "node.",
        "set -u",
        "",
        "# Environment of every rank",
    ]
    lines += [f"export {name}={q(value)}" for name, value in env.items()]
    if opts.get("setup"):
        lines += ["", "# Setup (training.slurm.setup)"]
        lines += [str(line) for line in opts["setup"]]
    lines += [
        "",
        "# How the job ended, for when Slurm no longer knows it (no accounting, purged record).",
        "finish() {",
        '  printf \'{"exit_code": %d, "ended_at": %d}\\n\' "$1" "$(date +%s)" '
        '> "$TRAINFORGE_JOB_DIR/.exit.json.tmp" \\',
        '    && mv "$TRAINFORGE_JOB_DIR/.exit.json.tmp" "$TRAINFORGE_JOB_DIR/exit.json"',
        '  exit "$1"',
        "}",
        "",
        "# The rendezvous runs on the first node (this one), at the address the controller reaches",
        "# it at (its NodeAddr, else its name): every node must resolve it, and with several nodes",
        "# it must not be a loopback address. 78 = a configuration error, not retried.",
        "node_addr() { scontrol show node -o \"$1\" 2>/dev/null | tr ' ' '\\n' "
        "| sed -n 's/^NodeAddr=//p' | head -n1; }",
        'head_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"',
        'TRAINFORGE_RDZV_ADDR="$(node_addr "$head_node")"',
        'export TRAINFORGE_RDZV_ADDR="${TRAINFORGE_RDZV_ADDR:-$head_node}"',
        'if ! getent ahosts "$TRAINFORGE_RDZV_ADDR" >/dev/null; then',
        '  echo "trainforge: the first node $head_node has the address $TRAINFORGE_RDZV_ADDR, '
        'which does not resolve on $(hostname); set its NodeAddr in slurm.conf or fix the '
        'nodes\' name resolution" >&2',
        "  finish 78",
        "fi",
        'if [ "$SLURM_NNODES" -gt 1 ] && getent ahosts "$TRAINFORGE_RDZV_ADDR" '
        "| awk '{print $1}' | grep -Eq '^(127\\.|::1$)'; then",
        '  echo "trainforge: the first node $head_node has the address $TRAINFORGE_RDZV_ADDR, '
        'a loopback address the other $(( SLURM_NNODES - 1 )) node(s) cannot reach; set its '
        'NodeAddr in slurm.conf to an address the nodes route to" >&2',
        "  finish 78",
        "fi",
        "",
        "# The rendezvous port, on the first node: "
        + ("training.slurm.rendezvous_port, fixed" if port else
           f"{DEFAULT_RENDEZVOUS_PORT} + job id % 10000 unless that one is taken, then a free one"),
        f"rdzv_port={port if port else f'$(( {DEFAULT_RENDEZVOUS_PORT} + SLURM_JOB_ID % 10000 ))'}",
        f"if ! {python} -c 'import socket, sys; socket.socket().bind((\"\", int(sys.argv[1])))' "
        '"$rdzv_port" 2>/dev/null; then',
    ]
    if port:
        lines += [
            '  echo "trainforge: the rendezvous port $rdzv_port (training.slurm.rendezvous_port) '
            'is in use on the first node $head_node; free it or choose another port" >&2',
            "  finish 1",
        ]
    else:
        lines += [
            f"  taken=$rdzv_port; rdzv_port=$({python} -c 'import socket; s = socket.socket(); "
            f"s.bind((\"\", 0)); print(s.getsockname()[1])')",
            '  echo "trainforge: port $taken is in use on $head_node; the rendezvous takes the '
            'free port $rdzv_port"',
        ]
    lines += [
        "fi",
        "# An IPv6 address is written in brackets in an endpoint ([fd00::10]:29500).",
        'case "$TRAINFORGE_RDZV_ADDR" in *:*) rdzv_host="[$TRAINFORGE_RDZV_ADDR]" ;; '
        '*) rdzv_host="$TRAINFORGE_RDZV_ADDR" ;; esac',
        'echo "trainforge: Slurm job $SLURM_JOB_ID on $SLURM_JOB_NODELIST; rendezvous '
        '$rdzv_host:$rdzv_port"',
        "",
        "# Each node's torchrun names itself to the others by its own NodeAddr (--local-addr, as",
        "# PET_LOCAL_ADDR), not by a host name that may resolve differently on another node. The",
        "# first node's console is the job log; the others' go to ranks/node-<N>.log. Before it,",
        "# each node's preflight sets the socket interface of its route to the rendezvous and",
        "# checks it reaches it within fault.startup_timeout (else 78, not retried).",
        # srun does not inherit --cpus-per-task from sbatch (Slurm >= 22.05): pass it on.
        "srun --nodes=\"$SLURM_NNODES\" --ntasks-per-node=1 "
        "--cpus-per-task=\"$SLURM_CPUS_PER_TASK\" \\",
        # Fixed: --kill-on-bad-exit ends the step when one srun task, a node's torchrun agent,
        # exits non-zero: its restarts (fault.max_restarts) are spent, or its node is lost. A
        # crashed rank does not end its task: its agent restarts the worker group on every node
        # in the same step (docs/slurm.md, "Restarts"). Elastic: --no-kill, the step outlives a
        # lost node's task and the survivors' agents go on without it ("Node loss").
        "  --no-kill \\" if job.elastic else "  --kill-on-bad-exit=1 \\",
        "  bash -c " + q(_NODE_PREAMBLE) + " trainforge-node \\",
        "  " + " \\\n    ".join(_pairs(torchrun, len(preflight))),
        "rc=$?",
        "# Every node passed its preflight (it reached the store), yet not all joined in time.",
        'if [ "$rc" != 0 ] && [ ! -s "$TRAINFORGE_RESULT_FILE" ] && grep -qs '
        'RendezvousTimeoutError "$TRAINFORGE_JOB_DIR"/job.log '
        '"$TRAINFORGE_JOB_DIR"/ranks/node-*.log; then',
        f"  {python} -c " + q('import json, sys; json.dump({"status": "error", "exit_code": '
                              'int(sys.argv[1]), "message": sys.argv[2]}, '
                              'open(sys.argv[3], "w"))')
        + f' "$rc" {q(RENDEZVOUS_TIMEOUT.format(timeout=preflight_timeout(job)))} '
        '"$TRAINFORGE_RESULT_FILE"',
        "fi",
    ]
    if job.elastic:
        lines += [
            "# A lost node's srun task failed, but the survivors finished: the job succeeded.",
            'if [ "$rc" != 0 ] && ' + python + " -c " + q(
                'import json, sys; sys.exit(json.load(open(sys.argv[1])).get("status") != '
                '"success")') + ' "$TRAINFORGE_RESULT_FILE" 2>/dev/null; then',
            '  echo "trainforge: srun ended with $rc after a node was lost, but training '
            'finished on the surviving nodes"',
            "  rc=0",
            "fi",
        ]
    lines += [
        'finish "$rc"',
    ]
    return "\n".join(lines) + "\n"


# What every node's srun task runs before torchrun (bash; the script's variables are exported).
_NODE_PREAMBLE = "; ".join([
    'a="$(scontrol show node -o "$SLURMD_NODENAME" 2>/dev/null | tr " " "\\n" '
    '| sed -n "s/^NodeAddr=//p" | head -n1)"',
    'export PET_LOCAL_ADDR="${a:-$SLURMD_NODENAME}"',
    'getent ahosts "$TRAINFORGE_RDZV_ADDR" >/dev/null || { echo "trainforge: node '
    '$SLURMD_NODENAME cannot resolve the first node\'s address $TRAINFORGE_RDZV_ADDR (the '
    'rendezvous); fix its name resolution or set NodeAddr in slurm.conf" >&2; exit 78; }',
    '[ "$SLURM_NODEID" = 0 ] || exec >>"$TRAINFORGE_JOB_DIR/ranks/node-$SLURM_NODEID.log" 2>&1',
    'export TRAINFORGE_NODE="$SLURMD_NODENAME (node $SLURM_NODEID of $SLURM_NNODES)"',
    'h=false; [ "$SLURM_NODEID" = 0 ] && h=true',
    'args=(); for a in "$@"; do args+=("${a//' + IS_HOST + '/$h}"); done',
    'exec "${args[@]}"',
])


def _pairs(argv: list[str], lead: int = 0) -> list[str]:
    """The preflight (the first ``lead`` words) on a line, then torchrun's arguments grouped
    for a readable script: one option per line."""
    groups: list[str] = [" ".join(argv[:lead])] if lead else []
    groups.append(" ".join(argv[lead:lead + 3]))
    i = lead + 3
    while i < len(argv):
        if argv[i] in ("-m", "--config"):
            groups.append(f"{argv[i]} {argv[i + 1]}")
            i += 2
        else:
            groups.append(argv[i])
            i += 1
    return groups


def _comment_value(value: Any) -> str:
    """A value of the ``--comment`` string: no quotes, backslashes or white space."""
    return "".join("_" if c.isspace() or c in "\"'\\" else c for c in str(value))
