"""The tool output's copy sub-tags (issue 74, item 4) and the allocation files they must not disturb.

``copy_subtags`` is checked against a character-by-character reference written
without regular expressions, on random texts cut into random tokens, and on
hand-written tool outputs; ``triaxial_codes`` and ``Allocation.table`` against the
index formula of before the axis, over every allocation file the repository ships
or reports (their bits must not move).
"""

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from jaxkv.chat import Copy, Modal, Semantic, Temporal, build_tokenizer, render
from jaxkv.chat.tags import NUM_TAG_CODES, NUM_TRIAXIAL_CODES, copy_subtags, triaxial_codes
from jaxkv.errors import ChatError, ConfigError
from jaxkv.policies.quant_allocation import Allocation, load_allocation, tag_name, tag_of_codes

ROOT = Path(__file__).resolve().parents[1]
PLAIN, KEY, VALUE = Copy.PLAIN, Copy.KEY, Copy.VALUE


# -- reference ------------------------------------------------------------------------
def _word_char(ch: str) -> bool:
    return ch == "_" or ("0" <= ch <= "9") or ("a" <= ch.lower() <= "z" and len(ch.encode()) == 1)


def reference_classes(text: str) -> list[int]:
    """Copy class per character, scanning by hand (module docstring of jaxkv.chat.tags)."""
    n, cls, i = len(text), [0] * len(text), 0
    while i < n:
        if text[i] == '"':
            j, end = i + 1, None
            while j < n:
                if text[j] == '"':
                    end = j + 1
                    break
                if text[j] == "\n":
                    break
                if text[j] == "\\":
                    if j + 1 < n and text[j + 1] != "\n":
                        j += 2
                        continue
                    break
                j += 1
            if end is None:
                i += 1
                continue
            quoted = True
        elif _word_char(text[i]):
            end = i
            while end < n and _word_char(text[end]):
                end += 1
            quoted = False
        else:
            i += 1
            continue
        k = end
        while k < n and text[k] in " \t":
            k += 1
        if k < n and text[k] in ":=":
            c = KEY
        elif quoted or any(ch.isdigit() or ch == "_" for ch in text[i:end]):
            c = VALUE
        else:
            c = PLAIN
        cls[i:end] = [int(c)] * (end - i)
        i = end
    return cls


def reference_subtags(pieces: list[str], semantic: list[int]) -> list[int]:
    out, t = [0] * len(pieces), 0
    while t < len(pieces):
        if semantic[t] != Semantic.OBS:
            t += 1
            continue
        u = t
        while u < len(pieces) and semantic[u] == Semantic.OBS:
            u += 1
        cls, pos = reference_classes("".join(pieces[t:u])), 0
        for k in range(t, u):
            out[k] = max(cls[pos : pos + len(pieces[k])], default=0)
            pos += len(pieces[k])
        t = u
    return out


def subtags_of(pieces, semantic):
    return copy_subtags(np.arange(len(pieces)), np.asarray(semantic, np.int8), lambda i: pieces[i]).tolist()


# -- copy sub-tags ----------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(40))
def test_subtags_match_the_reference_on_random_tokenised_text(seed):
    rng = np.random.default_rng(seed)
    alphabet = list('kv05_ :="\\\n\ta.,{}é') + ["Ab", "x9"]
    text = "".join(rng.choice(alphabet, size=int(rng.integers(0, 120))))
    cuts = sorted(set(rng.integers(0, len(text) + 1, size=int(rng.integers(0, 40))).tolist()) | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(cuts)] + [""] * int(rng.integers(0, 3))  # empty pieces too
    rng.shuffle(pieces)
    semantic = rng.choice([Semantic.OBS, Semantic.OBS, Semantic.USER, Semantic.DELIM], size=len(pieces)).tolist()
    assert subtags_of(pieces, semantic) == reference_subtags(pieces, semantic)


def test_subtags_of_a_record_listing_and_json():
    pieces = ["Document", " d", "038", ":", " Delta", " report", "\n", "k", "066", ":", " v", "053", "\n", "The", " end", "."]
    got = subtags_of(pieces, [Semantic.OBS] * len(pieces))
    want = [PLAIN, KEY, KEY, PLAIN, PLAIN, PLAIN, PLAIN, KEY, KEY, PLAIN, VALUE, VALUE, PLAIN, PLAIN, PLAIN, PLAIN]
    assert got == [int(c) for c in want]
    pieces = ["{", '"', "id", '":', " ", "42", ",", ' "', "name", '":', ' "', "Alice", ' Smith"', ", ", '"ok"', "}"]
    got = subtags_of(pieces, [Semantic.OBS] * len(pieces))
    assert got == [int(c) for c in [PLAIN, KEY, KEY, KEY, PLAIN, VALUE, PLAIN, KEY, KEY, KEY, VALUE, VALUE, VALUE, PLAIN, VALUE, PLAIN]]


def test_subtags_only_inside_tool_output_and_runs_do_not_join():
    pieces = ["k066", ":", " v053", "k1", " = ", "2"]
    semantic = [Semantic.OBS, Semantic.DELIM, Semantic.OBS, Semantic.USER, Semantic.OBS, Semantic.OBS]
    # "k066" ends its run (the ":" is not tool output), so it is a value, not a key
    assert subtags_of(pieces, semantic) == [VALUE, PLAIN, VALUE, PLAIN, PLAIN, VALUE]


def test_subtags_reject_misaligned_input():
    with pytest.raises(ChatError):
        copy_subtags(np.arange(3), np.zeros(2, np.int8), str)


def test_render_tags_the_tool_output_of_a_conversation():
    tok = build_tokenizer(["Find", "report"])
    messages = [
        {"role": "user", "content": "Find k066"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "content": "report k066: v053"},
    ]
    r = render(tok, messages, [{"type": "function", "function": {"name": "f"}}])
    obs = r.triaxial["semantic"] == Semantic.OBS
    assert obs.any() and not r.triaxial["copy"][~obs].any()  # the user's k066 is not tool output
    pieces = [tok.decode([int(i)]) for i in r.ids[obs]]
    text = "".join(pieces)
    assert text.strip() == "report k066: v053"
    pos, colon = 0, text.index(":")
    for p, got in zip(pieces, r.triaxial["copy"][obs].tolist()):
        want = PLAIN if p.strip() in ("", "report", ":") else (KEY if pos < colon else VALUE)
        assert got == want, (p, got)
        pos += len(p)
    codes = triaxial_codes(r.triaxial)
    assert (codes[~obs] < NUM_TRIAXIAL_CODES).all() and codes.max() < NUM_TAG_CODES
    assert (codes[obs] % NUM_TRIAXIAL_CODES == triaxial_codes(r.triaxial[["temporal", "modal", "semantic"]])[obs]).all()


# -- codes and allocations -------------------------------------------------------------
def test_codes_are_distinct_and_plain_codes_are_the_old_ones():
    combos = [(t, m, s, c) for c in Copy for t in Temporal for m in Modal for s in Semantic]
    arr = np.array(combos, dtype=[("temporal", "i1"), ("modal", "i1"), ("semantic", "i1"), ("copy", "i1")])
    codes = triaxial_codes(arr)
    assert sorted(codes.tolist()) == list(range(NUM_TAG_CODES))
    old = (arr["temporal"].astype(int) * 2 + arr["modal"]) * 7 + arr["semantic"]  # the formula of before the axis
    assert (codes == old + NUM_TRIAXIAL_CODES * arr["copy"]).all()
    for axes in (("temporal", "modal", "semantic"), ("modal", "semantic"), ("temporal", "modal")):
        assert (tag_of_codes(codes, axes) == tag_of_codes(old, axes)).all()  # no copy axis: the copy class is ignored


def old_table(alloc: Allocation, budget: float) -> np.ndarray:
    """Bits per triaxial code as the code of before the copy axis computed them."""
    sizes = {"temporal": 4, "modal": 2, "semantic": 7}
    per_tag = np.full(int(np.prod([sizes[a] for a in alloc.axes])), 4, np.int8)
    per_tag[list(alloc.tags)] = alloc.solve(budget)
    out = []
    for code in range(56):
        t, rest = divmod(code, 14)
        m, s = divmod(rest, 7)
        index = 0
        for axis, v in (("temporal", t), ("modal", m), ("semantic", s)):
            if axis in alloc.axes:
                index = index * sizes[axis] + v
        out.append(per_tag[index])
    return np.asarray(out, np.int8)


ALLOCATION_FILES = sorted(
    p.relative_to(ROOT).as_posix()
    for p in [*ROOT.glob("jaxkv/assets/*/triaxial.json"), *ROOT.glob("eval/results/triaxial/**/*.json")]
    if '"variants"' in p.read_text()
)


def test_the_shipped_and_reported_allocation_files_are_all_found():
    assert "jaxkv/assets/smollm2-135m-instruct/triaxial.json" in ALLOCATION_FILES
    assert "jaxkv/assets/embedded-agent/triaxial.json" in ALLOCATION_FILES
    assert len(ALLOCATION_FILES) >= 6


@pytest.mark.parametrize("path", ALLOCATION_FILES)
def test_allocation_files_without_the_copy_axis_give_the_bits_of_before(path):
    data = json.loads((ROOT / path).read_text())
    for variant, v in data["variants"].items():
        alloc = load_allocation(ROOT / path, variant)
        if "copy" in alloc.axes:
            continue
        for B in (2.0, 2.4, 2.5, 3.0, 3.5, 4.0):
            table = alloc.table(B)
            assert table.shape == (NUM_TAG_CODES,)
            assert (table[:NUM_TRIAXIAL_CODES] == old_table(alloc, B)).all(), (variant, B)
            assert (table.reshape(len(Copy), NUM_TRIAXIAL_CODES) == table[:NUM_TRIAXIAL_CODES]).all()
        if isinstance(v.get("bits"), dict):  # what the calibration recorded when it wrote the file
            assert alloc.bits() == v["bits"], variant


def test_an_allocation_with_the_copy_axis_splits_the_tool_output():
    axes = ("temporal", "modal", "semantic", "copy")
    cur = lambda s, c: ((Temporal.CURRENT * 2 + Modal.TEXT) * 7 + s) * 3 + c
    rows = [
        {"index": cur(Semantic.INST, PLAIN), "N": 300, "D2": 1.0, "D3": 0.2, "D4": 0.1},
        {"index": cur(Semantic.OBS, PLAIN), "N": 1000, "D2": 0.1, "D3": 0.05, "D4": 0.04},
        {"index": cur(Semantic.OBS, KEY), "N": 300, "D2": 1.0, "D3": 0.3, "D4": 0.1},
        {"index": cur(Semantic.OBS, VALUE), "N": 400, "D2": 3.0, "D3": 0.5, "D4": 0.1},
    ]
    alloc = Allocation.from_dict({"axes": list(axes), "budget": 3.0, "tags": rows})
    assert tag_name(rows[2]["index"], axes) == "current|text|obs|key"
    bits = alloc.bits()
    assert bits["current|text|obs|plain"] == 2 and bits["current|text|obs|value"] >= 3
    table = alloc.table()
    base = (Temporal.CURRENT * 2 + Modal.TEXT) * 7 + Semantic.OBS
    assert [int(table[base + NUM_TRIAXIAL_CODES * c]) for c in Copy] == [bits[f"current|text|obs|{c.name.lower()}"] for c in Copy]
    assert (tag_of_codes([base + NUM_TRIAXIAL_CODES * c for c in Copy], axes) == [r["index"] for r in rows[1:]]).all()
    with pytest.raises(ConfigError):
        Allocation.from_dict({"axes": ["semantic", "span"], "budget": 3.0, "tags": rows})


def test_calibration_splits_the_tool_output_and_replays_each_token_set_once():
    from train.calibrate_triaxial import VARIANTS, DistortionTables

    groups = [
        (Semantic.INST, PLAIN, 40),
        (Semantic.OBS, PLAIN, 40),
        (Semantic.OBS, KEY, 35),
        (Semantic.OBS, VALUE, 35),
        (Semantic.USER, PLAIN, 5),
    ]
    tri = np.zeros(155, dtype=[("temporal", "i1"), ("modal", "i1"), ("semantic", "i1"), ("copy", "i1")])
    tri["temporal"] = Temporal.CURRENT
    tri["semantic"] = np.repeat([g[0] for g in groups], [g[2] for g in groups])
    tri["copy"] = np.repeat([g[1] for g in groups], [g[2] for g in groups])
    calls = []

    class FakeCapture:
        codes = np.concatenate([triaxial_codes(tri), [-1, -1, -1]])  # three reply tokens, not written with a tag

        def error(self, int4_tokens=(), int2_tokens=(), int3_tokens=None):
            members = next(np.asarray(t) for t in (int4_tokens, int2_tokens, int3_tokens) if t is not None and len(t))
            calls.append(members.tobytes())
            bits = 4 if len(int4_tokens) else 2 if len(int2_tokens) else 3
            return np.full((2, 3), members.size / bits), None, None

    entries = DistortionTables.request_entries(FakeCapture())
    assert set(entries) == set(VARIANTS)
    copy_axes = VARIANTS["triaxial_copy"]
    names = {tag_name(int(t), copy_axes): e["count"] for t, e in entries["triaxial_copy"].items()}
    assert names == {
        "current|text|inst|plain": 40,
        "current|text|obs|plain": 40,
        "current|text|obs|key": 35,
        "current|text|obs|value": 35,
        "current|text|user|plain": 5,
    }
    names = {tag_name(int(t), VARIANTS["triaxial"]): e["count"] for t, e in entries["triaxial"].items()}
    assert names == {"current|text|inst": 40, "current|text|obs": 110, "current|text|user": 5}
    # distinct token sets: inst, user, obs, everything (no_semantic), and the three obs classes; three widths each
    assert len(calls) == 3 * 7 and len(set(calls)) == 7
    key = int(tag_of_codes(triaxial_codes(tri[80:81]), copy_axes)[0])
    assert tag_name(key, copy_axes) == "current|text|obs|key"
    assert entries["triaxial_copy"][key]["d2"] == [17.5, 17.5] and entries["triaxial_copy"][key]["d4"] == [8.75, 8.75]
