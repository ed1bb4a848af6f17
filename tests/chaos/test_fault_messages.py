"""Every message of the fault paths is whole (never cut, never an empty error after its colon), names the
process, the OS error where there is one, and says what to do."""

from __future__ import annotations

import asyncio
import errno
import os

import httpx
import pytest

from tests.chaos.stand_ins import check_screen, drive, no_space, saving_run
from verst.inference_client.client import EngineClient, Timeouts
from verst.inference_client.fleet import EngineFleet
from verst.monitor import checkpoint_dirs as layout
from verst.monitor.diagnosis import cause_text, error_text, headline
from verst.orchestration.watchdog import ProcessStatus, RunFailure, Watchdog, failure_report
from verst.run.ending import end_early


def test_an_error_without_text_is_named_by_its_type_and_meaning():
    from verst.inference_client.fleet import FleetError

    assert error_text(RuntimeError()) == "RuntimeError (no message)"
    failed = FleetError("pause_generation(retract)", {"http://127.0.0.1:9": httpx.ReadError("")})
    assert str(failed) == ("pause_generation(retract) failed on 1 engine(s): http://127.0.0.1:9: ReadError (no "
                           "message: the connection was closed or reset before a reply came)")
    failed = FleetError("continue_generation", {"http://127.0.0.1:9": httpx.ConnectError("All connection attempts "
                                                                                            "failed")})
    assert str(failed).endswith("http://127.0.0.1:9: ConnectError: All connection attempts failed")


def test_a_control_call_whose_engine_closes_the_connection_names_it_whole():
    async def closes_at_once(reader, writer):
        await reader.readline()
        writer.close()  # as a server killed while the call waited

    async def pause():
        server = await asyncio.start_server(closes_at_once, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with EngineFleet([url], timeouts=Timeouts(control=5.0)) as fleet:
            try:
                await fleet.pause("retract")
            finally:
                server.close()
        return url

    with pytest.raises(Exception) as caught:
        asyncio.run(pause())
    message = str(caught.value)
    assert message.startswith("pause_generation(retract) failed on 1 engine(s): http://127.0.0.1:"), message
    reason = message.split("/pause_generation: no reply: ", 1)[1]
    name, _, text = reason.partition(": ")
    assert name in ("ServerDisconnectedError", "RemoteProtocolError", "ReadError") and text.strip(), message
    check_screen(message, names=["pause_generation(retract)", "http://127.0.0.1:"], todo="no reply")


def test_a_long_remote_error_is_told_by_its_first_and_last_lines_never_cut():
    detail = "trainer rank 0 failed:\n" + "\n".join(f"  File 'x.py', line {i}" for i in range(200)) + \
        "\nOSError: [Errno 28] No space left on device: '/run/checkpoints/.tmp-step_5/trainer/rng_rank0.pt'"
    error = RuntimeError(detail)
    assert headline(error) == ("RuntimeError: trainer rank 0 failed: [...] OSError: [Errno 28] No space left on "
                               "device: '/run/checkpoints/.tmp-step_5/trainer/rng_rank0.pt'")
    assert cause_text(error) == ("OSError: [Errno 28] No space left on device: "
                                 "'/run/checkpoints/.tmp-step_5/trainer/rng_rank0.pt'")


class DeadRank:
    """The run's processes, as the survey finds them: trainer rank 0 killed, its log's last lines."""

    def __init__(self, tmp_path):
        self.run_dir = tmp_path / "run"
        self.log = tmp_path / "trainer-0.log"
        self.log.write_text("step 3\nKilled\n")

    def dead(self, error):
        return [ProcessStatus("trainer rank 0", "trainer-0", 4242, str(self.log), "gone", "killed by SIGKILL")]


def test_a_dead_process_screen_names_it_its_log_what_the_run_saw_and_how_to_continue(tmp_path):
    processes = DeadRank(tmp_path)
    cause = RuntimeError("trainer rank 0 failed:\n" + "x " * 400 + "\nRayActorError: The actor died unexpectedly")
    run = saving_run(tmp_path)

    def rank_dies(step):
        if step == 3:
            raise cause

    async def explain(error):
        return failure_report(processes, error)

    async def ended():
        try:
            await drive(run, 5, rank_dies)
        except RuntimeError as error:  # drive raises the error itself: explain it as open_rl_run does
            return await end_early(run, error, explain)

    failure = asyncio.run(ended())
    message = str(failure)
    assert isinstance(failure, RunFailure) and failure.trainer_died
    check_screen(message, names=["trainer rank 0 (pid 4242) killed by SIGKILL", f"log {processes.log}",
                                 "| Killed", "RayActorError: The actor died unexpectedly", "what ran: "],
                 todo=f"continue with: verst train --resume {tmp_path / 'run'} (from ")


def test_a_stuck_phase_says_where_the_stacks_are_and_which_limit_to_raise(tmp_path):
    failure = asyncio.run(Watchdog(tmp_path, None).stuck("weight sync to version 3", 900.0, "fault.sync_timeout_s"))
    check_screen(str(failure), names=["weight sync to version 3 made no progress within 900 s", str(failure.dump_dir)],
                 todo="raise fault.sync_timeout_s")


def test_a_save_whose_rollout_file_cannot_be_written_names_the_part_the_file_and_the_os_error(tmp_path):
    final = tmp_path / "checkpoints" / "step_4"
    tmp = tmp_path / "checkpoints" / ".tmp-step_4"
    tmp.mkdir(parents=True)
    error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / "rollout.pkl"))
    not_saved = layout.not_saved(final, tmp, error, "the rollout manager's save")
    assert str(not_saved) == (f"checkpoint {final} not saved: the rollout manager's save failed: OSError: [Errno 28] "
                              f"No space left on device: '{tmp / 'rollout.pkl'}'; the run has no earlier checkpoint")
    assert not_saved.out_of_space and not tmp.exists()


def test_an_engine_client_names_a_timeout_with_its_limit():
    async def never_answers(reader, writer):
        await asyncio.sleep(30)

    async def call():
        server = await asyncio.start_server(never_answers, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            await EngineClient(url, timeouts=Timeouts(control=0.3)).continue_generation()
        finally:
            server.close()

    with pytest.raises(Exception) as caught:
        asyncio.run(call())
    assert "/continue_generation: no reply: timed out after 0.3s (ReadTimeout)" in str(caught.value)


def test_no_space_is_an_os_error_with_text():
    assert cause_text(no_space()) == "OSError: [Errno 28] No space left on device"
