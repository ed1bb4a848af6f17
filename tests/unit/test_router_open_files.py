"""The router's open files: one request through sglang-router holds two connections, so `ulimit -n` bounds the
requests one router can hold; a run that would pass it is refused at start-up by name, not left to fail every
request once the router runs out of files."""

import resource

import pytest

from verst.router import RouterManager
from verst.router.manager import FILES_PER_ENGINE, FILES_RESERVED, check_open_files, open_files_limit


def test_requests_that_fit_the_limit_pass_and_one_more_is_refused_with_the_most_that_fit():
    engines, limit = 256, 20000
    most = (limit - FILES_PER_ENGINE * engines - FILES_RESERVED) // 2
    check_open_files(most, engines, limit)
    with pytest.raises(ValueError, match=rf"rollout.concurrency = {most + 1} .* limit of 20000 .* at most {most}\b"):
        check_open_files(most + 1, engines, limit)


def test_the_soft_limit_is_raised_to_the_hard_one_for_the_router_to_inherit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        if soft == hard and hard != resource.RLIM_INFINITY and hard > 64:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard // 2, hard))
        limit = open_files_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
        assert limit == (hard if hard != resource.RLIM_INFINITY else 2**31 - 1)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_router_asked_for_more_requests_than_files_allow_is_refused_before_it_starts():
    limit = open_files_limit()
    router = RouterManager(["http://127.0.0.1:1"], max_requests=limit)
    with pytest.raises(ValueError, match=f"rollout.concurrency = {limit} "):
        router.start()
    assert router.proc is None
