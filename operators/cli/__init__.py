"""The ``trainforge`` command: its typer app (main), the local runner with its console and summary,
``make airflow`` (standalone), the accounting report and the engine switch of render and run.

Nothing under ``trainforge`` outside this folder imports it: the DAG-side code and the plugin
never depend on the command.
"""
