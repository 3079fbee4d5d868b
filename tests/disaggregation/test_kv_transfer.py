"""The PD transfer layer (disaggregation/: bootstrap, control, mooncake, fake) between two processes on
loopback, each rank with a real TokenToKVPool: the prefill rank lives in a second process (`Peer`), the
decode rank in the test's; the bootstrap server runs in the test's process, as in the prefill server's
launcher."""

from __future__ import annotations

import multiprocessing as mp
import random
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from vlm_serve.config import ServerArgs
from vlm_serve.disaggregation.bootstrap import BootstrapServer, RankInfo, lookup_rank, register_rank
from vlm_serve.disaggregation.control import Timeouts
from vlm_serve.disaggregation.factory import TransferConcerns, create_transfer_backend
from vlm_serve.disaggregation.fake import FAILURE_ENV, FakeBackend
from vlm_serve.disaggregation.mooncake import MooncakeBackend, contiguous_runs, pieces, transfer_engine_class
from vlm_serve.disaggregation.transfer import KVLayout, KVPoll, KVReceiver, KVSender
from vlm_serve.kv_cache.memory_pool import KVPoolLayout, TokenToKVPool
from vlm_serve.messages.backend import BootstrapInfo
from vlm_serve.server.ports import free_port

pytestmark = pytest.mark.server  # the two sides of a transfer run in two processes

CPU = torch.device("cpu")
HOST = "127.0.0.1"
POOL_SLOTS, LAYERS, KV_HEADS, HEAD_DIM = 128, 2, 2, 16  # 4 buffers of 128 bytes per slot
SLOT_BYTES = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4
META_SLOTS, META_BYTES = 256, 64
PROMPT = 40
BACKENDS = {"fake": FakeBackend, "mooncake": MooncakeBackend}
SHORT = Timeouts(bootstrap=0.5, waiting=0.5, heartbeat=0.5)
PASSING = {KVPoll.BOOTSTRAPPING, KVPoll.WAITING_FOR_INPUT, KVPoll.TRANSFERRING}


class Side:
    """One rank's end of PD transfers, held as a scheduler holds it: a KV pool (random KV on the prefill
    side), a metadata buffer, a backend, and the senders or receivers of its rooms."""

    def __init__(
        self,
        backend: str,
        mode: str,
        page_size: int = 1,
        bootstrap_port: int | None = None,
        timeouts: Timeouts = Timeouts(),
        head_dim: int = HEAD_DIM,
        env: dict[str, str] | None = None,
    ) -> None:
        self.mode = mode
        self.pool = TokenToKVPool(POOL_SLOTS, KVPoolLayout(LAYERS, KV_HEADS, head_dim, page_size, torch.float32), CPU)
        if mode == "prefill":
            generator = torch.Generator().manual_seed(0)
            for buffer in self.pool.buffers():
                buffer.copy_(torch.randn(buffer.shape, generator=generator))
        self.meta = torch.zeros(META_SLOTS, META_BYTES, dtype=torch.uint8)
        bootstrap = None if bootstrap_port is None else (HOST, bootstrap_port)
        layout = KVLayout.of(self.pool, self.meta)
        with pytest.MonkeyPatch.context() as patch:  # (the environment the backend reads as it starts)
            for name, value in (env or {}).items():
                patch.setenv(name, value)
            self.backend = BACKENDS[backend](mode, 0, 1, HOST, layout, bootstrap, timeouts=timeouts)
        self.rooms: dict[str, KVSender | KVReceiver] = {}

    def open(self, room: str, bootstrap_port: int) -> None:
        info = BootstrapInfo(HOST, bootstrap_port, room)
        self.rooms[room] = self.backend.sender(info) if self.mode == "prefill" else self.backend.receiver(info)

    def wait(self, room: str, *passing: KVPoll) -> KVPoll:
        """The room's state once it is none of `passing` (by default: once it has ended)."""
        passing_states = set(passing) or PASSING
        deadline = time.monotonic() + 30
        while (state := self.rooms[room].poll()) in passing_states:
            if time.monotonic() > deadline:
                raise TimeoutError(f"room {room} stayed {state.name}")
            time.sleep(0.005)
        return state

    def state(self, room: str) -> KVPoll:
        return self.rooms[room].poll()

    def failure(self, room: str) -> str | None:
        return self.rooms[room].failure

    def record(self, room: str) -> bytes | None:
        return self.rooms[room].meta

    def bytes_sent(self, room: str) -> int:
        return self.rooms[room].bytes_sent

    def send(self, room: str, slots: list[int], start: int, meta: bytes | None = None) -> None:
        self.rooms[room].send(slots, start, meta)

    def init(self, room: str, slots: list[int], meta_index: int) -> None:
        self.rooms[room].init(slots, meta_index)

    def abort(self, room: str) -> None:
        self.rooms[room].abort()

    def kv(self, slots: list[int]) -> bytes:
        """The bytes of these slots, buffer by buffer."""
        return b"".join(buffer[slots].numpy().tobytes() for buffer in self.pool.buffers())

    def num_rooms(self) -> int:
        return self.backend.num_rooms

    def close(self) -> None:
        self.backend.close()


def _peer_main(conn: Connection) -> None:
    sides: dict[str, Side] = {}
    while (call := conn.recv()) is not None:
        name, method, args, kwargs = call
        try:
            if method == "__init__":
                sides[name], result = Side(*args, **kwargs), None
            else:
                result = getattr(sides[name], method)(*args, **kwargs)
            conn.send(("ok", result))
        except Exception as exc:  # noqa: BLE001 - raised again in the test's process
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    for side in sides.values():
        side.close()


class Peer:
    """A second process holding sides, called through a pipe."""

    def __init__(self) -> None:
        context = mp.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_peer_main, args=(child,), daemon=True)
        self.process.start()
        self.count = 0

    def side(self, *args: Any, **kwargs: Any) -> RemoteSide:
        self.count += 1
        name = f"side{self.count}"
        self.call(name, "__init__", args, kwargs)
        return RemoteSide(self, name)

    def call(self, name: str, method: str, args: tuple, kwargs: dict) -> Any:
        self.conn.send((name, method, args, kwargs))
        status, result = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"in the peer process: {result}")
        return result

    def kill(self) -> None:
        self.process.kill()
        self.process.join()

    def close(self) -> None:
        self.conn.send(None)
        self.process.join(timeout=30)


class RemoteSide:
    """A `Side` in a peer process: the same methods."""

    def __init__(self, peer: Peer, name: str) -> None:
        self.peer, self.name = peer, name

    def __getattr__(self, method: str) -> Any:
        return lambda *args, **kwargs: self.peer.call(self.name, method, args, kwargs)


class Pair:
    """A prefill rank (in the peer process, registered with a bootstrap server here) and a decode rank."""

    def __init__(
        self,
        peer: Peer,
        backend: str,
        page_size: int = 1,
        timeouts: Timeouts = Timeouts(),
        env: dict[str, str] | None = None,
        decode_head_dim: int = HEAD_DIM,
    ) -> None:
        self.server = BootstrapServer(HOST, 0).start()
        self.port = self.server.port
        self.prefill = peer.side(backend, "prefill", page_size, self.port, timeouts, env=env)
        self.decode = Side(backend, "decode", page_size, timeouts=timeouts, head_dim=decode_head_dim, env=env)

    def open(self, room: str) -> None:
        """The decode side finds its prefill rank and says where the KV goes, the prefill side makes its
        sender: both are then ready for the KV."""
        self.decode.open(room, self.port)
        assert self.decode.wait(room, KVPoll.BOOTSTRAPPING) == KVPoll.WAITING_FOR_INPUT
        self.decode.init(room, list(range(1, PROMPT + 1)), 0)
        self.prefill.open(room, self.port)
        assert self.prefill.wait(room, KVPoll.BOOTSTRAPPING) == KVPoll.WAITING_FOR_INPUT

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()
        self.server.stop()


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    peer = Peer()
    yield peer
    peer.close()


@pytest.fixture(scope="module")
def pairs(peer: Peer) -> Iterator[Any]:
    """pairs(backend, page_size): a pair with the default timeouts, shared by the module's tests."""
    made: dict[tuple[str, int], Pair] = {}

    def pair(backend: str, page_size: int = 1) -> Pair:
        if (backend, page_size) not in made:
            made[backend, page_size] = Pair(peer, backend, page_size)
        return made[backend, page_size]

    yield pair
    for made_pair in made.values():
        made_pair.close()


def wait_until(condition: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the condition did not come true in time")
        time.sleep(0.005)


def new_room() -> str:
    return f"{uuid.uuid4().hex[:12]}/0"


def scattered_slots(seed: int, page_size: int) -> list[int]:
    """The KV slots of a PROMPT-token request: whole pages, some consecutive, in no order overall."""
    rng = random.Random(seed)
    pages = sorted(rng.sample(range(1, POOL_SLOTS // page_size), PROMPT // page_size))
    cut = len(pages) // 2
    pages = pages[cut:] + pages[:cut]  # (two sorted runs: consecutive pages, and a jump back)
    return [page * page_size + i for page in pages for i in range(page_size)]


# -- moving the KV


@pytest.mark.parametrize("page_size", [1, 4])
def test_mooncake_moves_exactly_the_prompts_kv_and_the_record(pairs: Any, page_size: int) -> None:
    pair, room = pairs("mooncake", page_size), new_room()
    src, dst = scattered_slots(1, page_size), scattered_slots(2, page_size)
    pair.decode.open(room, pair.port)
    assert pair.decode.wait(room, KVPoll.BOOTSTRAPPING) == KVPoll.WAITING_FOR_INPUT
    pair.decode.init(room, dst, 3)
    pair.prefill.open(room, pair.port)  # (the destination came first: it waited for the sender)
    assert pair.prefill.wait(room, KVPoll.BOOTSTRAPPING) == KVPoll.WAITING_FOR_INPUT
    for start, end in [(0, 12), (12, 28)]:  # chunk by chunk, whole pages
        pair.prefill.send(room, src[start:end], start)
    pair.prefill.send(room, src[28:], 28, b'{"first_token": 7}')

    assert pair.decode.wait(room) == KVPoll.SUCCESS
    assert pair.decode.record(room) == b'{"first_token": 7}'
    assert pair.decode.kv(dst) == pair.prefill.kv(src)
    untouched = sorted(set(range(POOL_SLOTS)) - set(dst))
    assert not any(pair.decode.kv(untouched))
    assert pair.prefill.wait(room) == KVPoll.SUCCESS
    assert pair.prefill.bytes_sent(room) == PROMPT * SLOT_BYTES + len(b'{"first_token": 7}')
    assert (pair.prefill.num_rooms(), pair.decode.num_rooms()) == (0, 0)


def test_runs_contiguous_on_both_sides_become_one_piece_per_buffer() -> None:
    src_starts, dst_starts, lengths = contiguous_runs(
        torch.tensor([4, 5, 6, 7, 8, 9, 20, 21]).numpy(), torch.tensor([40, 41, 42, 43, 10, 11, 12, 13]).numpy()
    )
    assert (src_starts.tolist(), dst_starts.tolist(), lengths.tolist()) == ([4, 8, 20], [40, 10, 12], [4, 2, 2])

    here = KVLayout([1000, 9000], [8000, 8000], [16, 32], 1, 0, 0, 0)
    there = KVLayout([50000, 90000], [8000, 8000], [16, 32], 1, 0, 0, 0)
    assert pieces(here, there, [4, 5, 6, 9], [1, 2, 3, 7]) == (
        [1000 + 4 * 16, 1000 + 9 * 16, 9000 + 4 * 32, 9000 + 9 * 32],
        [50000 + 1 * 16, 50000 + 7 * 16, 90000 + 1 * 32, 90000 + 7 * 32],
        [3 * 16, 16, 3 * 32, 32],
    )
    assert pieces(here, there, [], []) == ([], [], [])


def test_fake_backend_moves_no_kv_but_delivers_the_record(pairs: Any) -> None:
    pair, room = pairs("fake"), new_room()
    pair.open(room)
    pair.prefill.send(room, scattered_slots(1, 1)[:20], 0)
    pair.prefill.send(room, scattered_slots(1, 1)[20:], 20, b"record")
    assert pair.decode.wait(room) == KVPoll.SUCCESS
    assert pair.decode.record(room) == b"record"
    assert not any(pair.decode.kv(list(range(1, PROMPT + 1))))
    assert (pair.prefill.wait(room), pair.prefill.bytes_sent(room)) == (KVPoll.SUCCESS, 0)


# -- failures


@pytest.mark.slow
def test_injected_failures_fail_their_rooms_on_both_sides_with_the_reason(peer: Peer) -> None:
    pair = Pair(peer, "fake", timeouts=Timeouts(bootstrap=2.0), env={FAILURE_ENV: "transfer:doomed-,bootstrap:lost-"})
    try:
        doomed, fine, lost = f"doomed-{new_room()}", new_room(), f"lost-{new_room()}"
        pair.decode.open(lost, pair.port)  # (its bootstrap never completes: it fails at the timeout)
        for room in (doomed, fine):
            pair.open(room)
            pair.prefill.send(room, list(range(1, PROMPT + 1)), 0, b"record")
        assert (pair.prefill.wait(doomed), pair.decode.wait(doomed)) == (KVPoll.FAILED, KVPoll.FAILED)
        assert FAILURE_ENV in pair.prefill.failure(doomed) and FAILURE_ENV in pair.decode.failure(doomed)
        assert pair.decode.failure(doomed).startswith("prefill side: ")
        assert (pair.prefill.wait(fine), pair.decode.wait(fine)) == (KVPoll.SUCCESS, KVPoll.SUCCESS)

        assert pair.decode.wait(lost) == KVPoll.FAILED
        assert f"{HOST}:{pair.port}" in pair.decode.failure(lost)
    finally:
        pair.close()


@pytest.mark.parametrize("backend", ["fake", "mooncake"])
def test_bootstrap_that_never_answers_fails_after_the_timeout_naming_the_server(backend: str) -> None:
    decode = Side(backend, "decode", timeouts=SHORT)
    try:
        nobody = free_port()
        decode.open("nobody/0", nobody)
        with BootstrapServer(HOST, 0) as server:  # (up, but its prefill rank never registers)
            decode.open("unregistered/0", server.port)
            assert decode.wait("unregistered/0") == KVPoll.FAILED
            assert f"{HOST}:{server.port}" in decode.failure("unregistered/0")
            assert "has not registered" in decode.failure("unregistered/0")
        assert decode.wait("nobody/0") == KVPoll.FAILED
        assert f"bootstrap server at {HOST}:{nobody}" in decode.failure("nobody/0")
        assert decode.num_rooms() == 0
    finally:
        decode.close()


def test_unreachable_decode_rank_fails_the_transfer_at_once(pairs: Any) -> None:
    """The decode server dies after saying where the KV goes: the first write fails (the timeouts are
    the defaults: nothing here waits for one), and the prefill side says why."""
    pair, room = pairs("mooncake"), new_room()
    doomed = Peer()
    try:
        decode = doomed.side("mooncake", "decode")
        decode.open(room, pair.port)
        assert decode.wait(room, KVPoll.BOOTSTRAPPING) == KVPoll.WAITING_FOR_INPUT
        decode.init(room, list(range(1, PROMPT + 1)), 0)
        pair.prefill.open(room, pair.port)
        assert pair.prefill.wait(room, KVPoll.BOOTSTRAPPING) == KVPoll.WAITING_FOR_INPUT
    finally:
        doomed.kill()
    pair.prefill.send(room, list(range(1, PROMPT + 1)), 0, b"record")
    assert pair.prefill.wait(room) == KVPoll.FAILED
    assert "unreachable" in pair.prefill.failure(room) and "decode rank at 127.0.0.1:" in pair.prefill.failure(room)
    assert pair.prefill.num_rooms() == 0


@pytest.mark.slow
def test_silent_prefill_rank_fails_the_rooms_waiting_on_it() -> None:
    """The prefill server dies with a request in flight: the decode side stops hearing from it."""
    doomed, room = Peer(), new_room()
    pair = Pair(doomed, "fake", timeouts=Timeouts(heartbeat=1.0))
    try:
        pair.open(room)
        doomed.kill()
        assert pair.decode.wait(room) == KVPoll.FAILED
        assert "stopped answering" in pair.decode.failure(room)
    finally:
        doomed.kill()
        pair.decode.close()
        pair.server.stop()


def test_unequal_kv_layouts_fail_both_sides_with_the_reason(peer: Peer) -> None:
    pair = Pair(peer, "fake", decode_head_dim=2 * HEAD_DIM)
    try:
        room = new_room()
        pair.decode.open(room, pair.port)
        assert pair.decode.wait(room) == KVPoll.FAILED
        assert "same model with the same KV dtype" in pair.decode.failure(room)
    finally:
        pair.close()


# -- aborts, and rooms that arrive in any order


@pytest.mark.parametrize("backend", ["fake", "mooncake"])
def test_abort_on_either_side_fails_the_room_on_the_other(pairs: Any, backend: str) -> None:
    pair = pairs(backend)
    by_prefill, by_decode = new_room(), new_room()
    for room in (by_prefill, by_decode):
        pair.open(room)
        pair.prefill.send(room, list(range(1, 21)), 0)  # (some KV already on its way)

    pair.prefill.abort(by_prefill)
    assert (pair.prefill.state(by_prefill), pair.decode.wait(by_prefill)) == (KVPoll.FAILED, KVPoll.FAILED)
    assert pair.decode.failure(by_prefill) == "prefill side: the prefill server aborted the request"

    pair.decode.abort(by_decode)
    assert (pair.decode.state(by_decode), pair.prefill.wait(by_decode)) == (KVPoll.FAILED, KVPoll.FAILED)
    assert pair.prefill.failure(by_decode) == "decode side: the decode server aborted the request"
    pair.prefill.send(by_decode, list(range(21, PROMPT + 1)), 20, b"record")  # (ignored: it failed)
    assert (pair.prefill.num_rooms(), pair.decode.num_rooms()) == (0, 0)


def test_a_side_that_learns_of_a_room_after_the_other_aborted_it_fails_at_once(pairs: Any) -> None:
    pair = pairs("fake")
    decode_first, prefill_first = new_room(), new_room()

    pair.decode.open(decode_first, pair.port)
    pair.decode.wait(decode_first, KVPoll.BOOTSTRAPPING)
    pair.decode.abort(decode_first)
    wait_until(lambda: pair.prefill.num_rooms() == 1)  # (the decode side's word has come)
    pair.prefill.open(decode_first, pair.port)  # (its request reaches the prefill server only now)
    assert pair.prefill.wait(decode_first) == KVPoll.FAILED
    assert pair.prefill.failure(decode_first) == "decode side: the decode server aborted the request"

    pair.prefill.open(prefill_first, pair.port)
    pair.prefill.abort(prefill_first)
    pair.decode.open(prefill_first, pair.port)
    pair.decode.wait(prefill_first, KVPoll.BOOTSTRAPPING)
    pair.decode.init(prefill_first, list(range(1, PROMPT + 1)), 0)
    assert pair.decode.wait(prefill_first) == KVPoll.FAILED
    assert pair.decode.failure(prefill_first) == "prefill side: the prefill server aborted the request"
    assert (pair.prefill.num_rooms(), pair.decode.num_rooms()) == (0, 0)


def test_waits_for_a_peer_that_never_comes_end_and_leave_nothing(peer: Peer) -> None:
    pair = Pair(peer, "fake", timeouts=Timeouts(waiting=0.5))
    try:
        no_request, no_destination = new_room(), new_room()
        pair.decode.open(no_request, pair.port)  # (the prefill server never gets this request)
        pair.decode.wait(no_request, KVPoll.BOOTSTRAPPING)
        pair.decode.init(no_request, list(range(1, PROMPT + 1)), 0)
        pair.prefill.open(no_destination, pair.port)  # (nor the decode server this one)
        assert pair.decode.wait(no_request) == KVPoll.FAILED
        assert "got no request for room" in pair.decode.failure(no_request)
        assert pair.prefill.wait(no_destination) == KVPoll.FAILED
        assert "did not say where" in pair.prefill.failure(no_destination)
        wait_until(lambda: pair.prefill.num_rooms() == 0)  # (the note the failed sender left expires too)
        assert pair.decode.num_rooms() == 0
    finally:
        pair.close()


@pytest.mark.parametrize("backend", ["fake", "mooncake"])
def test_many_rooms_leave_no_state_behind(pairs: Any, backend: str) -> None:
    pair = pairs(backend)
    rooms = [new_room() for _ in range(200 if backend == "fake" else 40)]
    for room in rooms:
        pair.decode.open(room, pair.port)
    for i, room in enumerate(rooms):
        pair.decode.wait(room, KVPoll.BOOTSTRAPPING)
        pair.decode.init(room, list(range(1, PROMPT + 1)), i)
        pair.prefill.open(room, pair.port)
    for i, room in enumerate(rooms):
        pair.prefill.wait(room, KVPoll.BOOTSTRAPPING)
        if i % 10 == 1:
            pair.prefill.abort(room)
        elif i % 10 == 2:
            pair.decode.abort(room)
        else:
            pair.prefill.send(room, list(range(1, PROMPT + 1)), 0, f"record {i}".encode())
    ended = [(pair.prefill.wait(room), pair.decode.wait(room)) for room in rooms]
    records = [pair.decode.record(room) for room in rooms]
    assert ended == [
        (KVPoll.FAILED, KVPoll.FAILED) if i % 10 in (1, 2) else (KVPoll.SUCCESS,) * 2 for i in range(len(rooms))
    ]
    assert records == [None if i % 10 in (1, 2) else f"record {i}".encode() for i in range(len(rooms))]
    assert (pair.prefill.num_rooms(), pair.decode.num_rooms()) == (0, 0)


# -- the bootstrap server, and making backends


def test_bootstrap_server_registers_and_looks_up_ranks_and_stops_quietly(capfd: pytest.CaptureFixture[str]) -> None:
    layout = KVLayout([1, 2], [64, 64], [8, 8], 1, 3, 4, 16)
    ranks = [RankInfo(r, 2, f"tcp://{HOST}:{5000 + r}", f"{HOST}:{6000 + r}", layout) for r in range(2)]
    with BootstrapServer(HOST, 0) as server:
        for info in ranks:
            register_rank((HOST, server.port), info, timeout=5)
        assert [lookup_rank((HOST, server.port), r, timeout=5) for r in range(2)] == ranks
        with pytest.raises(
            TimeoutError, match=f"no prefill rank 2 found through the bootstrap server at {HOST}:{server.port}"
        ):
            lookup_rank((HOST, server.port), 2, timeout=0.3)
        with pytest.raises(
            ValueError, match=f"cannot listen on {HOST}:{server.port} .*--disaggregation-bootstrap-port"
        ):
            BootstrapServer(HOST, server.port)
    server.stop()
    assert capfd.readouterr() == ("", "")


def test_create_transfer_backend_makes_the_chosen_backend_and_registers_prefill_ranks() -> None:
    pool = TokenToKVPool(16, KVPoolLayout(LAYERS, KV_HEADS, HEAD_DIM, 1, torch.float32), CPU)
    records = torch.zeros(2, 64, dtype=torch.uint8)  # (alive while the backends have it registered)
    layout = KVLayout.of(pool, records)
    assert layout.slot_bytes == [KV_HEADS * HEAD_DIM * 4] * 2 * LAYERS and layout.meta_slot_bytes == 64
    with BootstrapServer(HOST, 0) as server:
        for name, cls in BACKENDS.items():
            args = ServerArgs(disaggregation_transfer_backend=name, disaggregation_bootstrap_port=server.port)
            backend = create_transfer_backend(TransferConcerns.of(args), "prefill", 0, layout)
            try:
                assert isinstance(backend, cls)
                assert lookup_rank((HOST, server.port), 0, timeout=5) == backend.info
            finally:
                backend.close()


@pytest.mark.slow
def test_mooncake_missing_is_an_error_naming_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[pd\]"'):
        transfer_engine_class()
