"""make ui-test's report (a pytest plugin: -p tools.pytest_ui_report): every notebook's times, printed
once after the run and saved to runs/ui/timings.txt. Each test records its line (record_property),
which reaches the process that prints the summary also when pytest-xdist runs the notebooks side by
side. Not a tests/ui/conftest.py: a second module named conftest would shadow tests/conftest.py for
the tests that import from it."""

from __future__ import annotations

import os
from pathlib import Path

TIMINGS = Path(__file__).resolve().parents[1] / "runs" / "ui" / "timings.txt"  # the course folder's


def pytest_terminal_summary(terminalreporter, config) -> None:
    reports = terminalreporter.getreports("passed") + terminalreporter.getreports("failed")
    lines = sorted(value for report in reports for key, value in report.user_properties if key == "ui")
    if not lines:
        return
    at_once = getattr(config.option, "numprocesses", None) or 1
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [f"[ui] in JupyterLab (Chromium) on {os.cpu_count()} cores, {at_once} notebook(s) at a time, "
             f"load average now {load}; per notebook: open = page load + kernel start, run = Clear Outputs + "
             f"Run All until idle"] + [f"[ui]   {line}" for line in lines]
    TIMINGS.parent.mkdir(parents=True, exist_ok=True)
    TIMINGS.write_text("\n".join(lines) + "\n")
    terminalreporter.write_line("")
    for line in lines:
        terminalreporter.write_line(line)
