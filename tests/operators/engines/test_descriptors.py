"""The engine descriptors: the built-in engines through their entry points, their declared
capabilities, lazy backends, the errors of a broken or unknown engine, and the old module name."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import EntryPoint

import pytest

from trainforge.engines import descriptors
from trainforge.engines.descriptors import (
    Engine,
    EngineRegistryError,
    backend_kwargs,
    engine_names,
    get_backend,
    get_engine,
)


def test_built_in_engines_default_first():
    assert engine_names()[:4] == ("local", "kubernetes", "ray", "slurm")


@pytest.mark.parametrize("name,multi_node,shared_disk,needs_image,in_memory,dev_cluster", [
    ("local", False, True, False, True, False),
    ("kubernetes", True, False, True, False, False),
    ("ray", True, True, False, True, True),
    ("slurm", True, True, False, False, False),
])
def test_capabilities(name, multi_node, shared_disk, needs_image, in_memory, dev_cluster):
    engine = get_engine(name)
    assert (engine.multi_node, engine.shared_disk, engine.needs_image, engine.secrets_in_memory,
            engine.dev_cluster is not None) == (multi_node, shared_disk, needs_image, in_memory,
                                                dev_cluster)
    assert engine.secrets_in_memory or (engine.written_request and engine.secrets_remedy)


def test_unknown_engine():
    with pytest.raises(ValueError, match=r"unknown engine 'slurmm'; expected one of local, "):
        get_engine("slurmm")
    with pytest.raises(ValueError, match="unknown engine"):
        get_backend("slurmm")


def test_backend_kwargs_come_from_the_engines_block(tmp_path):
    from trainforge.pipeline.spec import TrainingSection

    base = {"optimization": {"max_steps": 2, "global_batch_size": 2, "micro_batch_size": 1,
                             "learning_rate": 1e-3},
            "checkpoint": {"interval_steps": 1}, "resources": {"processes_per_node": 1}}
    local = TrainingSection.model_validate(base)
    assert backend_kwargs(local, "/runs") == {"runs_root": "/runs"}
    ray = TrainingSection.model_validate({**base, "engine": "ray",
                                          "ray": {"address": "http://h:1"}})
    assert backend_kwargs(ray, "/runs") == {"address": "http://h:1", "conn_id": None}
    assert type(get_backend("local", **backend_kwargs(local, str(tmp_path)))).__name__ == \
        "LocalBackend"


def test_descriptors_import_no_engine_client():
    code = ("import sys; from trainforge.engines.descriptors import engines; engines(); "
            "import trainforge.pipeline; "
            "print(sorted(m for m in ('kubernetes', 'ray', 'urllib3') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"




@pytest.mark.parametrize("points,fragment", [
    ([EntryPoint("toy", "trainforge.engines.local:ENGINE", descriptors.ENTRY_POINT_GROUP)],
     "is not the Engine named 'toy'"),
    ([EntryPoint("toy", "no_such_module_here:ENGINE", descriptors.ENTRY_POINT_GROUP)],
     "does not load"),
    ([EntryPoint("local", "trainforge.engines.local:ENGINE", descriptors.ENTRY_POINT_GROUP),
      EntryPoint("local", "trainforge.engines.ray:ENGINE", descriptors.ENTRY_POINT_GROUP)],
     "registered twice"),
])
def test_broken_entry_points(monkeypatch, points, fragment):
    monkeypatch.setattr(descriptors, "entry_points", lambda group: points)
    descriptors._engines.cache_clear()
    try:
        with pytest.raises(EngineRegistryError, match=fragment):
            engine_names()
    finally:
        monkeypatch.undo()
        descriptors._engines.cache_clear()


def test_engine_is_a_plain_value():
    engine = get_engine("local")
    assert isinstance(engine, Engine) and engine.backend_class().engine == "local"


def test_the_old_module_name_still_imports_and_warns():
    code = ("import warnings; warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    from trainforge.engines.registry import Engine, get_backend\n"
            "from trainforge.engines import descriptors\n"
            "assert Engine is descriptors.Engine and get_backend is descriptors.get_backend\n"
            "print([(w.category.__name__, str(w.message)) for w in caught])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "DeprecationWarning" in out and "trainforge.engines.descriptors" in out
