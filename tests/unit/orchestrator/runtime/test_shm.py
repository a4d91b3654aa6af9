"""Large frames between local processes through /dev/shm: real actor processes, real
sockets and the segment protocol itself (reuse, lifetime, forged or missing segments)."""

from __future__ import annotations

import gc
import json
import os
from typing import Any

import pytest
import torch
import trio

from orchestrator.runtime import open_mesh
from orchestrator.runtime._shm import (
    ENABLED,
    SHM_MIN_BYTES,
    SegmentPool,
    export_frames,
    import_frames,
    segments_created,
)

from ._actors import Echo
from .test_wire import _recv, raw_dealer

pytestmark = pytest.mark.skipif(not ENABLED, reason="no /dev/shm here (or FLOTILLA_SHM=0)")


async def test_large_tensors_round_trip_through_segments_that_are_reused() -> None:
    g = torch.Generator().manual_seed(3)
    big = torch.randn(3 * SHM_MIN_BYTES // 4, generator=g)  # 3 MiB: through shared memory
    bf = torch.randn(2048, 1024, generator=g).to(torch.bfloat16)  # 4 MiB
    small = torch.arange(10)  # stays a ZeroMQ frame
    with trio.fail_after(60):
        async with open_mesh(Echo) as mesh:
            before_here = segments_created()
            for _ in range(8):
                back = await mesh[0].echo.call_one(
                    {"big": big, "bf": bf, "small": small, "raw": bytes(2 * SHM_MIN_BYTES)}
                )
                assert torch.equal(back["big"], big) and torch.equal(back["bf"].view(torch.int16), bf.view(torch.int16))
                assert torch.equal(back["small"], small) and back["raw"] == bytes(2 * SHM_MIN_BYTES)
                del back
                gc.collect()
            # three large frames a call: without reuse, 24 segments a side; a segment freed a
            # moment after the next call was sent may make a second set
            assert 3 <= segments_created() - before_here <= 6
            assert 3 <= await mesh[0].shm_segments_created.call_one() <= 6


def test_a_segment_is_busy_while_its_tensor_lives_and_reused_after() -> None:
    pool = SegmentPool()
    try:
        data = bytes(range(256)) * (SHM_MIN_BYTES // 256)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        name = pool.put(memoryview(data))
        assert name is not None and pool.segments[0].busy()
        header = b"S" + json.dumps([[1, name, len(data)]]).encode() + b'\n{"h":1}'
        got = import_frames([header, b""], 0, log=lambda m: pytest.fail(m))
        assert got[0] == b'{"h":1}'
        t = torch.frombuffer(got[1], dtype=torch.uint8)
        assert torch.equal(t, payload)
        del got
        gc.collect()
        assert pool.segments[0].busy()  # the tensor still uses the segment's memory
        del t
        gc.collect()
        assert not pool.segments[0].busy()
        assert pool.put(memoryview(data)) == name and pool.created == 1  # reused
    finally:
        for seg in pool.segments:  # busy after the last put: unlink by hand
            os.unlink(f"/dev/shm/{seg.name}")
        pool.segments.clear()


def test_a_lent_buffer_is_sent_without_a_copy_once_and_is_free_again_when_dropped() -> None:
    pool = SegmentPool()
    try:
        buf = pool.lend(SHM_MIN_BYTES)
        assert buf is not None and pool.segments[0].busy()
        buf[:4] = b"abcd"
        name = pool.put(buf)
        assert name == pool.segments[0].name and pool.created == 1
        header = b"S" + json.dumps([[1, name, SHM_MIN_BYTES]]).encode() + b'\n{"h":1}'
        got = import_frames([header, b""], 0, log=lambda m: pytest.fail(m))
        assert bytes(got[1][:4]) == b"abcd"
        buf[:4] = b"wxyz"  # the receiver maps the very memory that was written: no copy
        assert bytes(got[1][:4]) == b"wxyz"
        again = pool.put(buf)  # sent a second time: copied into a segment of its own
        assert again is not None and again != name and pool.created == 2
        del buf
        gc.collect()
        assert pool.segments[0].busy()  # sent: its receiver still maps it
        del got
        gc.collect()
        assert not pool.segments[0].busy()
        unsent = pool.lend(SHM_MIN_BYTES // 2)
        assert unsent is not None and pool.segments[0].busy() and pool.created == 2  # reused
        del unsent  # never sent: nobody else will free it
        gc.collect()
        assert not pool.segments[0].busy()
    finally:
        for seg in pool.segments:  # the copied one stays busy (never received): unlink by hand
            os.unlink(f"/dev/shm/{seg.name}")
        pool.segments.clear()


def test_a_frame_a_little_larger_than_the_last_reuses_its_segment() -> None:
    # Batches of trajectories vary in size from fetch to fetch: a segment is made a size
    # class larger (at most 1/8 more) than asked for, so the next, slightly larger
    # frame fits it instead of costing a new segment (allocated and faulted in afresh).
    pool = SegmentPool()
    try:
        for n in (2 * SHM_MIN_BYTES, 2 * SHM_MIN_BYTES + 4096, 2 * SHM_MIN_BYTES + SHM_MIN_BYTES // 8):
            buf = pool.lend(n)
            assert buf is not None and buf.nbytes == n
            del buf  # never sent: free again
            gc.collect()
        assert pool.created == 1
        assert pool.segments[0].size <= (2 * SHM_MIN_BYTES + 4096) * 9 // 8 + 4096  # at most a class more
        big = pool.lend(3 * SHM_MIN_BYTES)  # past the class: a segment of its own
        assert big is not None and pool.created == 2
        del big
        gc.collect()
    finally:
        pool.close()


async def test_a_tensor_an_actor_writes_into_lent_memory_arrives_and_the_segment_is_reused() -> None:
    with trio.fail_after(60):
        async with open_mesh(Echo) as mesh:
            before = await mesh[0].shm_segments_created.call_one()
            for value in range(1, 7):
                t = await mesh[0].lent.call_one(2 * SHM_MIN_BYTES, value)
                assert t.numel() == 2 * SHM_MIN_BYTES and bool((t == value).all())
                del t
                gc.collect()
            # one segment, lent and sent each time; a copy of it would make a second
            assert await mesh[0].shm_segments_created.call_one() - before == 1


def test_forged_missing_or_short_segments_become_empty_frames_and_are_logged() -> None:
    logged: list[str] = []
    evil = [[1, "../../etc/passwd", 10], [2, f"flotilla-{os.getpid()}-999999", 10]]
    header = b"S" + json.dumps(evil).encode() + b'\n{"id":1}'
    frames = import_frames([header, b"", b""], 0, log=logged.append)
    assert frames == [b'{"id":1}', b"", b""]
    assert "not a segment name" in logged[0] and "No such file" in logged[1]
    with pytest.raises(ValueError, match="malformed shared-memory"):
        import_frames([b"S[[1,2]]\n{}", b""], 0, log=logged.append)
    with pytest.raises(ValueError, match="malformed shared-memory"):
        import_frames([b"S not json\n{}", b""], 0, log=logged.append)
    with pytest.raises(ValueError, match="malformed shared-memory"):
        import_frames([b"S" + json.dumps([[5, "flotilla-1-1", 1]]).encode() + b"\n{}", b""], 0, log=logged.append)


def test_small_frames_stay_zeromq_frames() -> None:
    frames = [b"ident", b'{"id":1}', b"x" * 100]
    assert export_frames(frames, 1) is frames  # nothing large: the very same list


async def test_a_forged_segment_name_gets_a_bad_reply_and_the_actor_keeps_serving() -> None:
    with trio.fail_after(30):
        async with open_mesh(Echo) as mesh:
            with raw_dealer(mesh.addresses[0]) as sock:
                call = {"id": 1, "kind": "call", "endpoint": "echo", "args": [{"__t": "bytes", "f": 1, "n": 4096}]}
                table = json.dumps([[1, "flotilla-1-0/../../etc/passwd", 4096]]).encode()
                sock.send_multipart([b"S" + table + b"\n" + json.dumps(call).encode(), b""])
                reply: Any = await _recv(sock)
                header = json.loads(reply[0])
                assert header["kind"] == "bad" and header["id"] == 1 and "declared 4096 bytes" in header["message"]
                assert await mesh[0].echo.call_one(42) == 42
