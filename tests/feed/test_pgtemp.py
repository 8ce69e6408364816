"""The throwaway PostgreSQL of ``demo --postgres`` leaves no cluster folder behind, also
when it fails to start."""

import os
import tempfile

import pytest

import feed.demo.pgtemp as pgtemp
from protocol import SourceError


def test_a_cluster_that_fails_to_start_leaves_no_folder(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    initdb = bin_dir / "initdb"
    initdb.write_text("#!/bin/sh\necho 'initdb: could not create directory' >&2\nexit 1\n")
    initdb.chmod(0o755)
    (bin_dir / "pg_ctl").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "pg_ctl").chmod(0o755)
    monkeypatch.setattr(pgtemp, "find_pg_bin", lambda: str(bin_dir))
    if os.geteuid() == 0:  # (as root the folder is handed to the postgres user first)
        monkeypatch.setattr(pgtemp.shutil, "chown", lambda *a, **k: None)
        monkeypatch.setattr(pgtemp.TempPostgres, "_run", staticmethod(_without_runuser))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    pg = pgtemp.TempPostgres()
    with pytest.raises(SourceError, match="initdb failed: initdb: could not create directory"):
        pg.start()
    assert list(scratch.iterdir()) == []
    assert pg.root == ""
    pg.stop()  # a second stop does nothing


_run = pgtemp.TempPostgres._run


def _without_runuser(cmd, what):
    return _run(cmd[cmd.index("--") + 1 :] if "--" in cmd else cmd, what)
