"""Error kinds: each says whether it is retried and whether it rules a host out; names are checked."""

from __future__ import annotations

import json

import pytest

from harness.errors import HostKeyError, Kind, RemoteError, RemoteTimeout, RunFailed, UnreachableError


@pytest.mark.parametrize("kind, retried, host_fatal", [
    (Kind.UNREACHABLE, True, False), (Kind.TIMEOUT, True, False), (Kind.COLLECT, True, False),
    (Kind.SERVER_DIED, True, False), (Kind.HOST_KEY, False, True), (Kind.AUTH, False, True),
    (Kind.PREFLIGHT, False, True), (Kind.LAUNCH, False, False), (Kind.OOM, False, False),
    (Kind.BENCH, False, False), (Kind.INTERNAL, False, False), (Kind.STARTUP_TIMEOUT, False, False),
])
def test_each_kind_knows_whether_it_is_retried_and_rules_a_host_out(kind, retried, host_fatal):
    assert (kind.retried, kind.host_fatal) == (retried, host_fatal)


def test_the_exception_classes_carry_their_kind():
    assert UnreachableError("x").retryable and RemoteTimeout("x").retryable
    assert not HostKeyError("x").retryable and HostKeyError("x").kind.host_fatal
    assert RunFailed("died", kind="server_died").kind is Kind.SERVER_DIED


def test_a_kind_is_written_and_compared_as_its_name():
    assert json.dumps({"kind": Kind.OOM}) == '{"kind": "oom"}' and Kind.OOM == "oom" and f"{Kind.OOM}" == "oom"


def test_a_misspelt_kind_is_a_bug_that_fails_where_it_is_raised():
    with pytest.raises(ValueError):
        RemoteError("x", kind="colect")


def test_a_kind_an_older_harness_wrote_reads_as_a_plain_error():
    assert Kind.of("gone-since") is Kind.ERROR and Kind.of("bench") is Kind.BENCH
