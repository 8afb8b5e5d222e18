"""What is believed of Slurm's answers, and the names the harness gives its requests (the cluster
itself: tests/e2e/test_slurm_faults.py)."""

from __future__ import annotations

from harness.slurm import JOB_NAME, held_reason, job_name


def test_each_request_has_a_job_name_of_its_own():
    """A request that did not come is withdrawn by its name (scancel --name): two requests of one
    sweep id must not share it, or the one withdrawn cancels the other's job."""
    names = {job_name("night-20260101-000000", "h200") for _ in range(50)}
    assert len(names) == 50
    assert all(n.startswith("harness-night-20260101-000000-h200-") and JOB_NAME.match(n) for n in names)
    long = job_name("x" * 300, "h200")
    assert JOB_NAME.match(long) and len(long) <= 200 and long != job_name("x" * 300, "h200")


def test_the_reason_a_request_was_held_back_is_said_with_its_host_list():
    """Nodes down or drained under a request: Slurm (23.02 and later) says which in a host list."""
    assert held_reason("7/ReqNodeNotAvail, UnavailableNodes:gpu[01-04,07]\n") == \
        "; squeue gives job 7 the reason ReqNodeNotAvail, UnavailableNodes:gpu[01-04,07]"
    assert held_reason("7/Priority\n8/PartitionDown\n") == "; squeue gives job 8 the reason PartitionDown"
    assert held_reason("squeue: error: Invalid user\n") == ""
    assert held_reason("7/$(reboot)\n") == "" and held_reason("") == ""
