"""One local Ray cluster for the whole test session (started on first use)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from flowc.runtime.controller import init_ray

    started = init_ray(None)
    yield ray
    if started:
        ray.shutdown()
