"""How a failed join of a weight-update group is answered: 502 or 504 naming the master, torch's error
without its C++ stack, and what to check (`verst.engine.weight_group.peer_failed`)."""

import json

from verst.engine.weight_group import peer_failed
from verst.inference_client.weight_protocol import InitWeightsUpdateGroupRequest

BODY = InitWeightsUpdateGroupRequest(master_address="trainer-0", master_port=29500, rank_offset=2, world_size=3,
                                     group_name="g")
CPP_STACK = ("\nException raised from recvBytes at /pytorch/torch/csrc/distributed/c10d/Utils.hpp:784 (most recent "
             "call first):\nframe #0: c10::Error::Error(...) + 0x9d (0x7f in libc10.so)\n")


def answer(exc: BaseException) -> tuple[int, dict]:
    response = peer_failed(BODY, exc)
    return response.status_code, json.loads(response.body)["error"]


def test_a_master_that_failed_is_a_502_with_its_error_and_what_to_check():
    status, error = answer(RuntimeError("Connection reset by peer" + CPP_STACK))
    assert status == 502 and (error["field"], error["value"]) == ("master_address", "trainer-0:29500")
    assert error["message"] == (
        "weight update group 'g': joining the group's master (rank 0, the trainer) at trainer-0:29500 as rank 2 of 3 "
        "failed (RuntimeError: Connection reset by peer); check that the trainer opened the group with world_size = 3 "
        "at that address, then ask again")


def test_a_master_that_did_not_answer_in_time_is_a_504():
    status, error = answer(RuntimeError("wait timeout after 30000ms, keys: /verst/g/0/1" + CPP_STACK))
    assert status == 504 and error["value"] == "trainer-0:29500"
    assert error["message"] == (
        "weight update group 'g': the group's master (rank 0, the trainer) at trainer-0:29500 did not answer within "
        "timeout_s = 30 s (RuntimeError: wait timeout after 30000ms, keys: /verst/g/0/1); check that the trainer has "
        "opened the group at that address and that this engine reaches it, or give a longer timeout_s")


def test_an_error_without_a_message_still_says_what_it_was():
    status, error = answer(TimeoutError())
    assert status == 504 and "(TimeoutError: no message)" in error["message"]
