"""What a test does when a service of this machine it needs is missing (an OpenSSH server,
PostgreSQL, Chromium): it skips, saying which and how to get it — except in CI (`CI=true`), where
.ci/run provides every one of them. There a missing service fails the test, so that CI cannot go
green by skipping what it was meant to run."""
from __future__ import annotations

import os
from typing import NoReturn

import pytest

IN_CI = os.environ.get("CI") == "true"


def missing(why: str) -> NoReturn:
    """Skip the test, or under CI=true fail it; `why` names the service and how to get it."""
    if IN_CI:
        pytest.fail(f"{why}; CI=true, where a missing service fails rather than skips", pytrace=False)
    pytest.skip(why)
