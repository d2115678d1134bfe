"""Cluster engines: one folder per engine (its backend, request rendering, status reading, spec
block and :class:`~trainforge.engines.descriptors.Engine` descriptor) behind one contract
(:mod:`trainforge.engines.base`), launched the same way (:mod:`trainforge.engines.launch`) and
found through :mod:`trainforge.engines.descriptors`.

Engine modules are imported only when used, so parsing a DAG never imports an engine's client
(``kubernetes``, ``ray``) or looks for an engine's tools (``sbatch``).
"""
