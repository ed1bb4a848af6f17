"""The chaos tests share the e2e tests' Ray session (a module-scoped fixture)."""

from tests.e2e.test_rl_schedules import ray_session  # noqa: F401
