"""Bundle files kept per kind (kvobs/bundles.py): requested bundles pruned per engine, failures' all together,
temporary files a dead process left behind deleted once stale, names that kvobs does not write left alone."""

from __future__ import annotations

import os
import time
from pathlib import Path

from kvobs.bundles import BUNDLE_SUFFIX, MAX_BUNDLES, STALE_TEMP_S, bundle_engine, bundle_files, keep_bundles
from kvobs.files import private_dir
from kvobs.wire.format import report_name


def make(folder: Path, engine: str, n: int) -> Path:
    path = folder / report_name(1_767_225_600 + n, engine, 4242, n, suffix=BUNDLE_SUFFIX)
    path.write_bytes(b"zip")
    return path


def test_requested_bundles_are_pruned_per_engine_and_failures_all_together(tmp_path: Path) -> None:
    for n in range(MAX_BUNDLES + 2):
        make(tmp_path, "dp-0", n)  # an engine label may hold '-'
        make(tmp_path, "1", 100 + n)
    assert {bundle_engine(p) for p in bundle_files(tmp_path)} == {"dp-0", "1"}
    keep_bundles(tmp_path, "dp-0")
    engines = [bundle_engine(p) for p in bundle_files(tmp_path)]
    assert engines.count("dp-0") == MAX_BUNDLES and engines.count("1") == MAX_BUNDLES + 2
    keep_bundles(tmp_path)
    assert [bundle_engine(p) for p in bundle_files(tmp_path)] == ["1"] * MAX_BUNDLES  # the newest four


def test_a_dead_writers_temporary_file_goes_once_stale_and_foreign_files_stay(tmp_path: Path) -> None:
    stale, fresh = tmp_path / f".a{BUNDLE_SUFFIX}.tmp", tmp_path / f".b{BUNDLE_SUFFIX}.tmp"
    foreign = tmp_path / f"notes{BUNDLE_SUFFIX}"
    for path in (stale, fresh, foreign):
        path.write_bytes(b"x")
    old = time.time() - STALE_TEMP_S - 5
    os.utime(stale, (old, old))
    os.utime(foreign, (old, old))
    keep_bundles(tmp_path)
    assert not stale.exists() and fresh.exists() and foreign.exists()
    assert bundle_files(tmp_path) == []  # a name kvobs does not write is no bundle


def test_private_dir_makes_every_missing_folder_private(tmp_path: Path) -> None:
    mask = os.umask(0)
    try:
        private_dir(tmp_path / "kvobs" / "replay" / "requests")
    finally:
        os.umask(mask)
    for folder in ("kvobs", "kvobs/replay", "kvobs/replay/requests"):
        assert (tmp_path / folder).stat().st_mode & 0o777 == 0o700, folder
