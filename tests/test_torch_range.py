"""The torch versions the course supports, as make setup checks them (tools/torch_range.py)."""

import tomllib

import torch

from conftest import ROOT
from tools.torch_range import NEWEST, OLDEST, supported


def test_the_range_is_inclusive_at_both_ends_and_ignores_local_tags():
    assert supported("2.11.0") and supported("2.11.0+cu130") and supported("2.12.1") and supported(NEWEST)
    assert not supported("2.10.9") and not supported("2.14.2") and not supported("2.15.0")


def test_this_torch_and_the_pin_are_in_the_range_and_every_file_states_the_same_range():
    assert supported(torch.__version__)
    pins = dict(line.split("==") for line in (ROOT / "requirements.txt").read_text().splitlines()
                if line.startswith("torch=="))
    assert pins["torch"] == NEWEST
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f"torch>={OLDEST},<={NEWEST}" in project["dependencies"]
    assert f"torch {OLDEST} to {NEWEST}" in (ROOT / "README.md").read_text()
    assert f"torch=={OLDEST}.0 " in (ROOT / "Makefile").read_text()  # make test-oldest-torch
