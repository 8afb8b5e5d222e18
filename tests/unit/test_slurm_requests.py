"""What is believed of Slurm's answers, and the names the harness gives its requests (the cluster
itself: tests/e2e/test_slurm_faults.py)."""

from __future__ import annotations

from harness.slurm import JOB_NAME, held_reason, job_name
from harness.transport.base import Result
from harness.transport.slurm import JobWatch, ended_reason


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


class _Login:
    """The login host as JobWatch asks it: squeue's answers in turn, as Slurm 22.05 words them."""

    def __init__(self, *answers: tuple[int, str, str]):
        self.answers, self.asked = list(answers), []

    def run(self, command: str, *, timeout: float, check: bool = True) -> Result:
        self.asked.append(command)
        code, out, err = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return Result(command, code, out, err)


def test_why_a_job_ended_is_said_in_squeues_words():
    assert ended_reason("TIMEOUT", "TimeLimit") == "reached its time limit (squeue: TIMEOUT, TimeLimit)"
    assert ended_reason("CANCELLED", "None") == "was cancelled (squeue: CANCELLED)"
    assert ended_reason("COMPLETING", "TimeLimit") == "reached its time limit (squeue: COMPLETING, TimeLimit)"
    assert ended_reason("NODE_FAIL", "NodeFail") == "lost a node (squeue: NODE_FAIL, NodeFail)"
    for holding in ("RUNNING", "PENDING", "CONFIGURING", "SUSPENDED", "COMPLETING", "", "$(reboot)"):
        assert ended_reason(holding, "None") is None


def test_a_job_is_believed_ended_only_when_slurm_says_so():
    """A step that failed asks squeue; a job still RUNNING (a node died, not the job), or a squeue
    that could not answer, concludes nothing, and is asked again at the next failure."""
    watch = JobWatch("42")
    running = _Login((0, "RUNNING|None\n", ""))
    assert watch.check(running, "srun: error: Unable to create step") is None and watch.ended is None
    assert running.asked == ["squeue -h -t all -j 42 -o '%T|%r'"]
    assert watch.check(_Login((1, "", "squeue: error: Unable to contact slurm controller")), "") is None
    # being cancelled: its steps are killed first (COMPLETING), then its state says why
    ending = _Login((0, "COMPLETING|None\n", ""), (0, "CANCELLED|None\n", ""))
    assert watch.check(ending, "*** STEP 42.3 ON n1 CANCELLED AT 2026-12-05T02:14:19 ***") == \
        "Slurm job 42 was cancelled (squeue: CANCELLED)"
    assert watch.check(_Login((0, "RUNNING|None\n", "")), "") == "Slurm job 42 was cancelled (squeue: CANCELLED)"


def test_a_job_slurm_has_forgotten_is_ended_in_sruns_words():
    """Past MinJobAge squeue no longer knows the job; srun said it had expired."""
    watch = JobWatch("7")
    assert watch.check(_Login((1, "", "slurm_load_jobs error: Invalid job id specified\n")),
                       "srun: error: Slurm job 7 has expired\n") == \
        "Slurm job 7 has ended (srun: Slurm job 7 has expired)"
    assert JobWatch("8").check(_Login((0, "", "")), "srun: error: Unable to create step") is None
