"""What the Ray launcher's driver asks of every node of a job once its torchruns have ended: stop
what they left (procs.reap), and bring back the ranks' own records (trainforge.trainer.rank_record)
from each node's job folder, from which the engine names the rank that started a failure
(trainforge.engines.root_cause). Each is a Ray task in the node's bundle of the job's placement
group; a lost node answers nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainforge.engines.ray import procs


def reap(ray: Any, nodes: int, marker: str, in_bundle: Callable[[int], Any]) -> None:
    """Stop what is left of the job on every node (procs.reap); say what was."""
    refs = [ray.remote(procs.reap).options(num_cpus=0, scheduling_strategy=in_bundle(i),
                                           max_retries=0).remote(marker)
            for i in range(nodes)]
    for i, pids in enumerate(_answers(ray, refs, procs.STOP_GRACE_S + 10.0)):
        if pids:
            print(f"trainforge: node {i}: stopped {len(pids)} process(es) left by its torchrun", flush=True)


def rank_records(ray: Any, nodes: int, marker: str, in_bundle: Callable[[int], Any]) -> list[dict[str, Any]]:
    """Every rank record of the job, from each node's own job folder (``marker`` + the node's
    index); a node that does not answer in time adds none."""
    refs = [ray.remote(procs.rank_records).options(num_cpus=0, scheduling_strategy=in_bundle(i),
                                                   max_retries=0).remote(f"{marker}{i}.")
            for i in range(nodes)]
    return [record for found in _answers(ray, refs, 10.0) if found for record in found]


def _answers(ray: Any, refs: list[Any], timeout_s: float) -> list[Any]:
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    answers = []
    for ref in refs:
        try:
            answers.append(ray.get(ref) if ref in done else None)
        except Exception:  # noqa: BLE001 - a lost node runs nothing
            answers.append(None)
    return answers
