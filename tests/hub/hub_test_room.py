"""A workshop room for real: `make hub`, then K learners in Chromium at the same time.

Each learner, in a browser context of their own, all at once:
  1. logs in at /hub/login with the workshop password and gets their own JupyterLab;
  2. opens chapters/00_setup.ipynb in their clone (~/ringside) and runs it (Run All): no cell fails;
  3. in a JupyterLab terminal, runs `make lab CH=00 NPROC=2` (the solution copied over the lab:
     the lab's check must PASS) and, in the same terminal, tries to read another learner's home.
Then the instructor's table (`make room`'s source) must show every learner's PASS of lab 00, and
`make hub-down` must leave no user, cgroup, file or process behind.

Run with `make hub-test` (root; HUB_LEARNERS=K, default 4). `make hub-test SPAWNER=slurm`
(HUB_SPAWNER=slurm) runs the same room with each learner's server a Slurm job (batchspawner), on a
one-node Slurm started for it (tools/slurm_node.py, the one tests/test_slurm.py starts) that bounds
each job in cgroups of its own (--cpus-per-task, --mem). The file name does not match pytest's
test_*.py on purpose, so that `pytest tests` never collects it. The measured times go to
runs/hub/room.txt: how long K learners took, which `docs/INSTRUCTORS.md` quotes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tools import hub, hub_memory, slurm_node  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "ui"))
from ui_test_workshop import CHROMIUM, CHROMIUM_ARGS, KERNEL_READY, RUN_FINISHED  # noqa: E402

K = int(os.environ.get("HUB_LEARNERS", "4"))
SPAWNER = os.environ.get("HUB_SPAWNER") or "local"
SLURM_DIR = Path("/srv/ringside-slurm-room-test")  # the learners' jobs read its slurm.conf: not under /tmp/pytest-of-root
LEARNERS = [f"room{i + 1}" for i in range(K)]
PASSWORD = "ringside-room-test"
PORT = int(os.environ.get("HUB_PORT", "8000"))
BASE = f"http://127.0.0.1:{PORT}"
OUT = ROOT / "runs" / "hub"
# Seconds. Everyone does the same thing at once on a box of few cores, so each step's wait grows with
# K: the measured times (docs/INSTRUCTORS.md) grow about as K / cores; the floors are the 4-learner ones.
LOGIN_TIMEOUT = max(300, 30 * K)     # K servers spawning at once
KERNEL_TIMEOUT = max(180, 20 * K)    # the notebook's kernel (and its rank starter) importing torch
RUN_ALL_TIMEOUT = max(600, 60 * K)   # chapter 00 while K-1 others run it too
LAB_TIMEOUT = max(300, 20 * K)       # `make lab CH=00 NPROC=2` in the terminal

pytestmark = [pytest.mark.skipif(hub.why_not() is not None, reason=hub.why_not() or ""),
              pytest.mark.skipif(SPAWNER == "slurm" and slurm_node.why_not() is not None,
                                 reason=f"SPAWNER=slurm: {slurm_node.why_not()}")]

# The terminal's output, collected in the page: a terminal session of the learner's own server,
# started through JupyterLab's service manager, fed one command, read until a marker line.
TERMINAL_RUN = """async ([command, marker, timeout]) => {
  const terminals = window.jupyterapp.serviceManager.terminals;
  const session = await terminals.startNew();
  let out = '';
  session.messageReceived.connect((_, msg) => { if (msg.type === 'stdout') out += msg.content[0]; });
  session.send({type: 'stdin', content: [command + '; echo ' + marker + '$?\\r']});
  const start = Date.now();
  while (!new RegExp(marker + '\\\\d+').test(out) && Date.now() - start < timeout * 1000) {
    await new Promise(r => setTimeout(r, 500));
  }
  await session.shutdown();
  return out;
}"""


OPENED: list[str] = []  # the folders the room opened to learners (o+x): closed again by hub.down()


@pytest.fixture(scope="module")
def room():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"no Chromium at {CHROMIUM}: apt-get install -y chromium")
    hub.down()
    # e.g. /root, where this machine's Python lives: passage only; hub.down() (or, after an
    # interrupted run, make hub-down) puts the modes back
    OPENED[:] = hub.closed_to_learners(Path(sys.executable))
    hub.open_passage(OPENED)
    with one_node_slurm() as slurm:
        try:
            yield hub.up(LEARNERS, PASSWORD, PORT, hub.LIMITS, SPAWNER, slurm)
        finally:
            hub.down()


def keep_hub_log() -> None:
    """The hub's log (the learners' servers log there too), kept in runs/hub/: down() removes the hub's."""
    log = hub.HUB_DIR / "state" / "hub.log"
    if log.exists():
        OUT.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, OUT / "hub.log")


@contextlib.contextmanager
def one_node_slurm():
    """SPAWNER=slurm: a one-node Slurm for the room, its settings for the hub; else nothing (None)."""
    if SPAWNER != "slurm":
        yield None
        return
    shutil.rmtree(SLURM_DIR, ignore_errors=True)
    cluster = slurm_node.Cluster(SLURM_DIR, cgroups=True, share=K)
    try:
        SLURM_DIR.mkdir(mode=0o755, parents=True)
        cluster.start()
        os.environ["SLURM_CONF"] = cluster.env["SLURM_CONF"]  # what the hub's sinfo and sbatch read
        yield hub.slurm_settings(partition="test", time_limit="30")
    finally:
        os.environ.pop("SLURM_CONF", None)
        cluster.stop()
        shutil.rmtree(SLURM_DIR, ignore_errors=True)


async def learner(browser, name: str, times: dict) -> list[str]:
    """One learner's session; the problems seen (empty: all went well)."""
    problems = []
    context = await browser.new_context(viewport={"width": 1300, "height": 900})
    page = await context.new_page()
    page.set_default_timeout(60_000)
    try:
        start = time.monotonic()
        await page.goto(f"{BASE}/hub/login", timeout=120_000)
        await page.fill("input[name=username]", name)
        await page.fill("input[name=password]", PASSWORD)
        await page.click("input[type=submit], button[type=submit]")
        await page.wait_for_url(f"**/user/{name}/lab**", timeout=LOGIN_TIMEOUT * 1000)
        times["login"] = time.monotonic() - start

        start = time.monotonic()
        await page.goto(f"{BASE}/user/{name}/lab/tree/ringside/chapters/00_setup.ipynb", timeout=120_000)
        await page.wait_for_function(KERNEL_READY, arg="00_setup.ipynb", timeout=KERNEL_TIMEOUT * 1000, polling=500)
        await page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        await page.wait_for_timeout(2000)
        await page.wait_for_function(RUN_FINISHED, timeout=RUN_ALL_TIMEOUT * 1000, polling=1000)
        errors = await page.evaluate("""() => {
          const w = window.jupyterapp.shell.currentWidget;
          return w.content.widgets.filter(c => c.model.type === 'code').flatMap(c =>
            c.model.outputs.toJSON().filter(o => o.output_type === 'error').map(o => o.ename + ': ' + o.evalue));
        }""")
        times["chapter 00"] = time.monotonic() - start
        problems += [f"{name}: chapter 00: {e}" for e in errors]

        start = time.monotonic()
        # the learner's own lab, finished by copying the solution over it, run from a terminal
        out = await page.evaluate(TERMINAL_RUN, ["cd ~/ringside && cp solutions/00_setup.py labs/00_setup.py"
                                                 " && make lab CH=00 NPROC=2", "LAB-EXIT-", LAB_TIMEOUT])
        times["lab 00"] = time.monotonic() - start
        if "LAB-EXIT-0" not in out or "PASS" not in out:
            problems.append(f"{name}: make lab CH=00 did not pass:\n{out[-1500:]}")
        other = LEARNERS[(LEARNERS.index(name) + 1) % len(LEARNERS)]
        out = await page.evaluate(TERMINAL_RUN, [f"ls /home/{other}/ringside", "PEEK-EXIT-", 60])
        if "PEEK-EXIT-0" in out or "Permission denied" not in out:
            problems.append(f"{name} could list {other}'s files:\n{out[-500:]}")
    except Exception as error:  # a timeout: say where, with the page as it was
        OUT.mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(OUT / f"{name}.png"))
        problems.append(f"{name}: {type(error).__name__}: {str(error)[:500]} (screenshot runs/hub/{name}.png)")
    finally:
        await context.close()
    return problems


async def whole_room() -> tuple[list[str], dict]:
    from playwright.async_api import async_playwright

    times = {name: {} for name in LEARNERS}
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            results = await asyncio.gather(*(learner(browser, name, times[name]) for name in LEARNERS))
        finally:
            await browser.close()
    return [p for r in results for p in r], times


@pytest.mark.timeout(LOGIN_TIMEOUT + RUN_ALL_TIMEOUT + 2 * LAB_TIMEOUT + 300)
def test_a_room_of_learners_at_once(room):
    start = time.monotonic()
    with hub_memory.Sampler(LEARNERS, hub.CGROUP_NAME, every=3 if K <= 8 else 5) as memory:
        problems, times = asyncio.run(whole_room())
    total = time.monotonic() - start
    keep_hub_log()
    from ringside import progress

    table = progress.latest(Path(room["progress"]))
    lines = [f"{K} learners at once ({SPAWNER} spawner) on {os.cpu_count()} cores ({hub.LIMITS['cpus']:g} CPU, "
             f"{hub.LIMITS['memory_gb']:g} GB each): {total:.0f} s in all, load now "
             + ", ".join(f"{x:.1f}" for x in os.getloadavg())]
    lines += [f"  {name}: " + ", ".join(f"{k} {v:.0f} s" for k, v in t.items()) for name, t in times.items()]
    lines += ["", memory.report(), "", progress.render(table, details=True)]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "room.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    for name in LEARNERS:
        got = table.get(name, {}).get("00")
        if not got or got["verdict"] != "PASS":
            problems.append(f"the instructor's table has no PASS of lab 00 for {name}: {got}")
    assert not problems, "\n".join(problems)


def test_hub_down_leaves_nothing(room):
    """Runs after the room (file order); the fixture's own teardown runs down() once more."""
    hub.down()
    assert hub.leftovers() == [], hub.leftovers()
    assert hub.closed_to_learners(Path(sys.executable)) == OPENED, "a folder opened for the room stayed open"
    assert not any(line.split(":")[0] in LEARNERS for line in Path("/etc/passwd").read_text().splitlines())
