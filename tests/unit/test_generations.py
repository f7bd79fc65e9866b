"""The coordinator's merge from files: generation g's state and the deltas in, g+1's files out.

The streaming driver must give exactly what the in-memory Eq. 1 (``outer_step``, pinned
against torch's SGD in tests/unit/test_outer.py) gives; files in any tensor order must load alike;
a bad state file is refused by name; and the merge's memory must not grow with the model.
"""

from __future__ import annotations

import math
import re
import struct
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from crossfed import outer
from crossfed.coordinator import generations
from crossfed.coordinator.generations import (
    MOMENTUM,
    StateView,
    merge_step,
    read_shapes,
    write_generation,
)
from crossfed.coordinator.service import CoordinatorError
from crossfed.outer import StateError, outer_step, stream_outer_step
from crossfed.outer_presets import OuterConfig
from crossfed.wire.codecs import open_delta, save_delta
from crossfed.wire.digests import digest_file
from crossfed.wire.tensors import StreamWriter, TensorFile, TensorSpec, save_tensors, stream_writer
from tests.conftest import digest_of, staged_delta
from tests.unit.test_outer import SHAPES  # the same tensor shapes as Eq. 1's pinned tests

KERNELS = ["eager", pytest.param("fused", marks=pytest.mark.slow)]
PIN = 2e-6


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small eager blocks and fused size floor, so the small tensors exercise both paths."""
    monkeypatch.setattr(outer, "_EAGER_BLOCK", 1000)
    monkeypatch.setattr(outer, "_FUSED_MIN_NUMEL", 64)


def tensors(seed: int, scale: float, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(s, generator=gen) * scale).to(dtype) for k, s in SHAPES.items()}


def collect(out: dict[str, torch.Tensor]):  # noqa: ANN201
    def emit(name: str, w: torch.Tensor, b: torch.Tensor | None) -> None:
        out[name] = w.clone()
        if b is not None:
            out[MOMENTUM + name] = b.clone()

    return emit


@pytest.mark.parametrize("kernel", KERNELS)
def test_streaming_equals_the_in_memory_outer_step(kernel: str, small_blocks: None) -> None:
    """Two rounds (the first fills the momentum) through both drivers: bit for bit with the
    eager kernel, to the pinned 2e-6 with the fused one (the same kernel either way)."""
    master, momentum = tensors(0, 0.5), {}
    state = {k: v.clone() for k, v in master.items()}
    for r in range(2):
        deltas = [tensors(10 * r + i, 0.01, torch.bfloat16) for i in range(3)]
        tokens = [300, 0, 100]  # a zero-token delta is not read
        got: dict[str, torch.Tensor] = {}
        masters = {k: v.clone() for k, v in state.items() if not k.startswith(MOMENTUM)}
        moments = {k.removeprefix(MOMENTUM): v for k, v in state.items() if k.startswith(MOMENTUM)}
        report = stream_outer_step(
            SHAPES, masters, moments or None, deltas, tokens, collect(got), kernel=kernel
        )
        expected = outer_step(master, momentum, deltas, tokens, OuterConfig(), kernel=kernel)
        assert report == expected
        want = {**master, **{MOMENTUM + k: v for k, v in momentum.items()}}
        assert list(got) == [n for k in SHAPES for n in (k, MOMENTUM + k)]
        for name, value in want.items():
            if kernel == "eager":
                assert torch.equal(got[name], value), name
            else:
                assert torch.allclose(got[name], value, rtol=0, atol=PIN), name
        state = got


def test_no_contributor_hands_the_state_back_unchanged() -> None:
    master = tensors(1, 0.5)
    got: dict[str, torch.Tensor] = {}
    views = {k: v.clone() for k, v in master.items()}
    report = stream_outer_step(SHAPES, views, None, [tensors(2, 0.01)], [0], collect(got))
    assert not report.applied and got.keys() == master.keys()
    assert all(torch.equal(got[k], master[k]) for k in master)


def test_bad_state_is_refused_by_name() -> None:
    master = tensors(1, 0.5)
    half = {k: v.half() if k == "norm.weight" else v for k, v in master.items()}
    with pytest.raises(StateError, match="master tensor 'norm.weight'"):
        stream_outer_step(SHAPES, half, None, [tensors(2, 0.01)], [5], lambda *a: None)
    partial = {k: v for k, v in master.items() if k != "embed.weight"}
    with pytest.raises(StateError, match="missing 'embed.weight'"):
        stream_outer_step(SHAPES, master, partial, [tensors(2, 0.01)], [5], lambda *a: None)


def write_state(path: Path, master: dict, momentum: dict, *, interleaved: bool) -> None:
    """A state file with the new (name, momentum::name) order or the old one (all master
    tensors, then all momentum tensors)."""
    if interleaved:
        state = {n: v for k in master for n, v in ((k, master[k]), (MOMENTUM + k, momentum[k]))}
    else:
        state = {**master, **{MOMENTUM + k: v for k, v in momentum.items()}}
    save_tensors(state, path, {"generation": "1"}, algo=None)


def generation_one(
    tmp_path: Path, deltas: int, *, interleaved: bool = True
) -> tuple[dict, dict, list[Path]]:
    """Generation 1's state on disk (master and momentum) and ``deltas`` bf16 delta files."""
    master, momentum = tensors(3, 0.5), tensors(4, 1e-3)
    write_state(tmp_path / "master-1", master, momentum, interleaved=interleaved)
    paths = []
    for i in range(deltas):
        paths.append(tmp_path / f"delta-{i}")
        save_tensors(tensors(20 + i, 0.01, torch.bfloat16), paths[-1])
    return master, momentum, paths


@pytest.mark.parametrize("interleaved", [True, False], ids=["new-layout", "old-layout"])
def test_a_merge_from_files_writes_what_the_in_memory_step_computes(
    tmp_path: Path, interleaved: bool
) -> None:
    """Generation 1 on disk (in either tensor order), two delta files in, generation 2's
    files out: fp32 state, bf16 model and its digest equal the in-memory step's."""
    master, momentum, paths = generation_one(tmp_path, 2, interleaved=interleaved)
    shapes = read_shapes(tmp_path / "master-1")
    assert shapes == SHAPES

    def step(emit):  # noqa: ANN001, ANN202
        return merge_step(tmp_path / "master-1", shapes, paths, [70, 30], emit, OuterConfig())

    out_state, out_model = tmp_path / "master-2", tmp_path / "global-2"
    digest, report, write_s = write_generation(out_state, out_model, shapes, 2, step, momentum=True)
    deltas = [load_file(str(p)) for p in paths]
    expected = outer_step(master, momentum, deltas, [70, 30], OuterConfig())
    assert report == expected and write_s > 0
    state = load_file(str(out_state))
    assert state.keys() == {*master, *(MOMENTUM + k for k in momentum)}
    assert all(torch.equal(state[k], master[k]) for k in master)
    assert all(torch.equal(state[MOMENTUM + k], momentum[k]) for k in momentum)
    model = load_file(str(out_model))
    assert all(torch.equal(model[k], master[k].to(torch.bfloat16)) for k in master)
    assert digest == digest_file(out_model)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def _deltas(tmp_path: Path, master: dict, codec: str) -> list[Path]:
    """Two contributors' delta files against ``master``: plain bf16 or fp32, int8 or int4."""
    paths = []
    for i in range(2):
        paths.append(tmp_path / f"delta-{codec}-{i}")
        step = tensors(20 + i, 0.01)
        if codec == "fp32":
            save_tensors(step, paths[-1])
        else:
            site = {k: master[k] + step[k] for k in master}
            save_delta(site, master, paths[-1], codec=codec)
    return paths


@pytest.mark.parametrize("codec", ["none", "fp32", "int8", "int4"])
@pytest.mark.parametrize("with_momentum", [True, False], ids=["momentum", "first-step"])
def test_a_merge_in_row_blocks_writes_the_files_a_merge_by_tensor_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, codec: str, with_momentum: bool
) -> None:
    """Blocks of about 240 fp32 values cut every tensor of more than one row into row blocks
    (1-D ones too); a plain delta is read by rows, a codec's decoded whole. Both files of
    generation 2 are byte for byte those of the merge by whole tensors, which equals the
    in-memory step, and the writer was handed blocks."""
    master, momentum = tensors(3, 0.5), tensors(4, 1e-3) if with_momentum else {}
    if with_momentum:
        write_state(tmp_path / "master-1", master, momentum, interleaved=True)
    else:
        save_tensors(master, tmp_path / "master-1", {"generation": "1"}, algo=None)
    paths = _deltas(tmp_path, master, codec)
    emitted: list[tuple[str, tuple[int, ...]]] = []

    def step(emit):  # noqa: ANN001, ANN202
        def record(name: str, w: torch.Tensor, b: torch.Tensor | None):  # noqa: ANN202
            emitted.append((name, tuple(w.shape)))
            return emit(name, w, b)

        return merge_step(tmp_path / "master-1", SHAPES, paths, [70, 30], record, OuterConfig())

    files = {}
    for limit in (1 << 30, 4 * 240):
        monkeypatch.setattr(generations, "PIECE_BYTES", limit)
        out = tmp_path / f"out-{limit}"
        digest, report, _ = write_generation(
            out / "master-2", out / "global-2", SHAPES, 2, step, momentum=True
        )
        files[limit] = (digest, (out / "master-2").read_bytes(), (out / "global-2").read_bytes())
    assert files[4 * 240] == files[1 << 30]
    blocks = [shape for name, shape in emitted if shape != SHAPES[name]]
    assert (24, 24) not in blocks and len(blocks) > 30, blocks  # embed.weight: 10 blocks
    with open_delta(paths[0]) as d0, open_delta(paths[1]) as d1:
        deltas = [dict(d0.items()), dict(d1.items())]
    expected = outer_step(master, momentum, deltas, [70, 30], OuterConfig())
    assert report == expected
    state = load_file(str(tmp_path / "out-960" / "master-2"))
    assert all(torch.equal(state[k], master[k]) for k in master)
    assert all(torch.equal(state[MOMENTUM + k], momentum[k]) for k in momentum)


def test_stream_writer_takes_rows_in_order_and_refuses_rows_past_a_tensor(tmp_path: Path) -> None:
    """Rows of two tensors interleaved (the second's written ahead, in place) give the file
    the whole tensors give; rows past a tensor's end and ahead-writes into a digested file
    are refused."""
    a, b = torch.arange(12.0).view(6, 2), -torch.arange(12.0).view(6, 2)
    specs = [TensorSpec.of("a", a), TensorSpec.of("b", b), TensorSpec.of("c", a[0])]
    with stream_writer(tmp_path / "whole", specs, algo=None) as whole:
        whole.write(a), whole.write(b), whole.write(a[0])
    with stream_writer(tmp_path / "rows", specs, algo=None) as rows:
        for lo in (0, 2, 4):
            rows.write_part(b[lo : lo + 2], ahead=1)
            rows.write_part(a[lo : lo + 2])
        assert rows.spec.name == "c"
        rows.write(a[0])
    assert (tmp_path / "rows").read_bytes() == (tmp_path / "whole").read_bytes()
    with pytest.raises(ValueError, match="past the end of tensor 'a'"):
        with stream_writer(tmp_path / "over", specs, algo=None) as over:
            over.write_part(a[:4])
            over.write_part(a[:4])
    with pytest.raises(ValueError, match="digested file is written in order"):
        with stream_writer(tmp_path / "hashed", specs) as hashed:
            hashed.write_part(b[:2], ahead=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows", "whole"]


def test_a_failing_fill_leaves_no_file(tmp_path: Path) -> None:
    def fill(emit):  # noqa: ANN001, ANN202
        emit("embed.weight", torch.zeros(SHAPES["embed.weight"]), None)
        raise RuntimeError("delta unreadable")

    with pytest.raises(RuntimeError, match="delta unreadable"):
        write_generation(tmp_path / "m", tmp_path / "g", SHAPES, 1, fill, momentum=False)
    assert list(tmp_path.iterdir()) == []


def test_a_read_that_fails_on_the_reader_thread_is_raised_by_the_merge(tmp_path: Path) -> None:
    """Generation 1's state holds its fifth tensor as bf16: the reader thread, one tensor
    ahead of the arithmetic, cannot read it into its fp32 buffer. The merge raises that
    error by name after the four tensors before it went to the writer, and leaves no file."""
    master, momentum = tensors(3, 0.5), tensors(4, 1e-3)
    bad = list(SHAPES)[4]
    master[bad] = master[bad].to(torch.bfloat16)
    write_state(tmp_path / "master-1", master, momentum, interleaved=True)
    delta = tmp_path / "delta-0"
    save_tensors(tensors(20, 0.01, torch.bfloat16), delta)
    emitted: list[str] = []

    def step(emit):  # noqa: ANN001, ANN202
        def record(name: str, w: torch.Tensor, b: torch.Tensor | None):  # noqa: ANN202
            emitted.append(name)
            return emit(name, w, b)

        return merge_step(tmp_path / "master-1", SHAPES, [delta], [10], record, OuterConfig())

    out = tmp_path / "out"
    with pytest.raises(ValueError, match=rf"cannot hold.*{re.escape(bad)}"):
        write_generation(out / "master-2", out / "global-2", SHAPES, 2, step, momentum=True)
    assert emitted == list(SHAPES)[:4]
    assert list(out.iterdir()) == []
    assert [t.name for t in threading.enumerate() if t.name.startswith("generation-")] == []


class _Gate:
    """Where the deltas' reads of one piece meet: each read waits until every delta has
    begun reading that piece, for at most ``timeout_s`` (the gate then breaks for good, so a
    merge that reads one delta after another fails fast instead of waiting at every piece)."""

    def __init__(self, parties: int, timeout_s: float = 10.0) -> None:
        self.parties, self.timeout_s = parties, timeout_s
        self.arrived: dict[tuple, int] = {}
        self.cond = threading.Condition()
        self.broken = False

    def arrive(self, piece: tuple) -> None:
        with self.cond:
            self.arrived[piece] = self.arrived.get(piece, 0) + 1
            self.cond.notify_all()
            met = self.broken or self.cond.wait_for(
                lambda: self.arrived[piece] >= self.parties, self.timeout_s
            )
            self.broken = self.broken or not met


class _GatedDelta(TensorFile):
    """A delta file whose every tensor read first waits at ``gate``; ``fail_at`` names a
    tensor whose read raises instead (the store lost it)."""

    def __init__(self, path: Path, gate: _Gate, fail_at: str | None = None) -> None:
        super().__init__(path)
        self.gate, self.fail_at = gate, fail_at

    def read(self, name, out=None, *, rows=None):  # noqa: ANN001, ANN201
        self.gate.arrive((name, rows))
        if name == self.fail_at:
            raise OSError(f"{self.path.name}: {name} is gone from the store")
        return super().read(name, out, rows=rows)


@pytest.mark.parametrize("limit", [1 << 30, 4 * 240], ids=["by-tensor", "by-rows"])
def test_the_merge_reads_the_deltas_of_one_piece_side_by_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    """Three deltas whose reads of a piece each wait until all three have begun it: the
    merge gets through only if it reads them at once (the round trips of ranged reads from an
    object store then overlap instead of adding up), and it writes what the in-memory step
    computes, whole tensors or row blocks alike."""
    monkeypatch.setattr(generations, "PIECE_BYTES", limit)
    master, momentum, paths = generation_one(tmp_path, 3)
    gate = _Gate(3)
    tokens = [50, 30, 20]

    def step(emit):  # noqa: ANN001, ANN202
        gated = [_GatedDelta(p, gate) for p in paths]
        return merge_step(tmp_path / "master-1", SHAPES, gated, tokens, emit, OuterConfig())

    out = tmp_path / "out"
    _, report, _ = write_generation(
        out / "master-2", out / "global-2", SHAPES, 2, step, momentum=True
    )
    assert not gate.broken, "the deltas of a piece were read one after another"
    assert len(gate.arrived) >= len(SHAPES)
    deltas = [load_file(str(p)) for p in paths]
    assert report == outer_step(master, momentum, deltas, tokens, OuterConfig())
    state = load_file(str(out / "master-2"))
    assert all(torch.equal(state[k], master[k]) for k in master)
    assert [t.name for t in threading.enumerate() if t.name.startswith("generation-")] == []


def test_a_delta_read_that_fails_beside_the_others_is_raised_and_no_reader_is_left(
    tmp_path: Path,
) -> None:
    """The second of three deltas cannot read its fourth tensor while the other two read
    theirs: the merge raises that error after the three tensors before it were written,
    leaves no file, and no reader thread outlives it."""
    master, momentum, paths = generation_one(tmp_path, 3)
    bad = list(SHAPES)[3]
    gate = _Gate(3)
    emitted: list[str] = []

    def step(emit):  # noqa: ANN001, ANN202
        def record(name: str, w: torch.Tensor, b: torch.Tensor | None):  # noqa: ANN202
            emitted.append(name)
            return emit(name, w, b)

        gated = [_GatedDelta(p, gate, fail_at=bad if i == 1 else None) for i, p in enumerate(paths)]
        return merge_step(tmp_path / "master-1", SHAPES, gated, [1, 1, 1], record, OuterConfig())

    out = tmp_path / "out"
    with pytest.raises(OSError, match=rf"delta-1: {re.escape(bad)} is gone"):
        write_generation(out / "master-2", out / "global-2", SHAPES, 2, step, momentum=True)
    assert emitted == list(SHAPES)[:3] and not gate.broken
    assert list(out.iterdir()) == []
    assert [t.name for t in threading.enumerate() if t.name.startswith("generation-")] == []


def test_tensor_file_reads_fresh_or_into_a_buffer_and_refuses_bad_headers(tmp_path: Path) -> None:
    master = tensors(5, 0.5)
    path = tmp_path / "s"
    save_tensors(master, path, {"k": "v"}, algo=None)
    buffer = torch.empty(5000)
    with TensorFile(path) as f:
        assert f.keys() == list(SHAPES) and f.metadata() == {"k": "v"}
        for name, value in master.items():
            assert torch.equal(f.get_tensor(name), value)
            into = f.read(name, buffer)
            assert torch.equal(into, value) and into.data_ptr() == buffer.data_ptr()
        with pytest.raises(ValueError, match="cannot hold"):
            f.read("layers.1.mlp.w2", torch.empty(10))
    view = StateView(path, momentum=False)
    assert len(view) == len(SHAPES) and torch.equal(view["norm.weight"], master["norm.weight"])
    assert len(StateView(path, momentum=True)) == 0

    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    cut = tmp_path / "cut"
    cut.write_bytes(raw[: len(raw) - 8])
    with pytest.raises(ValueError, match="does not fit"):
        TensorFile(cut)
    huge = tmp_path / "huge"
    huge.write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])
    with pytest.raises(ValueError, match="header length"):
        TensorFile(huge)
    junk = tmp_path / "junk"
    junk.write_bytes(raw[:8] + b"{" * length + raw[8 + length :])
    with pytest.raises(ValueError, match="not JSON"):
        TensorFile(junk)


def _status_kib(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    assert match is not None, key
    return int(match.group(1))


def test_the_merge_holds_a_few_tensors_not_the_model(tmp_path: Path) -> None:
    """A 48-tensor model of 64M parameters (512 MiB of fp32 state, two 128 MiB deltas): the
    merge's peak resident memory grows by a few of its largest tensors (4 MiB of fp32
    each), far below the state it reads and writes."""
    shapes = {f"layers.{i}.w": (1024, 1024 + 32 * (i % 3)) for i in range(48)}
    shapes["embed.weight"] = (1000, 1024)
    top = max(a * b for a, b in shapes.values()) * 4
    gen = torch.Generator().manual_seed(0)
    state = {}
    for name, shape in shapes.items():  # written one tensor at a time, like the deltas
        state[name] = torch.randn(shape, generator=gen)
        state[MOMENTUM + name] = torch.randn(shape, generator=gen) * 1e-3
    save_tensors(state, tmp_path / "master-1", algo=None)
    state_bytes = sum(v.nbytes for v in state.values())
    del state
    paths = []
    for i in range(2):
        paths.append(tmp_path / f"delta-{i}")
        delta = {k: torch.randn(s, generator=gen).to(torch.bfloat16) for k, s in shapes.items()}
        save_tensors(delta, paths[-1])
        del delta

    def step(emit):  # noqa: ANN001, ANN202
        return merge_step(tmp_path / "master-1", shapes, paths, [3, 1], emit, OuterConfig())

    # compiled before the measured region, as the coordinator does when it loads a run: the
    # first compile in a process holds compiler memory that is not the merge's
    outer.warm_up(sum(a * b for a, b in shapes.values()))
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    before = _status_kib("VmRSS")
    write_generation(tmp_path / "master-2", tmp_path / "global-2", shapes, 2, step, momentum=True)
    growth = (_status_kib("VmHWM") - before) * 1024
    assert growth < 10 * top + (48 << 20), f"peak grew {growth / 2**20:.0f} MiB"
    assert growth < state_bytes / 4


def test_leases_and_heartbeats_are_answered_while_a_merge_runs(
    tmp_path: Path, tiny_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The merge holds the lock only to start and to commit: held mid-write here, a
    heartbeat is answered, the closing round refuses a lease and a delta, the round after it
    grants an early lease (to a site that contributed to the closing one), and the merge then
    commits generation 1 and opens round 2 with that lease as its first."""
    staged = staged_delta(tmp_path / "state", tiny_data, seed=3)
    coord, now, held = staged.coord, staged.now, staged.held
    coord.submit(
        site="lumi", round_no=1, lease_id=held["lease_id"], generation=0, tokens=100, steps=4,
        consumed=held["n_blocks"], blob=staged.key,
    )  # fmt: skip
    coord.register("snellius", digest_of(tiny_data), 1, 1.0)
    other = coord.lease("snellius", 1, 2, None, 1.0)["lease"]
    inside, go_on = threading.Event(), threading.Event()
    write = StreamWriter.write

    def held_write(self: StreamWriter, tensor: torch.Tensor) -> None:
        inside.set()
        assert go_on.wait(60)
        write(self, tensor)

    monkeypatch.setattr(StreamWriter, "write", held_write)
    for _ in range(13):  # past the round's 600 s deadline, snellius's lease kept alive
        now[0] += 50.0
        coord.heartbeat(other["lease_id"], "snellius", 1, None)
    result: dict = {}
    merger = threading.Thread(target=lambda: result.update(coord.tick() or {}))
    merger.start()
    try:
        assert inside.wait(60)
        beat = coord.heartbeat(other["lease_id"], "snellius", 1, None)  # blocked before
        assert beat["lease"]["lease_id"] == other["lease_id"]
        with pytest.raises(CoordinatorError) as refused:
            coord.lease("lumi", 1, 2, None, 1.0)
        assert refused.value.code == "round_closed"
        with pytest.raises(CoordinatorError) as stale:
            coord.submit(
                site="snellius", round_no=1, lease_id=other["lease_id"], generation=0,
                tokens=10, steps=1, consumed=1, blob=staged.key, by=None,
            )  # fmt: skip
        assert stale.value.code == "stale_generation"
        ahead = coord.lease("lumi", 2, 2, None, 1.0)  # overlapped rounds: the next round's
        assert ahead["early"] is True and ahead["lease"]["round"] == 2
        assert ahead["global_step"] == 4  # exact: the merged round's longest phase
        assert coord.status()["generation"] == 0
    finally:
        go_on.set()
        merger.join(120)
    assert result["generation"] == 1 and result["contributors"] == ["lumi"]
    assert coord.status()["generation"] == 1 and coord.status()["round"] == 2
    assert coord.status()["global_step"] == ahead["global_step"]
    opened = coord.round_info(2)
    assert opened["first_lease_at"] == opened["opened_at"]
    live = {x["lease_id"]: x["round"] for x in coord.status()["active_leases"]}
    assert live == {ahead["lease"]["lease_id"]: 2}


def _fp32_bytes(shape: tuple[int, ...], rows: tuple[int, int] | None) -> int:
    """fp32 bytes of rows ``rows`` (all when None) of a tensor of ``shape``."""
    count = rows[1] - rows[0] if rows else (shape[0] if shape else 1)
    return 4 * count * math.prod(shape[1:])


class _StoreDelta(TensorFile):
    """A delta file read as an object store's is (``remote``: each read a round trip), whose
    reads in flight are counted: ``most`` reads and ``most_bytes`` fp32 bytes of pieces at
    once. Its first read waits (10 s at most) until a second one has begun, so a merge that
    reads it ahead shows it whatever the machine's load."""

    remote = True

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.cond = threading.Condition()
        self.flying: dict[tuple, int] = {}
        self.reads = self.most = self.most_bytes = 0
        self.second_came: bool | None = None

    def read(self, name, out=None, *, rows=None):  # noqa: ANN001, ANN201
        shape = self.spec(name).shape
        piece = (name, rows)
        with self.cond:
            self.flying[piece] = _fp32_bytes(shape, rows)
            self.reads += 1
            self.most = max(self.most, len(self.flying))
            self.most_bytes = max(self.most_bytes, sum(self.flying.values()))
            self.cond.notify_all()
            if self.reads == 1 and self.remote:
                self.second_came = self.cond.wait_for(lambda: self.reads > 1, 10.0)
        try:
            return super().read(name, out, rows=rows)
        finally:
            with self.cond:
                del self.flying[piece]


@pytest.mark.parametrize(
    ("limit", "remote"),
    [(1 << 30, True), (4 * 240, True), (4 * 240, False)],
    ids=["store-by-tensor", "store-by-rows", "local-file"],
)
def test_a_delta_in_a_store_is_read_ahead_within_a_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: int, remote: bool
) -> None:
    """A delta an object store holds is read several pieces ahead of the merge (each read
    a round trip: one at a time, a model's hundreds of tensors wait out hundreds of them),
    at most READAHEAD_PIECES at once and PIECE_BYTES of fp32 beyond the largest piece; a
    local file's pieces are read one at a time (no memory spent for nothing). The merge
    writes what the in-memory step computes, and leaves no reader thread."""
    monkeypatch.setattr(generations, "PIECE_BYTES", limit)
    monkeypatch.setattr(generations, "READAHEAD_PIECES", 3)
    master, momentum, paths = generation_one(tmp_path, 2)
    tokens = [60, 40]
    deltas: list[_StoreDelta] = []

    def step(emit):  # noqa: ANN001, ANN202
        deltas[:] = [_StoreDelta(p) for p in paths]
        for delta in deltas:
            delta.remote = remote
        return merge_step(tmp_path / "master-1", SHAPES, deltas, tokens, emit, OuterConfig())

    out = tmp_path / "out"
    _, report, _ = write_generation(
        out / "master-2", out / "global-2", SHAPES, 2, step, momentum=True
    )
    largest_piece = max(4 * math.prod(p.shape) for p in generations.pieces(SHAPES, limit))
    for delta in deltas:
        if remote:
            assert delta.second_came, "the merge read one piece of a store's delta at a time"
            assert 2 <= delta.most <= 3
            assert delta.most_bytes <= limit + largest_piece
        else:
            assert delta.second_came is None and delta.most == 1
    deltas_read = [load_file(str(p)) for p in paths]
    assert report == outer_step(master, momentum, deltas_read, tokens, OuterConfig())
    state = load_file(str(out / "master-2"))
    assert all(torch.equal(state[k], master[k]) for k in master)
    assert [t.name for t in threading.enumerate() if t.name.startswith("generation-")] == []
