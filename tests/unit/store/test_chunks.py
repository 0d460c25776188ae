"""Chunks and tails at the layout's edges: split then assemble gives back the state (cells in position order),
a longer state of the same conversation names the same chunks, damaged chunks are refused."""

from __future__ import annotations

import io

import numpy as np
import pytest

from hooks import kvfile
from hooks.store import chunks
from tests.slotfiles import kv_state as state


def roundtrip(data: bytes, per: int) -> tuple[chunks.Split, bytes]:
    cut = chunks.split(data, per, "model")
    out = io.BytesIO()
    if cut.plan is None:
        return cut, data
    size = chunks.assemble(cut.tail, [c.make() for c in cut.chunks], cut.plan, out)
    assert size == len(out.getvalue())
    return cut, out.getvalue()


TOKENS = list(range(1000, 1000 + 70))


@pytest.mark.parametrize("layout", [
    {}, {"v_trans": True}, {"k_type": 8, "row": 34}, {"k_type": 2, "row": 18}, {"cell_ext": 12},
    {"version": 2}, {"version": 2, "cell_ext": 8}, {"streams": 3}, {"swa": (0, 2)},
])
def test_split_then_assemble_gives_back_the_state(layout: dict[str, object]) -> None:
    data = state(TOKENS, **layout)  # type: ignore[arg-type]
    cut, back = roundtrip(data, 16)
    assert back == data
    assert len(cut.chunks) == 4  # 64 of 70 positions in chunks, 6 in the tail
    assert len(cut.tail) < len(data) / 4
    assert all(len(c.make()) == c.size == chunks.chunk_size(cut.plan or {}) for c in cut.chunks)
    head = kvfile.header(cut.tail)
    assert head.tokens == TOKENS
    assert [s.cells for sec in kvfile.walk(cut.tail, head.words_end, head.version) for s in sec.streams if s.cells]


def test_a_sliding_window_section_that_no_longer_begins_at_0_stays_whole_in_the_tail() -> None:
    data = state(TOKENS, swa=(40, 2))  # Gemma's: the SWA cache holds the last positions only
    cut, back = roundtrip(data, 16)
    assert back == data
    assert [s["section"] for s in (cut.plan or {})["streams"]] == [0]
    assert len(cut.tail) > 30 * (16 * 2 * 2)  # the 30 SWA cells of both its layers, K and V


def test_cells_out_of_position_order_come_back_in_order() -> None:
    order = list(range(70))
    order[3], order[50] = order[50], order[3]
    order = order[35:] + order[:35]
    data = state(TOKENS, order=order)
    _, back = roundtrip(data, 16)
    head = kvfile.header(back)
    (section,) = kvfile.walk(back, head.words_end, head.version)
    stream = section.streams[0]
    positions = np.frombuffer(back, dtype="<i4", count=70 * 3, offset=stream.meta_start).reshape(70, 3)[:, 0]
    assert positions.tolist() == list(range(70))
    # every cell's K row moved with its position
    original = kvfile.walk(data, kvfile.header(data).words_end)
    src = next(iter(original)).streams[0]
    k0 = np.frombuffer(data, dtype=np.uint8, count=70 * 16, offset=src.k[0].start).reshape(70, 16)
    k0_back = np.frombuffer(back, dtype=np.uint8, count=70 * 16, offset=stream.k[0].start).reshape(70, 16)
    for cell, pos in enumerate(order):
        assert (k0[cell] == k0_back[pos]).all()


def test_a_longer_state_of_the_conversation_names_the_same_chunks() -> None:
    short = chunks.split(state(TOKENS[:40]), 16, "model")
    longer = chunks.split(state(TOKENS, seed=0), 16, "model")
    assert [n.name for n in longer.chunks[:2]] == [n.name for n in short.chunks]
    other_model = chunks.split(state(TOKENS), 16, "another model")
    assert not {n.name for n in other_model.chunks} & {n.name for n in longer.chunks}
    quantized = chunks.split(state(TOKENS, k_type=8, row=34), 16, "model")
    assert not {n.name for n in quantized.chunks} & {n.name for n in longer.chunks}  # the layout is in the name
    other_turn = chunks.split(state([*TOKENS[:20], 7, *TOKENS[21:]]), 16, "model")
    assert [n.name for n in other_turn.chunks][:1] == [n.name for n in longer.chunks][:1]
    assert [n.name for n in other_turn.chunks][1:2] != [n.name for n in longer.chunks][1:2]


@pytest.mark.parametrize("data", [
    state(TOKENS[:10]),  # shorter than a chunk
    state(TOKENS, media=1),  # media: positions are not tokens
    state(TOKENS, order=[*range(69), 80]),  # a gap in the positions (a context shift)
    b"",
])
def test_what_is_not_chunked_is_its_tail_alone(data: bytes) -> None:
    if not data:
        with pytest.raises(kvfile.SlotFileError):
            chunks.split(data, 16, "model")
        return
    cut = chunks.split(data, 16, "model")
    assert cut.plan is None and cut.chunks == [] and cut.tail == b""


def test_a_damaged_chunk_or_tail_is_refused() -> None:
    cut = chunks.split(state(TOKENS), 16, "model")
    assert cut.plan is not None
    parts = [c.make() for c in cut.chunks]
    with pytest.raises(chunks.NotAssembled, match="not 1"):
        chunks.assemble(cut.tail, [parts[0], parts[1][:-1], *parts[2:]], cut.plan, io.BytesIO())
    with pytest.raises(chunks.NotAssembled, match="3 chunks"):
        chunks.assemble(cut.tail, parts[:3], cut.plan, io.BytesIO())
    with pytest.raises(chunks.NotAssembled, match="tail"):
        chunks.assemble(cut.tail[:-5], parts, cut.plan, io.BytesIO())
    other = chunks.split(state(TOKENS, k_type=8, row=34), 16, "model")
    with pytest.raises(chunks.NotAssembled, match="layout"):
        chunks.assemble(other.tail, parts, cut.plan, io.BytesIO())
