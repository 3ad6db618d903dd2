"""The native row reader (serving/native/rows.c through serving.native_rows) against the typed records' way
(serving.model.RowDecoder + PackedCall.record_arguments), which it must match tensor for tensor on every body
it reads, and leave to it every body it cannot read exactly as it does."""

from __future__ import annotations

import json
import random
import struct

import numpy as np
import orjson
import pytest
import tensorflow as tf

from serving import native_rows
from serving.model import SIGNATURE_NAME, PackedCall, RowDecoder
from serving.native_rows import NativeRows

FLOATS = tuple(f"I{i}" for i in range(1, 6))
STRINGS = tuple(f"C{i}" for i in range(1, 8))
LAYOUT = ((True, FLOATS), (True, STRINGS))
READERS = ("floats", "strings")


@pytest.fixture(scope="module")
def readers() -> tuple[NativeRows, PackedCall, RowDecoder]:
    native = NativeRows.build(LAYOUT, READERS, SIGNATURE_NAME)
    assert native is not None, "the native row reader did not build: is there a C compiler (cc)?"
    packed = PackedCall(function=None, layout=LAYOUT, row_readers=READERS, precision="float32")
    return native, packed, RowDecoder.build(packed)


def general(readers, body: bytes, max_rows: int = 1000) -> list[np.ndarray] | None:
    """The typed records' tensors for `body`, or None where that way leaves it to the JSON parser."""
    _, packed, decoder = readers
    records = decoder.decode(body)
    if not records or len(records) > max_rows:
        return None
    arguments = packed.record_arguments(records, decoder, {}, {})
    return None if arguments is None else [argument.numpy() for argument in arguments]


def native(readers, body: bytes, max_rows: int = 1000) -> list[np.ndarray] | None:
    read = readers[0].tensors(body, max_rows)
    if read is None:
        return None
    rows, arguments = read
    out = [argument.numpy() for argument in arguments]
    assert all(len(argument) == rows for argument in out)
    return out


def assert_same(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert [a.dtype for a in got] == [b.dtype for b in expected]
    assert [a.shape for a in got] == [b.shape for b in expected]
    floats_got, floats_expected = got[0], expected[0]
    # bit for bit: NaN where the value is missing, -0.0 kept
    assert floats_got.view(np.uint32).tolist() == floats_expected.view(np.uint32).tolist()
    assert got[1].tolist() == expected[1].tolist()


def instances(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        instance = {}
        for name in FLOATS:
            kind = rng.random()
            if kind < 0.15:
                continue  # missing
            if kind < 0.25:
                instance[name] = None
            elif kind < 0.45:
                instance[name] = rng.randint(-10**6, 10**6)
            elif kind < 0.6:
                instance[name] = rng.choice([0.0, -0.0, 1e-45, 3.4e38, -3.4028234663852886e38, 1e-320, 0.1, 2.5])
            else:
                instance[name] = rng.uniform(-1, 1) * 10 ** rng.randint(-30, 30)
        for name in STRINGS:
            kind = rng.random()
            if kind < 0.15:
                continue
            if kind < 0.25:
                instance[name] = None
            elif kind < 0.3:
                instance[name] = ""
            elif kind < 0.4:
                instance[name] = rng.choice(["café", "日本語", "emoji 🙂", "a/b", "quote's", 'say "hi"', "back\\slash",
                                             "tab\there", "line\nbreak", "\x01\x1f", "\u2028", "\U0001F600"])
            else:
                instance[name] = f"{rng.getrandbits(32):08x}"
        names = list(instance)
        rng.shuffle(names)  # clients send keys in any order
        out.append({name: instance[name] for name in names})
    return out


@pytest.mark.parametrize("dumps", [
    lambda value: orjson.dumps(value),
    lambda value: json.dumps(value).encode(),  # non-ASCII text escaped, surrogate pairs included
    lambda value: json.dumps(value, ensure_ascii=False).encode(),
    lambda value: json.dumps(value, indent=2, ensure_ascii=False).encode(),
])
def test_it_reads_what_the_typed_records_read_into_the_same_tensors(readers, dumps):
    """Numbers (integers, exponents, subnormals, float32's extremes, -0.0), null, missing keys, the empty
    string, UTF-8 strings, strings with escapes (quotes, control characters, \\uXXXX, surrogate pairs), keys in
    any order, any JSON whitespace, with and without the signature's name."""
    for seed in range(20):
        body = dumps({"instances": instances(1 + seed * 7, seed)})
        expected = general(readers, body)
        assert expected is not None
        got = native(readers, body)
        assert got is not None, body[:300]
        assert_same(got, expected)
    with_signature = dumps({"signature_name": SIGNATURE_NAME, "instances": instances(5, 99)})
    assert_same(native(readers, with_signature), general(readers, with_signature))


def test_numbers_round_as_the_typed_records_round_them(readers):
    """Decimal texts of every kind (short, 17 significant digits, past 2^53, exponents out of the fast range,
    halfway cases between two float32s) give the float32 that msgspec's float64 rounded by numpy gives."""
    rng = random.Random(3)
    texts = ["0", "-0", "1", "-1", "9007199254740993", "123456789012345678901234567890", "1e22", "1e23", "1e-22",
             "1e-23", "0.1", "0.30000000000000004", "3.4028235e38", "1.1754943508222875e-38", "1.4e-45", "7e-46",
             "1.00000005960464477539062500001", "1.000000059604644775390625", "16777217", "4.9e-324",
             "0.000000000000000000000000000000001", "2.5E+10", "2.5e-10", "100000000000000000000000e-5"]
    for _ in range(2000):
        value = struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0]
        if np.isfinite(value) and abs(value) < 3.4e38:
            texts.append(repr(value))
        texts.append(f"{rng.uniform(-1e6, 1e6):.{rng.randint(0, 20)}f}")
        texts.append(f"{rng.randint(-10**20, 10**20)}e{rng.randint(-40, 30)}")
    for start in range(0, len(texts), 500):
        chunk = texts[start:start + 500]
        body = ("{\"instances\": [" + ",".join(f'{{"I1": {text}}}' for text in chunk) + "]}").encode()
        expected = general(readers, body, 10_000)
        got = native(readers, body, 10_000)
        if expected is None:  # a value outside float32: the general path names it, so this one must not read it
            assert got is None
            continue
        assert_same(got, expected)


@pytest.mark.parametrize("body", [
    b'{"instances": [{"I1": true}]}',  # a bool is not a number
    b'{"instances": [{"I1": "1.5"}]}',
    b'{"instances": [{"C1": 7}]}',  # a number is not a string id
    b'{"instances": [{"I1": NaN}]}',
    b'{"instances": [{"I1": 1e999}]}',
    b'{"instances": [{"I1": 3.5e38}]}',  # outside float32: the general path names it
    b'{"instances": [{"I1": 01}]}',
    b'{"instances": [{"I1": 1.}]}',
    b'{"instances": [{"I1": .5}]}',
    b'{"instances": [{"I1": +1}]}',
    b'{"instances": [{"I1": -}]}',
    b'{"instances": [{"I1": 1e}]}',
    b'{"instances": [{"not_a_feature": 1}]}',
    b'{"instances": [{"I1": 1, "I1": 2}]}',  # a key given twice
    b'{"instances": [{"C\\u0031": "a"}]}',  # an escape in a key
    b'{"instances": [{"C1": "\\ud800"}]}',  # a lone surrogate: msgspec refuses it
    b'{"instances": [{"C1": "\\udc00"}]}',
    b'{"instances": [{"C1": "\\ud800\\u0041"}]}',
    b'{"instances": [{"C1": "a\\u0000"}]}',  # U+0000: a cell cannot end in one
    b'{"instances": [{"C1": "\\x41"}]}',  # not a JSON escape
    b'{"instances": [{"C1": "\\u12"}]}',
    b'{"instances": [{"C1": "\\u12g4"}]}',
    b'{"instances": [{"C1": "ab\\"}]}',
    b'{"instances": [{"C1": "a\x01b"}]}',  # a control character
    b'{"instances": [{"C1": "\xff"}]}',  # not UTF-8
    b'{"instances": [{"C1": "\xed\xa0\x80"}]}',  # an encoded surrogate
    b'{"instances": [{"C1": "\xc0\xaf"}]}',  # an overlong form
    b'{"instances": [{"C1": "\xf4\x90\x80\x80"}]}',  # over U+10FFFF
    b'{"instances": [{"C1": "ab}]}',
    b'{"instances": [[1, 2]]}',
    b'{"instances": {"I1": 1}}',
    b'{"instances": []}',
    b'{"inputs": {"I1": [1]}}',
    b'{"instances": [{"I1": 1}], "signature_name": "other"}',
    b'{"instances": [{"I1": 1}], "signature_name": null}',
    b'{"instances": [{"I1": 1}], "extra": 1}',
    b'{"instances": [{"I1": 1}], "instances": [{"I1": 1}]}',
    b'{"instances": [{"I1": 1}]} x',
    b'{"instances": [{"I1": 1},]}',
    b'{"instances": [{"I1": 1,}]}',
    b'{"instances": [{"I1" 1}]}',
    b'{}',
    b'[]',
    b'',
    b'\xef\xbb\xbf{"instances": [{"I1": 1}]}',  # a byte order mark
])
def test_it_leaves_every_other_body_to_the_general_path(readers, body):
    assert native(readers, body) is None


def test_it_reads_only_what_the_typed_records_read_the_same_way_under_random_damage(readers):
    """Bytes flipped, dropped, doubled or inserted into good bodies: whatever the native reader still reads,
    the typed records read into the very same tensors."""
    rng = random.Random(11)
    good = [orjson.dumps({"instances": instances(3, seed)}) for seed in range(10)]
    alphabet = b'{}[]":,. -+eE0123456789nulltrue\\\x00\x7f\xc3\xa9\xff IC1'
    read = 0
    for _ in range(4000):
        body = bytearray(rng.choice(good))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(body))
            action = rng.random()
            if action < 0.3:
                body[at] = rng.choice(alphabet)
            elif action < 0.6:
                del body[at]
            elif action < 0.8:
                body.insert(at, rng.choice(alphabet))
            else:
                body[at:at] = body[at:at + rng.randint(1, 8)]
        body = bytes(body)
        got = native(readers, body)
        if got is not None:
            read += 1
            expected = general(readers, body)
            assert expected is not None, body
            assert_same(got, expected)
    assert read > 100  # some damage leaves a body readable (a digit changed, a space added): those were compared


def test_row_limits_and_bodies_of_small_instances(readers):
    """More instances than `max_rows` is left to the general path (which refuses it by name); a body of
    instances smaller than the first guess of its rows is read whole."""
    body = b'{"instances": [' + b",".join([b"{}"] * 500) + b"]}"
    got = native(readers, body)
    assert got is not None and got[0].shape == (500, len(FLOATS)) and np.isnan(got[0]).all()
    assert got[1].tolist() == [[b""] * len(STRINGS)] * 500
    assert native(readers, body, max_rows=499) is None
    assert native(readers, body, max_rows=500) is not None


def test_another_layout_has_no_native_reader():
    """Integer ids and list inputs go through their column converters: no native reader for such a model."""
    assert NativeRows.build(LAYOUT, ("floats", ""), SIGNATURE_NAME) is None


def test_a_compiler_that_fails_is_reported_with_its_output(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv(native_rows.CACHE_ENV, str(cache))
    source = tmp_path / "broken.c"
    source.write_text("int broken( {\n")
    with pytest.raises(RuntimeError, match=r"failed \(1\): .*broken\.c:1"):
        native_rows.build(source)
    assert list(cache.iterdir()) == []  # nothing half-built left behind
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="did not run"):
        native_rows.build()


def test_the_library_is_built_once_per_source(tmp_path, monkeypatch):
    monkeypatch.setenv(native_rows.CACHE_ENV, str(tmp_path))
    first = native_rows.build()
    assert first.parent == tmp_path and first.is_file()
    mtime = first.stat().st_mtime_ns
    assert native_rows.build() == first and first.stat().st_mtime_ns == mtime


def test_the_tensors_are_the_endpoints_dtypes(readers):
    rows, arguments = readers[0].tensors(b'{"instances": [{"I1": 1, "C2": "x"}]}', 10)
    assert rows == 1 and [a.dtype for a in arguments] == [tf.float32, tf.string]
    assert arguments[1].numpy().tolist() == [[b"", b"x", b"", b"", b"", b"", b""]]
