"""The import-linter contracts of pyproject.toml ([tool.importlinter]), one test per contract.

They run on a copy of the package as a wheel installs it (tests/packaging/layout.py): the editable
install maps `trainforge.trainer` to trainer/ through an import hook that grimp, which walks
folders, does not follow. A broken contract fails with import-linter's report.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.packaging.layout import REPO, copy_installed_tree

CONTRACTS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]

@pytest.fixture(scope="module")
def installed_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_installed_tree(tmp_path_factory.mktemp("site"))


def test_every_contract_has_an_id():
    assert all("id" in contract for contract in CONTRACTS)


@pytest.mark.parametrize("contract", [c["id"] for c in CONTRACTS])
def test_contract(contract: str, installed_tree: Path):
    # The installed copy first; the checkout for tests.import_contracts (the custom contract types).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed_tree), str(REPO)])}
    result = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "--no-cache",
         "--config", str(REPO / "pyproject.toml"), "--contract", contract],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, f"contract {contract} broken:\n{result.stdout}{result.stderr}"


def test_module_level_forbidden_counts_only_imports_that_run_on_import(tmp_path: Path):
    package = tmp_path / "demo"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "heavy.py").write_text("")
    (package / "light.py").write_text("import os\n")
    (package / "parse.py").write_text(
        "from demo import light\n\n\ndef run():\n    from demo import heavy\n")
    (package / "eager.py").write_text("try:\n    from demo import heavy\nexcept ImportError:\n"
                                      "    heavy = None\n")
    config = tmp_path / "contracts.toml"
    config.write_text(
        '[tool.importlinter]\nroot_packages = ["demo"]\n'
        'contract_types = ["module_level_forbidden: '
        'tests.import_contracts.ModuleLevelForbiddenContract"]\n'
        + "".join(
            f'[[tool.importlinter.contracts]]\nid = "{source}"\nname = "{source}"\n'
            f'type = "module_level_forbidden"\nsource_modules = ["demo.{source}"]\n'
            'forbidden_modules = ["demo.heavy"]\n'
            for source in ("parse", "eager")))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}

    def lint(contract: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(Path(sys.executable).with_name("lint-imports")), "--no-cache",
             "--config", str(config), "--contract", contract],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)

    parse = lint("parse")
    assert parse.returncode == 0, parse.stdout
    eager = lint("eager")
    assert eager.returncode == 1 and "demo.eager -> demo.heavy" in eager.stdout, eager.stdout
