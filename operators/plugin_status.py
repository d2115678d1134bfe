"""Whether Airflow loaded the trainforge plugin in this process, and Airflow's reason if not.

The DAG files call :func:`require_plugin` while they are parsed, so a plugin that did not load
(an Airflow or MLflow outside the ranges the wheel declares, a module that fails to import) is
their import error, shown with the DAGs in Airflow's UI (docs/ui.md, "When something is wrong").
It reads Airflow's plugins manager and the distribution's entry points; it must never import
trainforge.plugins (the plugin sits above this layer) nor anything heavy.
"""

from __future__ import annotations

from importlib import metadata

from trainforge.errors import PluginNotLoaded

DISTRIBUTION = "trainforge"
ENTRY_POINT_GROUP = "airflow.plugins"


def _entry_points() -> list[metadata.EntryPoint]:
    """The ``airflow.plugins`` entry points of the installed trainforge distribution (none when
    the code runs from a checkout without it: no plugin is then expected)."""
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return []
    return [ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]


def _plugins_manager_state() -> tuple[list[tuple[str, str]], dict[str, str]]:
    """``([(name, source), ...] of the loaded plugins, {source: message} of the import
    errors)`` of Airflow's plugins manager in this process, loading the plugins if none were."""
    try:
        from airflow import plugins_manager
    except ImportError:  # a worker with only the Task SDK: its own plugins manager
        from airflow.sdk import plugins_manager as sdk_plugins

        plugins, errors = sdk_plugins._get_plugins()
        return [(p.name or "", str(p.source)) for p in plugins], dict(errors)
    loaded = [(info["name"] or "", str(info["source"]))
              for info in plugins_manager.get_plugin_info(attrs_to_dump=["source"])]
    return loaded, dict(plugins_manager.get_import_errors())


def plugin_load_errors() -> dict[str, str]:
    """``{source: message}``: Airflow's plugin import errors of the trainforge plugin when Airflow
    did not load it in this process; empty when it did.

    The plugin counts as loaded when a loaded plugin has its entry point's name or came from its
    entry point. Airflow files an entry point that fails to import under its module and a plugin
    whose ``on_load`` raises under its source (``trainforge==<version>: EntryPoint(...)``); both
    name the entry point's module or value."""
    ours = _entry_points()
    if not ours:
        return {}
    loaded, errors = _plugins_manager_state()
    if any(name == ep.name or ep.value in source for name, source in loaded for ep in ours):
        return {}
    found = {source: message for source, message in errors.items()
             if any(source == ep.module or ep.value in source for ep in ours)}
    return found or {ours[0].value: "Airflow's plugins manager loaded no trainforge plugin "
                                    "and recorded no reason"}


def require_plugin() -> None:
    """Raise unless Airflow loaded the trainforge plugin in this process.

    Raises:
        PluginNotLoaded: names each of Airflow's plugin import errors of the plugin, with where
            Airflow lists them.
    """
    errors = plugin_load_errors()
    if not errors:
        return
    reasons = "; ".join(f"{message} [{source}]" for source, message in sorted(errors.items()))
    raise PluginNotLoaded(
        f"the trainforge plugin did not load, so neither do its pipelines: {reasons}. "
        "Airflow lists it under Plugin Import Errors (Admin > Plugins, GET "
        "/api/v2/plugins/importErrors); fix the installation, then restart Airflow's "
        "components.")
