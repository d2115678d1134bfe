"""trainforge: YAML pipelines that become Airflow DAGs training LLMs on GPU clusters.

This package is the Airflow side (pipeline spec, task graph, operators, hooks, trigger, engines,
CLI); :mod:`trainforge.trainer` runs on the cluster and :mod:`trainforge.mlflow_setup` starts
the tracking server. Importing it is cheap: nothing is imported here, so the trainer can import
:mod:`trainforge.trainer` on a machine without Airflow.
"""
