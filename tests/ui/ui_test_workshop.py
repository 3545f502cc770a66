"""The workshop in a real browser: JupyterLab driven by Playwright in Debian's Chromium.

What a participant does, done by a robot: open a chapter notebook in JupyterLab, clear its
outputs, Run > Run All Cells, wait for the kernel to go idle, then look at the page. For every
notebook in chapters/ this asserts:

  1. no cell ended in an error (an exception in a cell, or a traceback inside a widget's output);
  2. every ipywidgets output renders as a control (the widget extension is loaded, none says
     "Error displaying widget", none is stuck on "Loading widget...");
  3. in notebooks with sliders (the ring step-through, the sampler shards): every slider moves
     (one keyboard step on its handle) without an error, and in every cell with sliders moving
     them changes the figure beside it.

Run it with `make ui-test` (it is not part of `make test`: a browser run of every chapter takes
minutes). `make ui-test NB=path/to/copy.ipynb` tests other notebooks (a broken copy, say) in
place of chapters/*.ipynb. The file name does not match pytest's test_*.py on purpose, so that
`pytest tests` never collects it.

Nothing here touches the committed notebooks: JupyterLab serves a temporary copy of the course
(chapters copied, everything else linked), with autosave off, and is always stopped.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ringside.launch import ROOT, free_port  # noqa: E402

CHROMIUM = os.environ.get("RINGSIDE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SERVER_START_TIMEOUT = 90   # s; JupyterLab takes 10-30 s to start on a busy 2-core box
PAGE_TIMEOUT = 120          # s; loading the JupyterLab page and starting a kernel
RUN_ALL_TIMEOUT = 600       # s; one notebook's Run All (written for ~40 s; 3 min seen on a loaded box)
SLIDER_TIMEOUT = 30         # s; one slider move redrawing its figure
SCREENSHOTS = ROOT / "runs" / "ui"   # a failing notebook's page is saved here (git-ignored)

TRACEBACK = "Traceback (most recent call last)"


def chapter_notebooks() -> list[Path]:
    """NB="a.ipynb b.ipynb" (from `make ui-test NB=...`) or every chapters/NN_*.ipynb."""
    chosen = os.environ.get("NB", "").split()
    paths = [Path(p).resolve() for p in chosen] or sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
    return paths


NOTEBOOKS = chapter_notebooks()


# --- The JupyterLab server ------------------------------------------------------------------------

def course_copy(tmp: Path, notebooks: list[Path]) -> Path:
    """A copy of the course for JupyterLab to serve: chapters/ holds copies of the notebooks
    under test (so Run All never writes into the repository); everything else is a link."""
    course = tmp / "course"
    (course / "chapters").mkdir(parents=True)
    for entry in ROOT.iterdir():
        if entry.name not in {"chapters", ".git", ".venv", "runs"}:
            (course / entry.name).symlink_to(entry)
    if (ROOT / "chapters").is_dir():
        for entry in (ROOT / "chapters").iterdir():
            if entry.suffix != ".ipynb" and not entry.name.startswith("."):
                (course / "chapters" / entry.name).symlink_to(entry)
    for nb in notebooks:
        shutil.copy(nb, course / "chapters" / nb.name)
    return course


def lab_settings(settings_dir: Path) -> None:
    """User settings for the test's JupyterLab: every cell in the DOM (no virtual scrolling, so
    the checks see all outputs), no autosave, no news or update pop-ups over the page."""
    wanted = {
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
        "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
        "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    }
    for name, values in wanted.items():
        path = settings_dir / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


def api(base: str, token: str, path: str, method: str = "GET"):
    request = urllib.request.Request(f"{base}{path}", method=method,
                                     headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        body = response.read()
    return json.loads(body) if body else None


class Lab:
    """A JupyterLab server on 127.0.0.1, a free port and a random token; always stopped."""

    def __init__(self, tmp: Path, notebooks: list[Path]):
        self.root = course_copy(tmp, notebooks)
        self.token = secrets.token_hex(16)
        self.log_path = tmp / "jupyterlab.log"
        env = dict(os.environ,
                   OMP_NUM_THREADS="1",                       # one thread per rank
                   JUPYTER_CONFIG_DIR=str(tmp / "config"),    # no personal config (passwords...)
                   JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
                   JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
                   JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
                   IPYTHONDIR=str(tmp / "ipython"))           # no personal startup scripts
        lab_settings(tmp / "settings")
        for attempt in range(3):  # a free port can be taken between choosing and binding it
            self.port = free_port()
            self.base = f"http://127.0.0.1:{self.port}"
            self.log = open(self.log_path, "w")
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1",
                 f"--port={self.port}", "--port-retries=0", f"--IdentityProvider.token={self.token}",
                 f"--ServerApp.root_dir={self.root}", "--expose-app-in-browser",
                 *(["--allow-root"] if os.geteuid() == 0 else [])],  # CI containers run as root
                stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=self.root,
                start_new_session=True)
            if self.wait_ready():
                return
            self.stop()
            if "already in use" not in self.log_tail():
                break
        pytest.fail(f"JupyterLab did not start in {SERVER_START_TIMEOUT} s:\n{self.log_tail()}")

    def wait_ready(self) -> bool:
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                api(self.base, self.token, "/api/status")
                return True
            except OSError:
                time.sleep(0.5)
        return False

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def shutdown_kernels(self) -> None:
        """Shut down every kernel (and so the ranks it forked) between notebooks."""
        try:
            for session in api(self.base, self.token, "/api/sessions"):
                api(self.base, self.token, f"/api/sessions/{session['id']}", method="DELETE")
        except OSError:
            pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.shutdown_kernels()
            os.killpg(self.proc.pid, signal.SIGTERM)   # the server shuts its kernels down
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    server = Lab(tmp_path_factory.mktemp("workshop"), NOTEBOOKS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"no Chromium at {CHROMIUM}: install Debian's (apt-get install -y chromium); "
                    "Playwright's own browser download is not used")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                              headless=True, timeout=60_000)
        yield chromium
        chromium.close()


# --- What runs in the page ------------------------------------------------------------------------

# The open notebook panel; JupyterLab exposes its app as window.jupyterapp (--expose-app-in-browser).
PANEL = "(() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;" \
        " return w && w.content && w.sessionContext ? w : null; })()"

KERNEL_READY = f"""(name) => {{
  const w = {PANEL};
  return !!(w && w.context.path.endsWith(name) && w.context.isReady &&
            w.sessionContext.session && w.sessionContext.session.kernel &&
            w.sessionContext.session.kernel.status === 'idle');
}}"""

# Done when the kernel is idle, no prompt shows [*], and every non-empty code cell has run
# (or one cell failed: Run All stops there).
RUN_FINISHED = f"""() => {{
  const w = {PANEL};
  if (!w || !w.sessionContext.session || !w.sessionContext.session.kernel) return false;
  if (w.sessionContext.session.kernel.status !== 'idle') return false;
  const cells = w.content.widgets.filter(c => c.model.type === 'code');
  if (cells.some(c => (c.promptNode ? c.promptNode.textContent : '').includes('*'))) return false;
  const failed = cells.some(c => c.model.outputs.toJSON().some(o => o.output_type === 'error'));
  const pending = cells.filter(c => c.model.sharedModel.getSource().trim() && c.model.executionCount === null);
  return failed || pending.length === 0;
}}"""

# One record per code cell: what the kernel sent (model) and what the page shows (DOM).
CELL_REPORT = f"""() => {{
  const w = {PANEL};
  const widgetMime = 'application/vnd.jupyter.widget-view+json';
  return w.content.widgets.map((c, index) => {{
    if (c.model.type !== 'code') return null;
    const outputs = c.model.outputs.toJSON();
    const node = c.node;
    // the cell's own outputs (not those inside an Output widget); a widget view has no mime attribute
    const top = [...node.querySelectorAll('.jp-Cell-outputArea > .jp-OutputArea-child > .jp-OutputArea-output')];
    const rendered = top.filter(e => e.firstElementChild && e.firstElementChild.classList.contains('jupyter-widgets'));
    const closed = top.filter(e => !e.hasAttribute('data-mime-type') && !e.firstElementChild);
    // innermost outputs only: a widget's Output sits inside the cell's own output
    const texts = [...node.querySelectorAll('.jp-OutputArea-output')]
      .filter(e => !e.querySelector('.jp-OutputArea-output')).map(e => e.innerText);
    return {{
      index,
      source: c.model.sharedModel.getSource().split('\\n')[0].slice(0, 80),
      executed: c.model.executionCount !== null,
      empty: !c.model.sharedModel.getSource().trim(),
      errors: outputs.filter(o => o.output_type === 'error').map(o => `${{o.ename}}: ${{o.evalue}}`),
      widgetOutputs: outputs.filter(o => o.data && o.data[widgetMime]).length,
      widgetsRendered: rendered.length,
      widgetsClosed: closed.length,
      // the controls a participant sees and uses (boxes, labels and outputs are not counted)
      controls: node.querySelectorAll('.jupyter-widgets:not(.widget-container):not(.widget-box)' +
        ':not(.widget-output):not(.widget-html):not(.widget-label)').length,
      sliders: node.querySelectorAll('.jupyter-widgets.widget-slider').length,
      widgetErrors: texts.filter(t => t.includes('Error displaying widget')).length,
      loading: texts.filter(t => t.includes('Loading widget')).length,
      tracebacks: texts.filter(t => t.includes({json.dumps(TRACEBACK)})).map(t => t.slice(-400)),
    }};
  }}).filter(r => r !== null);
}}"""

# What a slider's figure looks like now: the widget's output area (interact's Output widget),
# images included, with the controls themselves (whose readouts move) left out.
FIGURE = """(index) => {
  const w = window.jupyterapp.shell.currentWidget;
  const node = w.content.widgets[index].node;
  let roots = [...node.querySelectorAll('.widget-output')];
  if (!roots.length) {
    const area = node.querySelector('.jp-Cell-outputArea').cloneNode(true);
    area.querySelectorAll('.widget-slider, .widget-readout, .widget-label').forEach(e => e.remove());
    roots = [area];
  }
  // what is drawn (images, SVG, text), not the markup around it (which changes on every redraw)
  return roots.map(r => [...r.querySelectorAll('img')].map(i => i.src).join('|') + '#' +
    [...r.querySelectorAll('svg')].map(v => v.outerHTML).join('|') + '#' + r.textContent).join('\\n');
}"""


def menu(page, top: str, item: str) -> None:
    """Click a menu of JupyterLab's menu bar, as a participant does."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{top}$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$")).click()


def wait_for(page, script: str, arg=None, timeout: float = 30) -> bool:
    try:
        page.wait_for_function(script, arg=arg, timeout=timeout * 1000, polling=500)
        return True
    except Exception:  # playwright's TimeoutError
        return False


def move_slider(page, slider) -> tuple[str, str]:
    """One step of a slider with the keyboard (noUiSlider's handle); returns readout before/after."""
    handle = slider.locator(".noUi-handle").first
    readout = slider.locator(".widget-readout").first
    before = readout.inner_text() if readout.count() else ""
    at_max = handle.get_attribute("aria-valuenow") == handle.get_attribute("aria-valuemax")
    handle.focus()
    handle.press("ArrowLeft" if at_max else "ArrowRight")
    page.wait_for_timeout(300)
    after = readout.inner_text() if readout.count() else ""
    return before, after


def redrawn(page, cell_index: int, old: str) -> bool:
    """Has the figure settled on something other than `old`? A redraw passes through a cleared
    output, so only a figure that differs and then stays the same, with the kernel idle, counts."""
    deadline = time.monotonic() + SLIDER_TIMEOUT
    while time.monotonic() < deadline:
        page.wait_for_timeout(500)
        now = page.evaluate(FIGURE, cell_index)
        if now == old:
            continue
        page.wait_for_timeout(1000)
        if page.evaluate(FIGURE, cell_index) == now and page.evaluate(RUN_FINISHED):
            return True
    return False


def try_sliders(page, cell_index: int) -> tuple[list[str], list[str]]:
    """Move each slider of one cell; the figure must change for at least one.
    Returns (failures, the moves that changed the figure)."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(cell_index)
    sliders = cell.locator(".jupyter-widgets.widget-slider")
    moved, changed, failures = [], [], []
    for k in range(sliders.count()):
        slider = sliders.nth(k)
        label = slider.locator(".widget-label").first.inner_text().strip() or f"slider {k + 1}"
        slider.scroll_into_view_if_needed()
        figure = page.evaluate(FIGURE, cell_index)
        before, after = move_slider(page, slider)
        if before == after:
            failures.append(f"cell {cell_index + 1}: slider '{label}' did not move ({before})")
            continue
        moved.append(label)
        figure_changed = redrawn(page, cell_index, figure)
        tracebacks = [r for r in page.evaluate(CELL_REPORT) if r["index"] == cell_index][0]["tracebacks"]
        if tracebacks:
            failures.append(f"cell {cell_index + 1}: moving '{label}' {before}->{after} raised:\n{tracebacks[0]}")
        elif figure_changed:
            changed.append(f"{label} {before}->{after}")
    if moved and not changed and not failures:
        failures.append(f"cell {cell_index + 1}: moving {', '.join(moved)} did not change the figure "
                        f"in {SLIDER_TIMEOUT} s (is the callback drawing anything?)")
    return failures, changed


# --- The test -------------------------------------------------------------------------------------

@pytest.mark.timeout(PAGE_TIMEOUT + RUN_ALL_TIMEOUT + 240)
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_in_jupyterlab(notebook: Path, lab: Lab, browser, record_property):
    name = notebook.name
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(30_000)
    console_errors: list[str] = []
    page.on("pageerror", lambda exc: console_errors.append(str(exc)))
    try:
        # a fresh workspace per notebook: nothing restored from the previous one
        start = time.monotonic()
        page.goto(f"{lab.base}/lab/workspaces/ui-{notebook.stem}/tree/chapters/{name}?token={lab.token}",
                  timeout=PAGE_TIMEOUT * 1000)
        assert wait_for(page, KERNEL_READY, name, timeout=PAGE_TIMEOUT), (
            f"{name}: the notebook did not open with an idle kernel in {PAGE_TIMEOUT} s\n{lab.log_tail()}")
        opened = time.monotonic() - start

        menu(page, "Edit", "Clear Outputs of All Cells")
        start = time.monotonic()
        menu(page, "Run", "Run All Cells")
        finished = wait_for(page, RUN_FINISHED, timeout=RUN_ALL_TIMEOUT)
        seconds = time.monotonic() - start
        assert finished, f"{name}: Run All still running after {RUN_ALL_TIMEOUT} s (a hang?)"
        # widgets render asynchronously: give "Loading widget..." a moment to go
        wait_for(page, "() => ![...document.querySelectorAll('.jp-Notebook .jp-OutputArea-output')]"
                       ".some(e => e.innerText.includes('Loading widget'))", timeout=20)
        cells = page.evaluate(CELL_REPORT)

        problems = []
        for c in cells:
            where = f"cell {c['index'] + 1} ({c['source']!r})"  # numbered as JupyterLab does
            problems += [f"{where}: {e}" for e in c["errors"]]
            if not c["errors"]:
                problems += [f"{where}: traceback in its output:\n{t}" for t in c["tracebacks"]]
            if not c["executed"] and not c["empty"] and not any(x["errors"] for x in cells):
                problems.append(f"{where}: never ran")
            # a widget closed by its own code (tqdm's leave=False) leaves an empty output: not a failure
            if c["widgetOutputs"] > c["widgetsRendered"] + c["widgetsClosed"]:
                problems.append(f"{where}: {c['widgetOutputs']} widget outputs but {c['widgetsRendered']} "
                                "rendered as widgets (is the ipywidgets lab extension missing?)")
            if c["widgetErrors"]:
                problems.append(f"{where}: 'Error displaying widget' (widget model missing or failed)")
            if c["loading"]:
                problems.append(f"{where}: a widget still says 'Loading widget...'")

        # sliders are tried in every widget cell that ran cleanly, even if a later cell failed
        slider_cells = [c["index"] for c in cells if c["sliders"]]
        redraws, bad = [], [c["index"] for c in cells if c["errors"] or c["tracebacks"]
                            or c["widgetErrors"] or c["loading"]]
        for index in slider_cells:
            cell = next(c for c in cells if c["index"] == index)
            if cell["executed"] and not cell["errors"] and not cell["tracebacks"]:
                failures, changed = try_sliders(page, index)
                problems += failures
                bad += [index] if failures else []
                redraws += [f"cell {index + 1}: {move}" for move in changed]

        controls = sum(c["controls"] for c in cells)
        # reported at the end by tools/pytest_ui_report.py (also from pytest-xdist's workers)
        record_property("ui", f"{name}: open {opened:.0f} s, run {seconds:.0f} s, {len(cells)} code cells, "
                              f"{controls} widget controls, {len(slider_cells)} slider cells"
                              + (f" (figure redrawn: {'; '.join(redraws)})" if redraws else "")
                              + (" - FAILED" if problems else ""))
        if problems:
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            if bad:  # show the first cell that went wrong
                page.locator(".jp-Notebook .jp-Cell").nth(min(bad)).scroll_into_view_if_needed()
            page.screenshot(path=str(SCREENSHOTS / f"{notebook.stem}.png"), full_page=True)
        assert not problems, (f"{name} in JupyterLab ({SCREENSHOTS / notebook.stem}.png):\n  "
                              + "\n  ".join(problems)
                              + ("\n  page errors: " + "; ".join(console_errors[:5]) if console_errors else ""))
    finally:
        context.close()
        lab.shutdown_kernels()
