"""Break each solution in a classic way; its check must fail and name the mistake."""

from __future__ import annotations

import pytest
from conftest import ROOT, launch
from mutation import args, mutations, slow, variants


def cases():
    for stem, rows in mutations().items():
        for m in rows:
            yield pytest.param(stem, m, id=f"{stem}-{m.name.replace(' ', '_')}",
                               marks=[pytest.mark.slow] if slow(stem) else [])


def run_changed(stem: str, old: str, new: str, nproc: int, folder):
    """The solution with `old` (which must occur once) replaced by `new`, run on `nproc` ranks."""
    source = (ROOT / "solutions" / f"{stem}.py").read_text()
    assert source.count(old) == 1, f"the text to change is not unique in {stem}.py: {old!r}"
    changed = folder / "solutions" / f"{stem}.py"
    changed.parent.mkdir()
    changed.write_text(source.replace(old, new))
    return launch(changed, nproc, *args(stem))


@pytest.mark.parametrize("stem, mutation", list(cases()))
def test_check_names_the_mistake(stem, mutation, tmp_path):
    result = run_changed(stem, mutation.old, mutation.new, mutation.nproc, tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode != 0, f"the check did not catch '{mutation.name}':\n{out[-3000:]}"
    assert "FAIL" in result.stdout, out[-3000:]
    assert mutation.diagnosis in result.stdout, f"expected '{mutation.diagnosis}' in:\n{out[-3000:]}"


@pytest.mark.parametrize("stem, variant", [pytest.param(stem, v, id=f"{stem}-{v.name.replace(' ', '_')}")
                                           for stem, rows in variants().items() for v in rows])
def test_check_passes_a_correct_variant(stem, variant, tmp_path):
    """A check that rejects right code written otherwise teaches the wrong lesson (REVIEW F: lab
    12 rejected `from torch.distributed import all_reduce`)."""
    result = run_changed(stem, variant.old, variant.new, variant.nproc, tmp_path)
    assert result.returncode == 0, f"the check rejected '{variant.name}':\n{(result.stdout + result.stderr)[-3000:]}"
