"""The host agent's answers, read as the lifecycle reads them: the last JSON object of the output,
checked against its model, and what a host sends of another shape named field by field."""

from __future__ import annotations

import pytest

from harness.results.answers import AnswerError, Probe, Profiled, Stop, Wait, read_answer


def test_the_answer_is_the_last_json_object_of_the_output():
    output = ('a login banner\n{"status": "timeout", "seconds": 1}\n[2]\nnot json\n'
              '{"status": "healthy", "seconds": 3.5}\n')
    assert read_answer(Wait, output) == Wait(status="healthy", seconds=3.5)
    assert read_answer(Wait, '{"status": "died", "seconds": 2}\n[1]\n').status == "died"   # a list is no answer


@pytest.mark.parametrize(("model", "output", "said"), [
    (Wait, "", "no answer"),
    (Wait, "[1]\n7\n", "no answer"),
    (Wait, '{"status": "sleeping", "seconds": 1}', "status: Input should be 'healthy', 'died' or 'timeout'"),
    (Stop, '{"port_closed": "no"}', "port_closed: Input should be a valid boolean"),
    (Probe, '{"module_ok": true, "port_free": true, "gpus": {"devices": [{"index": 0}]}}',
     "gpus.devices.0.memory_used_mib: Field required"),
    (Profiled, '{"status": "ok", "files": [{"bytes": 1}]}', "files.0.name: Field required"),
])
def test_an_answer_of_another_shape_names_what_is_wrong(model, output, said):
    with pytest.raises(AnswerError) as e:
        read_answer(model, output)
    assert str(e.value).startswith(said), str(e.value)


def test_the_record_keeps_what_the_agent_sent_and_drops_what_it_did_not_name():
    probe = read_answer(Probe, '{"module_ok": false, "module_error": "No module named sglang", "port_free": true, '
                               '"disk_free_gb": 12.5, "surprise": "x" }')
    assert probe.record() == {"module_ok": False, "module_error": "No module named sglang", "port_free": True,
                              "disk_free_gb": 12.5}
    assert probe.gpus.devices == [] and probe.port_holders == []   # defaults to read, not to record


def test_a_port_held_by_a_process_the_user_cannot_see_is_still_an_answer():
    """The agent names no pid when the socket's process belongs to another user (/proc hides its fds)."""
    probe = read_answer(Probe, '{"module_ok": true, "port_free": false, "port_holders": '
                               '[{"pid": null, "command": "unknown (not visible to this user)"}]}')
    assert not probe.port_free and probe.port_holders[0].pid is None
