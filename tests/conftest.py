import os

# Before Ray is imported anywhere: keep the test cluster on loopback, no token auth.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# As the CLI does (raylowcomm/env.py): Hugging Face loaders stay off the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_session():
    """One Ray cluster for the whole test session (start-up costs seconds). Its actors get the job
    settings a user's run gives them (`runtime.init_ray`): offline hubs, and Ray Train polling its
    workers every 0.5 s, not 2 s (a tiny DDP run here took 27-30 s at 2 s, 16-23 s at 0.5 s)."""
    import ray

    from raylowcomm.env import job_env

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": job_env()})
    yield ray
    ray.shutdown()


def trainable_nbytes(model) -> int:
    """Bytes of the parameters that train: what DDP all-reduces each step (it skips frozen ones)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
