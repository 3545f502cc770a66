"""pytest, for `make test`: each notebook's cells stay together on one pytest-xdist worker, and the
long tests start first, so that none of them is left running alone at the end."""


def pytest_collection_modifyitems(items):
    """Tests marked `slow` first, the heaviest (`slow(3)`) before the others (`slow` is `slow(1)`);
    a stable sort, so otherwise in collection order."""
    def weight(item) -> int:
        mark = item.get_closest_marker("slow")
        return 0 if mark is None else (mark.args[0] if mark.args else 1)

    items.sort(key=lambda item: -weight(item))


def pytest_xdist_make_scheduler(config, log):
    """A notebook's cells run in order in one kernel, so a notebook is one unit of work; so is
    tests/test_slurm.py, whose tests share one Slurm cluster and one time-limited job (split over two
    workers, each started a cluster and that 4-minute job of its own); every other test is a unit of
    its own and goes to whichever worker is free. Units with the most tests go first, so the
    notebooks (the longest units) start at once. (xdist's own --dist loadgroup would do this with
    marks, but under pytest 9 it no longer regroups tests.)"""
    from xdist.scheduler import LoadScopeScheduling

    together = (".ipynb", "test_slurm.py")

    class NotebooksTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path.endswith(together) else nodeid

    return NotebooksTogether(config, log)
