"""`train.subprocess_stage`: a stop signal reaches the running stage, which finishes its work before the command
reports the stop; overrides built from paths and names read back as the same strings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from train.subprocess_stage import StageStopped, override, run_stage, stage_stops_exit

# A stage that saves its work when stopped: it waits for SIGINT / SIGTERM, then takes a while to write its file.
STAGE = """
import signal, sys, time
from pathlib import Path
stopped = []
for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, lambda signum, frame: stopped.append(signum))
Path(sys.argv[1]).with_suffix(".started").write_text("")
while not stopped:
    time.sleep(0.01)
time.sleep(0.5)  # longer than subprocess.run's 0.25 s grace before its SIGKILL
Path(sys.argv[1]).write_text(signal.Signals(stopped[0]).name)
"""


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stop_signal_is_passed_on_and_the_stage_finishes_its_work(tmp_path, capsys, signum, code):
    saved = tmp_path / "checkpoint"

    def stop_when_started() -> None:
        while not saved.with_suffix(".started").exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signum)  # what Ctrl-C or a scheduler does to the command

    before = signal.getsignal(signal.SIGINT)
    threading.Thread(target=stop_when_started, daemon=True).start()
    with pytest.raises(SystemExit) as info, stage_stops_exit():
        run_stage([sys.executable, "-c", STAGE, str(saved)], "stage one")
    assert info.value.code == code
    assert saved.read_text() == signal.Signals(signum).name  # the stage got the signal once and saved its work
    assert capsys.readouterr().err == (f"stopped by {signal.Signals(signum).name} during stage one; rerun the same "
                                       "command to resume it\n")
    assert signal.getsignal(signal.SIGINT) is before  # the command's handlers are back


def test_a_finished_stage_returns_its_result():
    result = run_stage([sys.executable, "-c", "print('hi'); raise SystemExit(3)"], "stage", stdout=subprocess.PIPE,
                       text=True)
    assert (result.returncode, result.stdout) == (3, "hi\n")
    assert StageStopped(signal.SIGTERM, "x").exit_code == 143


@pytest.mark.parametrize("value", ["runs/bert_large_phase1", "runs/my run", "runs/résumé", "it's", "a\\b", "a\\",
                                   "x,y", "${oc.env:HOME}", "/tmp/p-1/x_y+z@w:1"])
def test_an_override_reads_back_as_the_same_string(value):
    assert OverridesParser.create().parse_override(override("name", value)).value() == value
