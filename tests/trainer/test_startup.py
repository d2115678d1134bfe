"""The trainer's startup helpers (trainer/startup.py): hidden optional packages, the fallback
when a library needs one after all, the process start clock, and what the program imports."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import time

import psutil
import pytest

from trainforge.trainer.startup import UNUSED_BY_TRAINING, hidden, import_llama, process_started_at


@pytest.fixture
def packages(tmp_path, monkeypatch):
    """Three importable modules: an optional one, one that imports it only when it is installed
    (as transformers does), and one that imports it unconditionally."""
    (tmp_path / "tf_optional.py").write_text("VALUE = 1\n")
    (tmp_path / "tf_guarded.py").write_text(
        "import importlib.util\n"
        "if importlib.util.find_spec('tf_optional'):\n"
        "    import tf_optional\n")
    (tmp_path / "tf_needs.py").write_text("import tf_optional\nVALUE = tf_optional.VALUE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("tf_optional", "tf_guarded", "tf_needs"):
        sys.modules.pop(name, None)


def test_hidden_package_looks_uninstalled_inside_the_block_only(packages):
    with hidden(("tf_optional",)) as names:
        assert names == ("tf_optional",)
        assert importlib.util.find_spec("tf_optional") is None
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("tf_optional")
    assert importlib.import_module("tf_optional").VALUE == 1
    with hidden(("tf_optional",)) as names:  # already imported: left alone
        assert names == ()
        assert importlib.import_module("tf_optional").VALUE == 1


def test_import_skips_an_optional_package_the_importer_guards(packages):
    import_llama(unused=("tf_optional",), module="tf_guarded")
    assert "tf_guarded" in sys.modules and "tf_optional" not in sys.modules
    assert importlib.import_module("tf_optional").VALUE == 1  # importable again afterwards


def test_import_falls_back_when_the_importer_needs_a_hidden_package(packages):
    import_llama(unused=("tf_optional",), module="tf_needs")
    assert sys.modules["tf_needs"].VALUE == 1


def test_other_import_errors_are_raised(packages, tmp_path):
    (tmp_path / "tf_broken.py").write_text("import tf_no_such_module\n")
    with pytest.raises(ModuleNotFoundError, match="tf_no_such_module"):
        import_llama(unused=("tf_optional",), module="tf_broken")


def test_process_start_is_the_kernels_not_a_second_early():
    started = process_started_at()
    assert started <= time.time()
    # psutil adds the start's ticks to a boot time rounded down to the second: up to 1 s earlier
    assert -0.05 <= started - psutil.Process().create_time() <= 1.05


@pytest.mark.parametrize("program", ["train", "validate", "export"])
def test_each_trainer_program_imports_transformers_without_unused_packages(program):
    code = ("import runpy, sys\n"
            f"sys.argv = [{program!r}, '--help']\n"
            "try:\n"
            f"    runpy.run_module('trainforge.trainer.{program}', run_name='__main__')\n"
            "except SystemExit:\n"
            "    pass\n"
            f"print(sorted({set(UNUSED_BY_TRAINING)!r} & set(sys.modules)),\n"
            "      'transformers.modeling_utils' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    # the program imported transformers' model code, and none of what it never uses
    assert out.strip().splitlines()[-1] == "[] True", f"{program}: {out} (trainer/startup.py: UNUSED_BY_TRAINING)"
