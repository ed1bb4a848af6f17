"""Joining a trainer's weight-update group for `POST /init_weights_update_group`: the master's address is
resolved first, then the engine joins as its rank; every failure is answered naming the master, the error
and what to do, and the engine serves on.
"""

from __future__ import annotations

import asyncio
import socket

from fastapi.responses import Response

from verst.engine.service import error_response
from verst.inference_client import weights
from verst.inference_client.weight_protocol import InitWeightsUpdateGroupRequest

MASTER = "the group's master (rank 0, the trainer)"
REACH_RETRY_S = 0.2


async def join(body: InitWeightsUpdateGroupRequest) -> weights.WeightUpdateGroup | Response:
    """The joined group, or the error response: 400 when the address does not resolve, 502 when the
    master failed, 504 when it did not accept a connection (or every rank did not arrive) within `timeout_s`."""
    refused = await _resolve(body) or await _reach(body)
    if refused is not None:
        return refused
    try:
        return await asyncio.to_thread(
            weights.open_weight_update_group, body.master_address, body.master_port, body.rank_offset,
            body.world_size, body.group_name, body.backend, body.timeout_s,
        )
    except (RuntimeError, ValueError, OSError) as exc:
        return peer_failed(body, exc)


async def _reach(body: InitWeightsUpdateGroupRequest) -> Response | None:
    """None once the master accepts a connection, tried every REACH_RETRY_S (the trainer may open it a moment
    after asking). torch's store client retries a refused connection too, but with a backoff that overruns its
    timeout by half (48 s at 30 s) and without the OS error; trying here ends on time and names it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + body.timeout_s
    error: OSError = TimeoutError("a connection attempt got no answer")
    while (left := deadline - loop.time()) > 0:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(body.master_address, body.master_port), left)
        except TimeoutError:  # no answer at all until the deadline (before OSError: TimeoutError is one)
            break
        except OSError as exc:  # refused or unreachable: the master may not be listening yet
            error = exc
            await asyncio.sleep(min(REACH_RETRY_S, max(deadline - loop.time(), 0.0)))
            continue
        writer.close()
        return None
    return peer_failed(body, error, timed_out=True)


async def _resolve(body: InitWeightsUpdateGroupRequest) -> Response | None:
    """None when `master_address` resolves. torch's store client retries a name that does not resolve until
    its timeout, as it does an unreachable master; resolving first tells the two apart at once."""
    lookup = asyncio.to_thread(socket.getaddrinfo, body.master_address, body.master_port, type=socket.SOCK_STREAM)
    try:
        await asyncio.wait_for(lookup, body.timeout_s)
    except TimeoutError as exc:
        return peer_failed(body, exc)
    except (OSError, UnicodeError) as exc:  # socket.gaierror: no such name, or no address of a usable family
        return error_response(
            400, f"weight update group {body.group_name!r}: master_address = {body.master_address!r} does not "
            f"resolve on this engine ({type(exc).__name__}: {exc}); give {MASTER}'s IP address or a hostname this "
            "engine resolves", "master_address", body.master_address)
    return None


def peer_failed(body: InitWeightsUpdateGroupRequest, exc: BaseException, timed_out: bool | None = None) -> Response:
    """The master failed (502) or did not answer in time (504; by default when the error says so): named with
    the error (torch's without the C++ stack it may add) and what to check."""
    peer = f"{body.master_address}:{body.master_port}"
    cause = f"{type(exc).__name__}: {_without_cpp_stack(str(exc)) or 'no message'}"
    if timed_out is None:
        timed_out = isinstance(exc, TimeoutError) or "timed out" in cause or "timeout" in cause.lower()
    if timed_out:
        return error_response(
            504, f"weight update group {body.group_name!r}: {MASTER} at {peer} did not answer within timeout_s = "
            f"{body.timeout_s:g} s ({cause}); check that the trainer has opened the group at that address and that "
            "this engine reaches it, or give a longer timeout_s", "master_address", peer)
    return error_response(
        502, f"weight update group {body.group_name!r}: joining {MASTER} at {peer} as rank {body.rank_offset} of "
        f"{body.world_size} failed ({cause}); check that the trainer opened the group with world_size = "
        f"{body.world_size} at that address, then ask again", "master_address", peer)


def _without_cpp_stack(message: str) -> str:
    """torch's errors from C++ may end in the native stack ("Exception raised from ...", frame by frame)."""
    return message.split("\nException raised from", 1)[0].strip()
