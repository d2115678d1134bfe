"""The wheel test's dependency placement reads this environment's site-packages, not whatever
``sys.path`` holds after other tests imported packages that vendor copies of others."""

from __future__ import annotations

import importlib.metadata as metadata
import sysconfig
from pathlib import Path

from packaging.requirements import Requirement

from tests.packaging.dependencies import dependency_closure


def test_a_vendored_copy_on_sys_path_is_not_taken_for_the_installed_distribution(
        tmp_path, monkeypatch):
    # What importing Ray does: ray/thirdparty_files (a psutil of the same version) goes first
    # on sys.path, and importlib.metadata then finds that copy.
    version = metadata.version("psutil")
    vendored = tmp_path / "thirdparty_files"
    info = vendored / f"psutil-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: psutil\nVersion: {version}\n")
    (info / "RECORD").write_text(f"psutil-{version}.dist-info/METADATA,,\n")
    monkeypatch.syspath_prepend(str(vendored))
    assert Path(metadata.distribution("psutil")._path).parent == vendored  # the trap is set

    (psutil,) = dependency_closure([Requirement(f"psutil=={version}")])
    site = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    assert str(Path(psutil.locate_file(""))) in site
