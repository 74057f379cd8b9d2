"""Settings every test shares.

auto's decisions depend on the rates it weighs: the tests pin the shipped reference table
(``attnkit.backends.rates.reference``), so their expectations do not depend on the machine
that runs them or on what an earlier run measured, and no test starts background work
(``ATTNKIT_BACKGROUND=0``). Tests of the calibration itself unpin (``rates.pin(None)``).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("ATTNKIT_BACKGROUND", "0")


@pytest.fixture(autouse=True)
def _reference_rates():
    from attnkit.backends import rates

    with rates.pin(rates.reference()):
        yield
