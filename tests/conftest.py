"""Shared test settings: every property runs at least 100 examples, with no per-example deadline
(multi-rank examples pay inter-process latency)."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "fsdpfn",
    max_examples=int(os.environ.get("FSDPFN_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=bool(os.environ.get("CI")),
)
settings.load_profile("fsdpfn")
