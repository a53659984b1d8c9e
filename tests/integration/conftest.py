"""One local Ray per pytest worker, bound to loopback, shared by the modules that use it
(Ray start-up is slow on 2 cores).

The head lives from the first module that asks for :func:`local_ray` until a test that
does not use it runs (``tests/conftest.py`` ends it there, so a test that starts or joins
a Ray of its own never finds this one) or the worker ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests import shared_ray


@pytest.fixture(scope="session")
def _shared_ray_at_exit() -> Iterator[None]:
    yield
    shared_ray.end()


@pytest.fixture(scope="module")
def local_ray(_shared_ray_at_exit: None) -> Any:
    """A local Ray head with 8 virtual NPUs and 2 CPUs; every module's sessions are ended
    by their own fixtures, so the next module finds all 8 free."""
    return shared_ray.get()
