"""tools/test_cost.py (make test-cost): how a test's CPU-seconds are counted to a part of the suite, and
the budget table it holds them against (docs/AUTHORING.md)."""

from conftest import ROOT, solutions

from tools.test_cost import budgets, chapter_of


def test_each_test_counts_to_its_chapter_the_template_or_the_package():
    assert chapter_of("chapters/04_ring_allreduce.ipynb::Cell 3") == "04"
    assert chapter_of("tests/test_labs.py::test_solution_passes[11_capstone-3ranks]") == "11"
    assert chapter_of("tests/test_mutations.py::test_check_names_the_mistake[08_seeding-no_seed]") == "08"
    assert chapter_of("tests/test_11_capstone.py::test_resume") == "11"
    assert chapter_of("tests/test_slurm.py::test_requested_stops_save") == "template"
    assert chapter_of("tests/test_template.py::test_sigterm_at_any_moment") == "template"
    assert chapter_of("tests/test_ranks.py::test_a_deadlock_is_a_timeout") == "package"


def test_every_chapter_has_a_budget_and_the_suite_fits_in_480_s_on_2_cores():
    table = budgets(ROOT / "docs" / "AUTHORING.md")
    assert {p.stem[:2] for p in solutions()} <= set(table), "a chapter without a row in the budget table"
    assert {"template", "package"} <= set(table)
    assert sum(table.values()) <= 2 * 480, sum(table.values())
