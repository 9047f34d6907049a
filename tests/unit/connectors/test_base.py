"""Packing layout, dtype names, handle encoding and the connector factory; no transport."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import msgspec
import pytest
import torch
from torch import Tensor

from omnistage.connectors import ChunkKey, ConnectorStats, TensorHandle, TensorMeta, make_connector
from omnistage.connectors.inproc import InprocConnector
from omnistage.connectors.packing import (
    ALIGNMENT, align_up, dtype_from_name, dtype_name, pack, plan, read, slot)

Check = Callable[[Mapping[str, Tensor], Mapping[str, Tensor]], None]

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64,
          torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
          torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtype_name_round_trip(dtype: torch.dtype) -> None:
    assert dtype_from_name(dtype_name(dtype)) is dtype
    assert "torch" not in dtype_name(dtype)


@pytest.mark.parametrize("name", ["float", "Tensor", "nonsense", "manual_seed"])
def test_dtype_from_name_rejects_non_dtypes(name: str) -> None:
    if name == "float":  # torch.float is an alias of float32, a real dtype
        assert dtype_from_name(name) is torch.float32
        return
    with pytest.raises(ValueError, match=name):
        dtype_from_name(name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pack_read_every_dtype_bit_exact(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (3, 5, 8), dtype=torch.uint8, generator=g)
    t = raw.view(dtype) if dtype != torch.bool else raw > 127   # arbitrary bit patterns
    metas, buf = pack({"x": t, "y": t[:, 1]})                   # t[:, 1] is non-contiguous
    out = read(buf, metas)
    for name, want in [("x", t), ("y", t[:, 1])]:
        assert out[name].dtype == dtype and out[name].shape == want.shape
        # compare bytes: equality of float8 / NaN bit patterns is not what we test
        assert torch.equal(out[name].contiguous().view(torch.uint8),
                           want.contiguous().view(torch.uint8)), name


def test_plan_offsets_are_aligned_and_sized() -> None:
    tensors = {"a": torch.zeros(3, dtype=torch.int8), "b": torch.zeros(2, 5),
               "c": torch.zeros(()), "d": torch.zeros(0, 7),
               "e": torch.zeros(100, dtype=torch.bfloat16)}
    metas, nbytes = plan(tensors)
    assert [m.name for m in metas] == list(tensors)
    assert [m.nbytes for m in metas] == [3, 40, 4, 0, 200]
    assert [m.offset for m in metas] == [0, 64, 128, 192, 192]
    assert all(m.offset % ALIGNMENT == 0 for m in metas)
    assert nbytes == 192 + 200
    assert metas[2].shape == [] and metas[3].shape == [0, 7] and metas[4].dtype == "bfloat16"
    assert align_up(0) == 0 and align_up(1) == 64 and align_up(64) == 64 and align_up(65) == 128


def test_pack_round_trip_payload(payload: dict[str, Tensor], assert_same: Check) -> None:
    metas, buf = pack(payload)
    assert buf.dtype == torch.uint8 and buf.numel() == plan(payload)[1]
    out = read(buf, metas)
    assert_same(out, payload)
    buf.fill_(0)  # read copies out: nothing aliases the buffer
    assert_same(out, payload)


def test_slot_is_a_view_and_checks_bounds() -> None:
    metas, buf = pack({"x": torch.arange(4, dtype=torch.int32)})
    view = slot(buf, metas[0])
    assert view.data_ptr() == buf.data_ptr() and view.tolist() == [0, 1, 2, 3]
    short = TensorMeta(name="x", dtype="int32", shape=[8], offset=0, nbytes=32)
    with pytest.raises(AssertionError, match="32"):
        slot(buf, short)


@pytest.mark.parametrize("bad", [[1, 2], torch.zeros(3).to_sparse()], ids=["list", "sparse"])
def test_plan_rejects_non_dense_tensors(bad: object) -> None:
    with pytest.raises(ValueError, match="'bad'"):
        plan({"bad": bad})  # type: ignore[dict-item]


def test_read_to_device_argument() -> None:
    metas, buf = pack({"x": torch.ones(2)})
    out = read(buf, metas, device="cpu")
    assert out["x"].device.type == "cpu" and out["x"].data_ptr() != buf.data_ptr()


def test_handle_survives_msgpack() -> None:
    metas, _ = pack({"hidden": torch.zeros(4, 8, dtype=torch.bfloat16), "n": torch.tensor(3)})
    handle = TensorHandle(key=ChunkKey("req-1", "thinker->talker", 7), kind="shm",
                          tensors=metas, location="osdeadbeef_abc123_7", nbytes=128)
    data = msgspec.msgpack.encode(handle)
    back = msgspec.msgpack.decode(data, type=TensorHandle)
    assert back == handle and back.key.chunk_idx == 7 and back.tensors[0].dtype == "bfloat16"
    assert len(data) < 128  # array_like: no field names on the wire


def test_handle_defaults_round_trip() -> None:
    # msgspec writes array_like structs in full even with omit_defaults (jcrist/msgspec#720)
    handle = TensorHandle(key=ChunkKey("r", "e", 0), kind="inproc", tensors=[])
    data = msgspec.msgpack.encode(handle)
    assert msgspec.msgpack.decode(data) == [["r", "e", 0], "inproc", [], "", 0, b""]
    assert msgspec.msgpack.decode(data, type=TensorHandle) == handle
    short = msgspec.msgpack.encode([["r", "e", 0], "inproc", []])  # trailing fields may be absent
    assert msgspec.msgpack.decode(short, type=TensorHandle) == handle


def test_chunk_key_is_frozen_and_hashable() -> None:
    key = ChunkKey("r", "a->b", 0)
    assert {key: 1}[ChunkKey("r", "a->b", 0)] == 1
    with pytest.raises(AttributeError):
        key.chunk_idx = 1  # type: ignore[misc]


def test_stats_accumulate() -> None:
    stats = ConnectorStats()
    stats.add_put(100, 0.5)
    stats.add_put(28, 0.25)
    stats.add_get(100, 0.125)
    assert (stats.bytes_put, stats.num_put, stats.put_seconds) == (128, 2, 0.75)
    assert (stats.bytes_got, stats.num_get, stats.get_seconds) == (100, 1, 0.125)


def test_make_connector() -> None:
    conn = make_connector("inproc")
    assert isinstance(conn, InprocConnector) and conn.kind == "inproc"
    with make_connector("shm", namespace="osfactory1") as shm:
        assert shm.kind == "shm" and shm.namespace == "osfactory1"  # type: ignore[attr-defined]
    with make_connector("tcp", listen="tcp://127.0.0.1:0") as tcp:
        assert tcp.address.startswith("tcp://127.0.0.1:")  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="'rdma'"):
        make_connector("rdma")


def test_wrong_kind_handle_is_refused() -> None:
    handle = TensorHandle(key=ChunkKey("r", "e", 0), kind="shm", tensors=[])
    with pytest.raises(ValueError, match="inproc connector got a 'shm' handle"):
        InprocConnector().get(handle)
