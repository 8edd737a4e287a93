"""benchmarks.optim.slamb_step: every variant timed against LAMB, and the row traffic SLAMB adds, in one run."""

from __future__ import annotations

import re

from benchmarks.optim import slamb_step


def test_every_variant_has_a_row_and_the_bound_is_lambs_step_plus_three_gathers_and_two_scatters(capsys):
    slamb_step.main(["--size", "tiny", "--repeats", "1", "--warmup", "0"])
    out = capsys.readouterr().out
    for label in (slamb_step.REFERENCE, *slamb_step.VARIANTS):
        assert re.search(rf"^{re.escape(label)}\s+[\d.]+", out, re.MULTILINE), label
    gather, scatter, lamb, added = map(float, re.search(
        r"gather of a tenth of the rows of 16 ([\d.]+), scatter ([\d.]+); LAMB's best step ([\d.]+); "
        r"SLAMB's adds 3 gathers and 2 scatters: ([\d.]+)", out).groups())
    assert min(gather, scatter, lamb) > 0
    assert abs(added - (3 * gather + 2 * scatter)) <= 0.1
    bound, best, median = map(float, re.search(
        r"bound, LAMB's step plus that row traffic: ([\d.]+)x LAMB's best step; .*'s step over it: best ([\d.]+)x, "
        r"median ([\d.]+)x", out).groups())
    assert abs(bound - (lamb + added) / lamb) <= 0.02 and min(best, median) > 0

