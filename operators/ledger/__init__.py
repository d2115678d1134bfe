"""The run ledger: where a training job's time, device-hours, energy and money went.

The trainer's rank 0 records each attempt's buckets (trainforge.trainer.goodput); the ``train``
task adds what the orchestrator and the engine know (queue wait, image pull, its own
overhead), prices the job from the catalog (`catalog`), chooses measured or estimated energy
(`energy`), and closes the books so that the buckets and the productive time sum to the wall
time (`books`). Names of what it logs: `names`; docs/contracts.md, "Run ledger".
"""
