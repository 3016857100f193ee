"""One receiver (``eventpush.demo.receiver``) for a whole test module, for the modules that
start a platform once (Airflow standalone, the cluster) and push to it across their tests.

A module takes it with ``from receiver_support import receiver``. Not in conftest: other
modules define a function-scoped ``receiver`` of their own, which a conftest fixture of the
same name would be confused with.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from eventpush.demo.receiver import Receiver


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r
