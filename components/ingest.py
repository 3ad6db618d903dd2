"""`ctr-pipeline ingest`: a team's own files written as raw minute partitions of the feature spec's layout.

Inputs are files, folders (every file under them), globs and s3://bucket/prefix URIs (every object under the
prefix, listed and streamed through boto3 with the model store's endpoint and credential settings). A file is
CSV, TSV or Parquet (any codec pyarrow reads), compressed with gzip, zstd or bz2 or not: the compression is told
by the first bytes (a suffix such as .gz must agree) and read as a stream, never unpacked to disk. Text is read
in the spec's source.encoding (UTF-8 unless it says otherwise), a byte-order mark dropped, CRLF or LF line ends.
A file that is not what was asked (binary, another archive, Parquet given as text) is refused with an error that
names what was found.

Rows are placed by the spec's timestamp column when it has one (a timestamp coarser than a minute, such as
Avazu's YYMMDDHH hours, spreads its rows evenly over its 60 minutes in file order), else by row order at
`rows_per_minute` from `start`. Each minute becomes raw/click_log/date=D/minute=HHMM/part-00000.<format> in
the spec's source layout (columns in the spec's order; a header line when the layout has one), then an empty
_SUCCESS marker. The input files are only read. A malformed line (wrong field count, a label outside 0/1, a
number that does not parse, a timestamp that does not parse) is counted, kept with its file and line number
in a rejects file, and reported; it is not written. Raw partitions are immutable: writing a minute again
with the same bytes is a no-op, with other bytes an error that names the minute.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import fnmatch
import glob
import hashlib
import io
import itertools
import json
import os
import unicodedata
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

from components.feature_spec import DenseFeature, FeatureSpec, TimestampFeature
from components.interval import Interval
from components.layout import Layout
from components.synthetic import SUCCESS_MARKER

INPUT_FORMATS = ("auto", "tsv", "csv", "parquet")
LABEL_VALUES = {"0", "1"}  # what validation accepts


class IngestError(ValueError):
    """The input cannot be ingested as a whole (a file is missing, lacks a column, or would change a minute)."""


@dataclass(frozen=True)
class Reject:
    file: str
    line: int  # 1-based line number in the file (row number + 1 for Parquet)
    reason: str
    text: str


@dataclass
class IngestReport:
    spec: str
    files: list[str]
    stream: str = "click_log"  # or an event stream (components.event_ingest)
    rows_read: int = 0
    rows_written: int = 0
    rejected: int = 0
    rejects_by_reason: dict[str, int] = field(default_factory=dict)
    minutes_written: int = 0
    minutes_unchanged: int = 0
    first_minute: str = ""
    end_minute: str = ""  # exclusive
    rejects_file: str = ""

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def parse_timestamp(value: str, feature: TimestampFeature) -> datetime:
    """A raw timestamp as a UTC datetime. Raises ValueError naming the format when it does not parse."""
    return feature.parse(value)


def coarser_than_a_minute(feature: TimestampFeature) -> bool:
    """True for a strptime format without minutes (e.g. %y%m%d%H): its rows are spread over the hour."""
    return not feature.format.startswith("unix_") and "%M" not in feature.format


def ingest(spec: FeatureSpec, files: Sequence[str | Path], layout: Layout, *, start: str | None = None,
           rows_per_minute: int | None = None, input_format: str = "auto",
           progress: Callable[[str], None] | None = None, s3_endpoint_url: str = "",
           s3_client: Any = None) -> IngestReport:
    """Writes `files` (files, folders, globs, s3:// prefixes: `expand_inputs`) as raw minute partitions under
    `layout` (see the module's doc). `s3_endpoint_url`: the model store's endpoint setting (paths.s3_endpoint_url);
    `s3_client`: a boto3 client to use instead. Returns what it did."""
    say = progress or (lambda message: None)
    if input_format not in INPUT_FORMATS:
        raise IngestError(f"--format {input_format!r}: expected one of {', '.join(INPUT_FORMATS)}")
    timestamp = spec.timestamp
    if timestamp is not None and start is not None:
        raise IngestError(f"--start applies to specs without a timestamp column; spec {spec.name!r} places rows by "
                          f"its timestamp {timestamp.column!r}: drop --start")
    if timestamp is None and start is None:
        raise IngestError(f"spec {spec.name!r} has no timestamp column, so rows are placed by their order: give "
                          "--start (the first minute, e.g. 2026-01-01T00:00) and --rows-per-minute")
    first_minute = None
    if start is not None:
        try:
            first_minute = Interval.minute(start).start
        except ValueError as err:
            raise IngestError(f"--start {start!r}: {err} (an ISO time on a whole minute, e.g. 2026-01-01T00:00)") \
                from err
    if rows_per_minute is not None and rows_per_minute < 1:
        raise IngestError(f"--rows-per-minute must be at least 1, got {rows_per_minute}")
    sources = expand_inputs(files, (lambda: s3_client) if s3_client is not None else
                            s3_client_factory(s3_endpoint_url))
    report = IngestReport(spec=spec.name, files=[source.name for source in sources])
    output_columns = list(spec.source.columns)
    rows: list[tuple[datetime | None, list[str]]] = []  # (timestamp or None, fields in output order)
    rejects: list[Reject] = []
    for source in sources:
        records, columns = _read(source, spec, input_format)
        if not output_columns:
            output_columns = list(columns)
        missing = [c for c in spec.input_columns if c not in columns]
        if missing:
            raise IngestError(f"{source.name}: columns {missing} that spec {spec.name!r} reads are not in the file "
                              f"(its columns: {show_columns(columns)}); check the file's header or the spec's "
                              "source.columns")
        positions = [columns.index(c) if c in columns else None for c in output_columns]
        checks = _row_checks(spec, columns)
        for line, fields, text in records:
            report.rows_read += 1
            if len(fields) != len(columns):
                rejects.append(Reject(source.name, line, f"expected {len(columns)} fields, got {len(fields)}", text))
                continue
            reason = next((r for r in (check(fields) for check in checks) if r), None)
            if reason:
                rejects.append(Reject(source.name, line, reason, text))
                continue
            when = parse_timestamp(fields[columns.index(timestamp.column)], timestamp) if timestamp else None
            rows.append((when, [fields[p] if p is not None else "" for p in positions]))
        say(f"read {source.name}: {report.rows_read} rows so far, {len(rejects)} rejected")
    report.rejected = len(rejects)
    for reject in rejects:
        key = reject.reason.split(":")[0]
        report.rejects_by_reason[key] = report.rejects_by_reason.get(key, 0) + 1
    if rejects:
        report.rejects_file = str(write_rejects(layout, spec.name, sources, rejects))
    minutes = _place(rows, timestamp, first_minute, rows_per_minute or 1000)
    if not minutes:
        raise IngestError(f"no row of {report.files} could be ingested ({report.rejected} rejected; "
                          f"see {report.rejects_file or 'the input'})")
    encoded = {minute: _encode(spec, output_columns, part) for minute, part in sorted(minutes.items())}
    for minute, data in encoded.items():  # refuse before writing anything
        existing = layout.raw_minute_dir(minute) / spec.source.file_name
        if existing.exists() and existing.read_bytes() != data:
            raise IngestError(f"minute {minute:%Y-%m-%dT%H:%M} already holds other data ({existing}); raw partitions "
                              "are never rewritten: move it away or ingest into other minutes")
    for minute, data in encoded.items():
        if _write_partition(layout.raw_minute_dir(minute), spec.source.file_name, data):
            report.minutes_written += 1
        else:
            report.minutes_unchanged += 1
        report.rows_written += len(minutes[minute])
    report.first_minute = f"{min(encoded):%Y-%m-%dT%H:%M}"
    report.end_minute = f"{max(encoded) + timedelta(minutes=1):%Y-%m-%dT%H:%M}"
    return report


# ----------------------------------------------------------------------------------------------------------
# Inputs: local files, folders, globs and s3:// prefixes, each opened as a stream of bytes

GLOB_CHARACTERS = "*?["
# Compressions read as streams, by the file's first bytes (and its suffix, which must agree).
COMPRESSION_MAGIC = (("gzip", b"\x1f\x8b"), ("zstd", b"\x28\xb5\x2f\xfd"), ("bz2", b"BZh"))
COMPRESSION_SUFFIXES = {".gz": "gzip", ".gzip": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2"}
# What else a team's export may be, named in the error that refuses it.
OTHER_MAGIC = (
    (b"\xfd7zXZ\x00", "xz-compressed data", "decompress it (xz -d) or recompress it with gzip, zstd or bz2"),
    (b"PK\x03\x04", "a ZIP archive (an .xlsx workbook is one)", "unzip it, or save a workbook as CSV"),
    (b"\x04\x22\x4d\x18", "LZ4-compressed data", "decompress it (lz4 -d) or recompress it with gzip, zstd or bz2"),
    (b"\xd0\xcf\x11\xe0", "an Office document (an .xls workbook)", "save it as CSV"),
    (b"SQLite format 3\x00", "an SQLite database", "export the table as CSV"),
    (b"\x89PNG", "a PNG image", "give the log's files"),
    (b"%PDF", "a PDF document", "give the log's files"),
)
PARQUET_MAGIC = b"PAR1"
UTF8_BOM = b"\xef\xbb\xbf"
UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
HEAD_BYTES = 8192  # what is looked at to tell compression, format and text from binary


@dataclass(frozen=True)
class InputFile:
    """One input: `name` as messages and the rejects file say it (a path or an s3:// URI), `open` its bytes."""

    name: str
    open: Callable[[], BinaryIO]
    path: Path | None = None  # a local file (Parquet is read from it directly)


def expand_inputs(files: Sequence[str | Path], s3_client: Callable[[], Any]) -> list[InputFile]:
    """The files that `files` name, in order: a file, every file under a folder or matching a glob (sorted; names
    starting with '.' or '_', such as _SUCCESS, skipped), every object under an s3:// prefix (or matching a glob
    in its last part). Raises IngestError for a name that matches nothing."""
    out: list[InputFile] = []
    for item in map(str, files):
        if item.startswith("s3://"):
            out.extend(_s3_inputs(item, s3_client()))
            continue
        path = Path(item)
        if any(c in item for c in GLOB_CHARACTERS) and not path.exists():
            matches = sorted(Path(m) for m in glob.glob(item, recursive=True))
            found = [m for m in matches if m.is_file() and not _hidden(m.name)]
            if not found:
                raise IngestError(f"input {item!r} is a glob that matches no file; check the pattern (quote it so "
                                  "the shell does not expand it) or give the files")
            out.extend(_local(m) for m in found)
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and not any(
                _hidden(part) for part in p.relative_to(path).parts))
            if not found:
                raise IngestError(f"input folder {item!r} holds no file to ingest (names starting with '.' or '_' "
                                  "are skipped)")
            out.extend(_local(p) for p in found)
        elif path.is_file():
            out.append(_local(path))
        else:
            raise IngestError(f"input file {item!r} does not exist; give a file, a folder, a glob or an "
                              "s3://bucket/prefix")
    return out


def _hidden(name: str) -> bool:
    return name.startswith((".", "_"))


def _local(path: Path) -> InputFile:
    return InputFile(name=str(path), open=lambda: open(path, "rb"), path=path)


def s3_client_factory(endpoint_url: str = "") -> Callable[[], Any]:
    """A boto3 S3 client made on first use, as the model store makes its own: `endpoint_url` from the config's
    paths.s3_endpoint_url (CTR_S3_ENDPOINT_URL), credentials from boto3's usual chain (AWS_ACCESS_KEY_ID, ...)."""
    made: list[Any] = []

    def client() -> Any:
        if not made:
            import boto3

            made.append(boto3.client("s3", endpoint_url=endpoint_url or None))
        return made[0]

    return client


def _s3_inputs(uri: str, client: Any) -> list[InputFile]:
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _, key = uri[len("s3://"):].partition("/")
    if not bucket:
        raise IngestError(f"input {uri!r} names no bucket; give s3://bucket/prefix")
    globbed = any(c in key for c in GLOB_CHARACTERS)
    literal = min((key.index(c) for c in GLOB_CHARACTERS if c in key), default=len(key))
    prefix = key[:literal]
    try:
        keys = [item["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
                for item in page.get("Contents", [])]
    except (BotoCoreError, ClientError) as err:
        raise IngestError(f"cannot list {uri!r}: {err}; check the bucket's name, paths.s3_endpoint_url "
                          "(CTR_S3_ENDPOINT_URL) and the credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)") \
            from err
    if globbed:
        chosen = [k for k in keys if fnmatch.fnmatchcase(k, key)]
    elif key in keys:
        chosen = [key]
    else:
        folder = key.rstrip("/") + "/" if key else ""
        chosen = [k for k in keys if k.startswith(folder)]
    chosen = sorted(k for k in chosen if not k.endswith("/") and not any(_hidden(part) for part in
                                                                           k[len(prefix):].split("/") if part))
    if not chosen:
        raise IngestError(f"input {uri!r} names no object ({len(keys)} object(s) under s3://{bucket}/{prefix}); "
                          "check the prefix")

    def opener(name: str) -> Callable[[], BinaryIO]:
        def open_object() -> BinaryIO:
            try:
                return client.get_object(Bucket=bucket, Key=name)["Body"]
            except (BotoCoreError, ClientError) as err:
                raise IngestError(f"cannot read s3://{bucket}/{name}: {err}") from err

        return open_object

    return [InputFile(name=f"s3://{bucket}/{k}", open=opener(k)) for k in chosen]


class _Rejoined(io.RawIOBase):
    """The bytes already read (`head`) and then the rest of `stream`, as one readable raw stream."""

    def __init__(self, head: bytes, stream: Any) -> None:
        self._head = memoryview(head)
        self._stream = stream

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._head:
            n = min(len(buffer), len(self._head))
            buffer[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        data = self._stream.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._stream.close()
        super().close()


def _read_head(stream: Any, size: int = HEAD_BYTES) -> bytes:
    parts, have = [], 0
    while have < size:
        data = stream.read(size - have)
        if not data:
            break
        parts.append(data)
        have += len(data)
    return b"".join(parts)


def _show_bytes(head: bytes) -> str:
    return repr(head[:16])


def _compression(name: str, head: bytes) -> str | None:
    """gzip, zstd or bz2 by the first bytes; None for none. The suffix must agree with the bytes."""
    found = next((kind for kind, magic in COMPRESSION_MAGIC if head.startswith(magic)), None)
    suffix = Path(name).suffix.lower()
    named = COMPRESSION_SUFFIXES.get(suffix)
    if named and found != named:
        what = f"{found}-compressed data" if found else f"data that is not {named}-compressed"
        raise IngestError(f"{name}: the name says {named} ({suffix}), but the file holds {what} (its first bytes: "
                          f"{_show_bytes(head)}); rename it to match what it holds, or recompress it")
    return found


def _decompress(kind: str, stream: Any) -> Any:
    if kind == "gzip":
        import gzip

        return gzip.GzipFile(fileobj=stream, mode="rb")
    if kind == "bz2":
        import bz2

        return bz2.BZ2File(stream, mode="rb")
    return io.BufferedReader(_ZstdFrames(stream))


class _ZstdFrames(io.RawIOBase):
    """zstd frames one after another, decompressed as read; EOFError when the data ends inside a frame (zstandard's
    own stream reader returns what it has without a word, so a file cut short would pass for a short log)."""

    READ_SIZE = 1 << 16

    def __init__(self, stream: Any) -> None:
        import zstandard

        self._stream = stream
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame = self._decompressor.decompressobj()
        self._in_frame = False
        self._out = b""
        self._at = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self._at == len(self._out):
            data = self._stream.read(self.READ_SIZE)
            if not data:
                if self._in_frame:
                    raise EOFError("the zstd data ends inside a frame")
                return 0
            self._out, self._at = self._decompress(data), 0
        n = min(len(buffer), len(self._out) - self._at)
        buffer[:n] = self._out[self._at:self._at + n]
        self._at += n
        return n

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            self._in_frame = True
            out.append(self._frame.decompress(data))
            if not self._frame.eof:
                break
            data = self._frame.unused_data  # the next frame, if any
            self._frame = self._decompressor.decompressobj()
            self._in_frame = False
        return b"".join(out)

    def close(self) -> None:
        if not self.closed:
            self._stream.close()
        super().close()


def _open(source: InputFile) -> tuple[Any, bytes, str | None]:
    """(the file's content as a stream, its first bytes, its compression): compressed files decompressed as
    they are read, never unpacked to disk."""
    stream = source.open()
    head = _read_head(stream)
    compression = _compression(source.name, head)
    if compression is not None:
        stream = _decompress(compression, io.BufferedReader(_Rejoined(head, stream)))
        try:
            head = _read_head(stream)
        except (OSError, EOFError, ValueError) as err:  # zstd raises ZstdError, a ValueError
            stream.close()
            raise IngestError(f"{source.name}: {compression}-compressed data ends early or is damaged: {err}; the "
                              "file may be cut short (still being written or copied)") from err
    return io.BufferedReader(_Rejoined(head, stream)), head, compression


def _read(source: InputFile, spec: FeatureSpec, input_format: str
          ) -> tuple[Iterator[tuple[int, list[str], str]], list[str]]:
    """(records as (line number, fields, original text), the file's columns)."""
    stream, head, compression = _open(source)
    packed = f"{compression}-compressed " if compression else ""
    parquet = head.startswith(PARQUET_MAGIC)
    if input_format == "parquet" or (input_format == "auto" and (parquet or source.name.endswith(".parquet"))):
        if not parquet:
            stream.close()
            raise IngestError(f"{source.name}: expected a Parquet file, but the {packed}file starts with "
                              f"{_show_bytes(head)}, not Parquet's {PARQUET_MAGIC!r}; give --format csv or tsv for "
                              "text, or the Parquet file")
        return _parquet_rows(source, stream, compression)
    if parquet:
        stream.close()
        raise IngestError(f"{source.name}: --format {input_format} asks for text, but the {packed}file is Parquet; "
                          "give --format parquet (or auto)")
    encoding = spec.source.encoding
    _check_text(source.name, head, encoding, packed)
    lines = _text_lines(source.name, stream, encoding, compression)
    first = next(lines, "").removeprefix("\ufeff")
    fmt = input_format if input_format != "auto" else ("tsv" if "\t" in first else "csv")
    delimiter = "\t" if fmt == "tsv" else ","
    header = next(csv.reader([first.rstrip("\r\n")], delimiter=delimiter)) if first.strip() else []
    has_header = spec.label.column in header
    if has_header:
        columns = header
    elif spec.source.columns:
        columns = list(spec.source.columns)
    else:
        lines.close()
        raise IngestError(_no_label_column(source.name, spec, header, first, delimiter))

    def text_rows() -> Iterator[tuple[int, list[str], str]]:
        with contextlib.closing(lines):
            start = 2 if has_header else 1
            for number, text in enumerate(itertools.chain([] if has_header else [first], lines), start=start):
                stripped = text.rstrip("\r\n")
                if not stripped:
                    continue
                fields = next(csv.reader([stripped], delimiter=delimiter)) if delimiter == "," \
                    else stripped.split(delimiter)
                yield number, fields, stripped

    return text_rows(), columns


def _text_lines(name: str, stream: Any, encoding: str, compression: str | None) -> Iterator[str]:
    """The stream's lines as text (line ends kept), the UTF-8 byte-order mark dropped. A line that is not
    `encoding` text, or a compressed stream that ends early or is damaged, raises IngestError naming the line.
    Encodings that keep ASCII's line feed (UTF-8, cp1252, latin-1, ...) are decoded a line at a time, so the line
    an error names is exact; UTF-16 and UTF-32 go through a text reader."""
    wide = codecs.lookup(encoding).name.startswith(("utf-16", "utf-32"))
    utf8 = codecs.lookup(encoding).name == "utf-8"
    number = 0
    with stream:
        try:
            if wide:
                for number, text in enumerate(io.TextIOWrapper(stream, encoding=encoding, newline=""), start=1):  # noqa: B007
                    yield text
                return
            for number, raw in enumerate(stream, start=1):
                if number == 1 and utf8:
                    raw = raw.removeprefix(UTF8_BOM)
                yield raw.decode(encoding)
        except UnicodeDecodeError as err:
            raise _not_encoded(name, number + 1 if wide else number, encoding, err) from err
        except (EOFError, OSError, ValueError) as err:  # gzip/bz2: EOFError or OSError; zstd: ZstdError
            what = f"{compression}-compressed data" if compression else "the file"
            raise IngestError(f"{name}: {what} ends early or is damaged after line {number}: {err}; the file may "
                              "be cut short (still being written or copied)") from err


def _parquet_rows(source: InputFile, stream: Any, compression: str | None
                  ) -> tuple[Iterator[tuple[int, list[str], str]], list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if source.path is not None and compression is None:
            stream.close()
            table = pq.read_table(source.path)
        else:  # Parquet's index is at its end: an object or a decompressed stream is read whole, in memory
            with stream:
                table = pq.read_table(pa.BufferReader(stream.read()))
    except (pa.ArrowException, OSError) as err:
        raise IngestError(f"{source.name}: starts as Parquet but cannot be read: {err}; the file may be cut short "
                          "or damaged") from err
    columns = table.column_names
    values = [[None if v is None else str(v) for v in table.column(c).to_pylist()] for c in columns]

    def parquet_rows() -> Iterator[tuple[int, list[str], str]]:
        for i in range(table.num_rows):
            fields = ["" if col[i] is None else col[i] for col in values]
            yield i + 2, fields, json.dumps(dict(zip(columns, fields, strict=True)))

    return parquet_rows(), columns


def _check_text(name: str, head: bytes, encoding: str, packed: str) -> None:
    """Refuses what is not text in `encoding`, saying what it is and what to do."""
    for magic, what, fix in OTHER_MAGIC:
        if head.startswith(magic):
            raise IngestError(f"{name}: the {packed}file is {what} (its first bytes: {_show_bytes(head)}), not a "
                              f"CSV or TSV log; {fix}")
    wide = codecs.lookup(encoding).name.startswith(("utf-16", "utf-32"))
    if head.startswith(UTF16_BOMS) and not wide:
        raise IngestError(f"{name}: the {packed}file starts with a UTF-16 byte-order mark ({_show_bytes(head[:2])}) "
                          f"but the spec reads {encoding}; set source.encoding: utf-16 in the feature spec")
    if head.startswith(UTF8_BOM) and codecs.lookup(encoding).name != "utf-8":
        raise IngestError(f"{name}: the {packed}file starts with a UTF-8 byte-order mark but the spec reads "
                          f"{encoding}; set source.encoding: utf-8 in the feature spec (or leave it out)")
    if not wide and b"\x00" in head:
        raise IngestError(f"{name}: the {packed}file holds binary data, not text (its first bytes: "
                          f"{_show_bytes(head)}); give a CSV, TSV or Parquet file (gzip, zstd or bz2 compressed or "
                          "not); for UTF-16 text set source.encoding: utf-16 in the feature spec")


def _not_encoded(name: str, line: int, encoding: str, err: UnicodeDecodeError) -> IngestError:
    return IngestError(f"{name}: line {line} is not {encoding} text ({err.reason}: {err.object[err.start:err.end]!r}); "
                       "set the feature spec's source.encoding to the file's encoding (for instance cp1252, latin-1 or "
                       "utf-16)")


def visible(text: str) -> str:
    """`text` with invisible characters (byte-order marks, zero-width and non-breaking spaces, control
    characters) written as escapes, so that a header that looks right shows why it is not."""
    out = []
    for c in text:
        if c == " " or (c.isprintable() and unicodedata.category(c) not in ("Cf", "Zs", "Zl", "Zp")):
            out.append(c)
        elif c in "\t\r\n":
            out.append(repr(c)[1:-1])
        else:
            out.append(f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
    return "".join(out)


def show_columns(columns: Sequence[str], limit: int = 40) -> str:
    shown = ", ".join(f"'{visible(c)}'" for c in columns[:limit])
    return f"[{shown}{', ...' if len(columns) > limit else ''}] ({len(columns)} columns)"


def _no_label_column(name: str, spec: FeatureSpec, header: list[str], first: str, delimiter: str) -> str:
    label = spec.label.column
    message = (f"{name}: no header line naming the label column {label!r}: the first line read as "
               f"{show_columns(header)}")
    near = [i for i, c in enumerate(header) if visible(c) != c and _plain_text(c) == label]
    if near:
        message += (f"; column {near[0] + 1} is {label!r} with invisible characters ('{visible(header[near[0]])}'): "
                    "remove them from the header")
    elif len(header) == 1 and (others := [d for d in ";|\t," if d != delimiter and d in first]):
        message += (f"; the line holds {others[0]!r}, not {delimiter!r}: give --format tsv for tabs, or set the "
                    f"spec's source.delimiter")
    return message + (f", and spec {spec.name!r} lists no source.columns to read it by position; add the header "
                      "line, or list the file's columns in order as the spec's source.columns")


def _plain_text(text: str) -> str:
    return "".join(c for c in text if visible(c) == c).strip()


def _row_checks(spec: FeatureSpec, columns: list[str]) -> list[Callable[[list[str]], str | None]]:
    label_at = columns.index(spec.label.column)
    checks: list[Callable[[list[str]], str | None]] = [
        lambda f: None if f[label_at].strip() in LABEL_VALUES else f"label: {spec.label.column}={f[label_at]!r} is "
                                                                     "not 0 or 1"]
    for feature in spec.features:
        if isinstance(feature, DenseFeature):
            checks.append(_number_check(feature.column, columns.index(feature.column)))
    if spec.timestamp is not None:
        timestamp = spec.timestamp
        at = columns.index(timestamp.column)

        def timestamp_check(fields: list[str]) -> str | None:
            try:
                parse_timestamp(fields[at], timestamp)
            except (ValueError, OverflowError, OSError):
                return f"timestamp: {timestamp.column}={fields[at]!r} does not match format {timestamp.format!r}"
            return None

        checks.append(timestamp_check)
    return checks


def _number_check(column: str, at: int) -> Callable[[list[str]], str | None]:
    def check(fields: list[str]) -> str | None:
        value = fields[at].strip()
        if value:
            try:
                float(value)
            except ValueError:
                return f"number: {column}={fields[at]!r} is not a number"
        return None

    return check


def _place(rows: list[tuple[datetime | None, list[str]]], timestamp: TimestampFeature | None,
           first: datetime | None, rows_per_minute: int) -> dict[datetime, list[list[str]]]:
    out: dict[datetime, list[list[str]]] = {}
    if timestamp is None:
        assert first is not None
        for index, (_, fields) in enumerate(rows):
            out.setdefault(first + timedelta(minutes=index // rows_per_minute), []).append(fields)
        return out
    if coarser_than_a_minute(timestamp):
        by_hour: dict[datetime, list[list[str]]] = {}
        for when, fields in rows:
            assert when is not None
            by_hour.setdefault(when.replace(minute=0, second=0, microsecond=0), []).append(fields)
        for hour, members in by_hour.items():
            for k, fields in enumerate(members):
                out.setdefault(hour + timedelta(minutes=k * 60 // len(members)), []).append(fields)
        return out
    for when, fields in rows:
        assert when is not None
        out.setdefault(when.replace(second=0, microsecond=0), []).append(fields)
    return out


def _encode(spec: FeatureSpec, columns: list[str], rows: list[list[str]]) -> bytes:
    if spec.source.format == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({c: [r[i] or None for r in rows] for i, c in enumerate(columns)})
        sink = io.BytesIO()
        pq.write_table(table, sink)
        return sink.getvalue()
    delimiter = spec.source.field_delimiter
    text = io.StringIO()
    if delimiter == ",":
        writer = csv.writer(text, delimiter=",", lineterminator="\n")
        if spec.source.header:
            writer.writerow(columns)
        writer.writerows(rows)
    else:
        if spec.source.header:
            text.write(delimiter.join(columns) + "\n")
        for row in rows:
            text.write(delimiter.join(row) + "\n")
    return text.getvalue().encode()


def _write_partition(directory: Path, file_name: str, data: bytes) -> bool:
    """Writes one minute (data file, then _SUCCESS) atomically. False when it was already there, unchanged."""
    final = directory / file_name
    if final.exists() and (directory / SUCCESS_MARKER).exists():
        return False
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{file_name}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, final)
    (directory / SUCCESS_MARKER).touch()
    return True


def write_rejects(layout: Layout, label: str, sources: list[InputFile], rejects: list[Reject]) -> Path:
    """The rejected lines of one ingest of `sources` as <data root>/ingest/<label>-<hash of the inputs>.rejects.tsv
    (file, line, reason, text); returns its path."""
    names = [str(s.path.absolute()) if s.path is not None else s.name for s in sources]
    key = hashlib.sha256("\0".join(names).encode()).hexdigest()[:8]
    target = layout.root / "ingest" / f"{label}-{key}.rejects.tsv"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "w", newline="") as handle:
        writer = csv.writer(handle, delimiter="\t", lineterminator="\n")
        writer.writerow(["file", "line", "reason", "text"])
        for reject in rejects:
            writer.writerow([reject.file, reject.line, reject.reason, reject.text])
    return target
