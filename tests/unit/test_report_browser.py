"""The report in a real browser: headless chromium loads the page of a synthetic run and an overlay; no
script error may reach the console, and every overview panel must be drawn by plotly.js."""

import re
import shutil
import subprocess

import pytest

from tests.unit.report_runs import rl_run, sft_run
from verst.monitor.report import write_compare_report, write_report

pytestmark = pytest.mark.browser
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def load(page, profile) -> subprocess.Popen:
    """Chromium dumping the page's DOM after load; --enable-logging=stderr prints every console message
    (uncaught exceptions included) as a CONSOLE line. --no-sandbox: tests run as root in CI containers."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={profile}",
           "--enable-logging=stderr", "--v=0", "--window-size=1400,1000", "--dump-dom", page.as_uri()]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def overview_panels(dom: str) -> tuple[int, int]:
    """(overview panels, overview panels plotly drew) in a dumped DOM."""
    overview = dom.split('<section id="overview">', 1)[1].split("</section>", 1)[0]
    divs = re.findall(r'<div class="fig[^"]*" id="[^"]+"[^>]*>', overview)
    return len(divs), sum("js-plotly-plot" in d for d in divs)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (`make test` installs it)")
def test_reports_load_without_script_errors_and_draw_the_overview(tmp_path):
    sft = sft_run(tmp_path / "sft")
    rl = rl_run(tmp_path / "rl", model=str(sft / "hf"))
    write_report(sft)
    pages = [write_report(rl), write_compare_report([rl, rl_run(tmp_path / "async", steps=20)], tmp_path / "cmp.html")]
    # Both at once: each load parses ~5 MB of inline plotly.js.
    procs = [load(page, tmp_path / f"profile{i}") for i, page in enumerate(pages)]
    for page, proc in zip(pages, procs):
        dom, log = proc.communicate(timeout=60)
        console = [line for line in log.splitlines() if ":CONSOLE" in line]
        assert proc.returncode == 0, log[-2000:]
        assert console == [], f"{page.name}: {console}"
        panels, drawn = overview_panels(dom)
        assert panels >= 5 and drawn == panels, f"{page.name}: {drawn} of {panels} overview panels drawn"
        assert dom.count('class="main-svg"') >= panels
