"""core.atomic: what a killed writer leaves is recognised and cleared by the next writer of the same path."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

from helpers.config import REPO

from core.atomic import remove_stale_temporaries, staging_directory

KILLED_MID_WRITE = """
import os, signal, sys
from core.atomic import staging_directory
staging = staging_directory(sys.argv[1])
(staging / "model.safetensors").write_bytes(b"half of it")
print(staging, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_writer_killed_mid_write_leaves_a_staging_tree_that_the_next_one_removes(tmp_path):
    final = tmp_path / "hf_model"
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_WRITE, str(final)], cwd=REPO, env={
        **os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
    assert killed.returncode == -signal.SIGKILL
    leftover = tmp_path / killed.stdout.strip().rsplit("/", 1)[-1]
    assert leftover.is_dir() and leftover.name.startswith(".hf_model.tmp-")
    staging = staging_directory(final)
    assert not leftover.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [staging.name]


def test_only_a_gone_writer_of_this_host_loses_its_temporaries(tmp_path):
    final = tmp_path / "out.json"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = socket.gethostname()
    names = {
        "gone file": f".out.json.tmp-{host}-{gone.pid}-0123abcd",
        "gone dir": f".out.json.tmp-{host}-{gone.pid}-89abcdef",
        "running": f".out.json.tmp-{host}-{os.getpid()}-0123abcd",
        "another host": f".out.json.tmp-elsewhere.example-{gone.pid}-0123abcd",
        "not ours": ".out.json.tmp-notes",
        "another path": f".out.json2.tmp-{host}-{gone.pid}-0123abcd",
    }
    for label, name in names.items():
        if label == "gone dir":
            (tmp_path / name).mkdir()
            (tmp_path / name / "part").write_text("x")
        else:
            (tmp_path / name).write_text(label)
    removed = remove_stale_temporaries(final)
    assert sorted(p.name for p in removed) == sorted([names["gone file"], names["gone dir"]])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        names[label] for label in ("running", "another host", "not ours", "another path"))
