"""Archives read as streams, for trainer.sync.archive: a tar to the real end of its stream, a zip's
central directory before zipfile reads it.

Python's tarfile keeps every member it has read and ends its iteration, without an error, at the first
zero block, at a damaged header, or where the stream is cut: :class:`TarReader` drops members as they
come and checks where tarfile stopped, through :class:`TarStream`, a forward-only file object between
the decompressor and tarfile. zipfile parses a zip's whole central directory into memory when it opens
one (about 600 bytes an entry: 117 MiB for 200,000): :func:`zip_directory` and
:func:`walk_central_directory` count its entries first, keeping nothing (the format is fixed, APPNOTE
4.3.12-4.3.16, read as zipfile reads it).
"""

from __future__ import annotations

import collections
import io
import os
import struct
import tarfile
import zlib
from collections.abc import Iterator
from typing import Any, cast

from trainer.sync.errors import SyncError

CHUNK = 1024 * 1024  # what one read asks of a member's data, or of the stream after the archive
TAR_BLOCK = 512
# the largest size a ustar header's octal size field holds (11 digits)
USTAR_SIZE_MAX = 8**11 - 1
# tarfile reads a PAX or GNU long-name header's data whole into memory: a compressed stream of a
# few KB can declare one of a GiB. Nothing real comes near (a path is at most 4,096 bytes).
EXTENDED_HEADER_MAX = 16 * 1024 * 1024
EOCD = struct.Struct("<4s4H2LH")  # a zip's end of central directory record
EOCD64_LOCATOR = struct.Struct("<4sLQL")
EOCD64 = struct.Struct("<4sQ2H2L4Q")
CENTRAL = struct.Struct("<4s4B4HL2L5H2L")  # a zip's central directory header (zipfile's structCentralDir)


class ArchiveError(SyncError):
    """An archive was refused or could not be extracted."""


class Damaged(Exception):
    """The decompressed stream is damaged, truncated, or holds a header tarfile would read whole.

    Not an OSError (a gzip CRC error is one): the extractor names the member it was reading.
    """

    def __init__(self, where: int, reason: str) -> None:
        super().__init__(reason)
        self.where, self.reason = where, reason


class TarReader:
    """A tar read as one stream to its real end: tarfile's members one at a time, and its damage.

    tarfile keeps every member it has read (TarFile.members) and ends its iteration, without an
    error, at the first zero block, at a damaged header, or where the stream is cut: members are
    dropped as they come, and where tarfile stopped is checked (check_end). Refusals name the
    member being read, or the last good one, and the byte.
    """

    def __init__(self, raw: io.BufferedReader, archive: str) -> None:
        self.archive = archive
        self.stream = TarStream(raw)
        try:
            # a forward-only file object: tarfile reads and tells, never writes (typeshed's protocol asks for more)
            self.tf = tarfile.TarFile(fileobj=cast(Any, self.stream), mode="r")
        except (tarfile.TarError, Damaged, EOFError, zlib.error) as exc:
            raise ArchiveError(f"archive {archive}: not a readable tar file ({exc})") from exc
        self.reading: tarfile.TarInfo | None = None  # the member being extracted
        self.last: str | None = None  # the last member extracted whole

    def __iter__(self) -> Iterator[tarfile.TarInfo]:
        while (member := self.tf.next()) is not None:
            # tarfile's list of every member read (typeshed leaves the attribute out): memory grows with it
            cast(Any, self.tf).members.clear()
            self.check_pax_size(member)
            self.reading = member
            yield member
            self.last, self.reading = member.name, None

    def refuse(self, member: str | None, reason: str) -> ArchiveError:
        """A refusal naming ``member`` (None: before the first member)."""
        if member is None:
            return ArchiveError(f"archive {self.archive}: {reason}; refused")
        return ArchiveError(f"archive {self.archive}: member {member!r}: {reason}; refused")

    def explain(self, exc: Exception) -> ArchiveError:
        """The refusal of a damaged stream or of what tarfile could not read, where it happened."""
        which = "this" if self.last else "no"
        current = self.reading
        if isinstance(exc, Damaged):
            where = f"{exc.reason}, at byte {exc.where:,} of the tar"
            if current is not None:
                return self.refuse(current.name, f"{where}, in this member's data")
            return self.refuse(self.last, f"{where}, after {which} member")
        if not isinstance(exc, tarfile.ReadError):
            return ArchiveError(f"archive {self.archive}: corrupt or truncated ({exc})")
        if current is not None:  # tarfile's reader of a member's data found it cut short
            return self.refuse(
                current.name,
                f"the archive is truncated at byte {self.stream.pos:,}, inside this member's "
                f"{current.size:,} bytes of data from byte {current.offset_data:,} ({exc})",
            )
        if self.stream.pos < self.tf.offset:  # the stream ends in the padding after the last data
            return self.refuse(
                self.last,
                f"the archive is truncated at byte {self.stream.pos:,}, before the header at byte "
                f"{self.tf.offset:,}, after {which} member ({exc})",
            )
        return self.refuse(
            self.last, f"damaged tar header at byte {self.tf.offset:,}, after {which} member ({exc})"
        )

    def check_pax_size(self, member: tarfile.TarInfo) -> None:
        """Refuse a PAX ``size`` that contradicts the member's own tar header where it could hold it.

        The data that follows is read with the PAX size: a smaller one reads the rest of the data
        as the next header (tarfile then ends, silently), a larger one swallows the next members.
        """
        if "size" not in member.pax_headers or member.sparse is not None:
            return
        header = self.stream.header_before(member.offset_data)
        if header is None:
            raise self.refuse(member.name, "its tar header cannot be found again to check its PAX size")
        field = header[124:136]
        if field[0] & 0x80:  # base-256 (GNU): holds any size; 0xff starts a negative one
            ustar = int.from_bytes(field[1:], "big") if field[0] == 0x80 else -1
        else:  # as tarfile reads it (which has refused what does not read)
            ustar = int(field.split(b"\x00", 1)[0].strip() or b"0", 8)
            if member.size > USTAR_SIZE_MAX:
                return  # the field cannot hold it: the PAX size is the only one
        if ustar != member.size:
            raise self.refuse(
                member.name,
                f"its PAX header declares {member.size:,} bytes of data, its tar header {ustar:,}: "
                "a size override would misread the members after it",
            )

    def check_end(self, most: int) -> None:
        """Where tarfile stopped, the end-of-archive blocks must be, and nothing but zeros after them.

        Args:
            most: how many zero bytes may follow them (the whole-archive ratio limit's rest).
        """
        after, which = self.last, "this" if self.last else "no"
        start = self.tf.offset
        block = self.stream.block_at(start)
        if block is None:
            raise self.refuse(after, f"cannot find the block at byte {start:,} where tarfile stopped")
        if len(block) < TAR_BLOCK and not block.strip(b"\x00"):
            raise self.refuse(
                after,
                f"the archive is truncated at byte {start + len(block):,}, after {which} member: "
                f"{len(block):,} bytes of the {2 * TAR_BLOCK:,} zero bytes that end an archive",
            )
        if len(block) < TAR_BLOCK:
            raise self.refuse(
                after,
                f"the archive is truncated at byte {start + len(block):,}, inside the header at byte {start:,} "
                f"({len(block):,} of its {TAR_BLOCK} bytes), after {which} member",
            )
        if block.strip(b"\x00"):
            why, name = header_problem(block)
            why = why or "tarfile cannot read the member it starts"
            if name:
                behind = f", after the member {after!r}" if after else ""
                raise self.refuse(name, f"damaged tar header at byte {start:,} ({why}){behind}")
            raise self.refuse(after, f"damaged tar header at byte {start:,} ({why}), after {which} member")
        # the end-of-archive blocks: zeros to the end of the stream, at least two blocks of them
        zeros, other = self.stream.zeros_to_end(start + TAR_BLOCK, most)
        if other is not None:
            where, next_block = other
            why, name = header_problem(next_block) if len(next_block) == TAR_BLOCK else ("", "")
            if name and not why:
                raise self.refuse(
                    name,
                    f"comes after a zero block at byte {start:,} that ends the archive there (a zero block "
                    "in the middle of a damaged archive, or archives joined end to end)",
                )
            raise self.refuse(
                after, f"data at byte {where:,}, after the end-of-archive zero blocks at byte {start:,}"
            )
        if zeros is None:
            raise self.refuse(
                after,
                f"more than {most:,} bytes of zeros after the end of the archive at byte "
                f"{start:,} (the whole-archive ratio limit)",
            )
        if TAR_BLOCK + zeros < 2 * TAR_BLOCK:
            raise self.refuse(
                after,
                f"the archive is truncated at byte {start + TAR_BLOCK + zeros:,}, after {which} member: "
                f"{TAR_BLOCK + zeros:,} bytes of the {2 * TAR_BLOCK:,} zero bytes that end an archive",
            )


def header_problem(block: bytes) -> tuple[str, str]:
    """Why tarfile cannot read this 512-byte header ("" if it can), and the name in its name field."""
    name = block[:100].split(b"\x00", 1)[0].decode("utf-8", "surrogateescape")
    if block[345:500].strip(b"\x00") and block[257:263] == b"ustar\x00":  # POSIX prefix of a long name
        prefix = block[345:500].split(b"\x00", 1)[0].decode("utf-8", "surrogateescape")
        name = f"{prefix}/{name}"
    try:
        tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.HeaderError as exc:
        return str(exc) or type(exc).__name__, name
    return "", name  # a header tarfile reads: what follows it is what tarfile cannot read


class TarStream:
    """The decompressed tar stream, as tarfile reads it: forward only, minding where it is.

    A thin file object between the decompressor and tarfile: it keeps the last block's bytes
    read (so the header where tarfile stopped can be looked at again without seeking back,
    which in a gzip stream means decompressing it again from the start), turns the
    decompressor's errors (truncated stream, bad CRC, data after it) into Damaged with the
    position, and refuses a read larger than EXTENDED_HEADER_MAX (only tarfile's reading of
    a PAX or GNU long-name header's data asks for one: the extractor reads data in CHUNKs).
    """

    def __init__(self, raw: io.BufferedReader) -> None:
        magic = raw.read(6)
        raw.seek(0)
        self.source: Any = raw
        self.kind = "tar stream"
        self.errors: tuple[type[Exception], ...] = (EOFError, zlib.error, OSError)
        if magic.startswith(b"\x1f\x8b"):
            import gzip

            self.source, self.kind = gzip.GzipFile(fileobj=raw, mode="rb"), "gzip stream"
        elif magic.startswith(b"BZh"):
            import bz2

            self.source, self.kind = bz2.BZ2File(raw), "bzip2 stream"
        elif magic.startswith(b"\xfd7zXZ\x00"):
            import lzma

            self.source, self.kind = lzma.LZMAFile(raw), "xz stream"
            self.errors += (lzma.LZMAError,)
        self.pos = 0
        self.tail = b""  # the last (up to) TAR_BLOCK bytes read, ending at pos
        # the last blocks read as blocks (tarfile reads a header so), by position: where tarfile
        # stopped after reading a header and more (a PAX header and its records), its block is here
        self.blocks: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=4)

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0 or size > EXTENDED_HEADER_MAX:
            raise Damaged(
                self.pos,
                f"an extended header of more than {EXTENDED_HEADER_MAX:,} bytes (tarfile would read it "
                "whole into memory)",
            )
        try:
            data = self.source.read(size)
        except self.errors as exc:
            if isinstance(exc, OSError) and exc.errno is not None:
                raise  # the disk's, not the stream's (gzip's BadGzipFile and bz2's errors have none)
            raise Damaged(self.pos, f"the {self.kind} is truncated or damaged ({exc})") from exc
        if size == TAR_BLOCK:
            self.blocks.append((self.pos, data))
        self.pos += len(data)
        self.tail = data[-TAR_BLOCK:] if len(data) >= TAR_BLOCK else (self.tail + data)[-TAR_BLOCK:]
        return data

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_CUR:
            pos += self.pos
        elif whence != os.SEEK_SET:
            raise io.UnsupportedOperation("a compressed tar stream is read forward only")
        if pos < self.pos:
            raise io.UnsupportedOperation(f"a tar stream is read forward only: {self.pos:,} back to {pos:,}")
        while pos > self.pos and self.read(min(CHUNK, pos - self.pos)):
            pass
        return self.pos

    def header_before(self, offset: int) -> bytes | None:
        """The 512 bytes that end at ``offset``, if they were the last read."""
        return self.tail if self.pos == offset and len(self.tail) == TAR_BLOCK else None

    def block_at(self, start: int) -> bytes | None:
        """The block at ``start`` (shorter at the end of the stream), from what was read and what follows."""
        if self.pos < start:
            self.seek(start)
        behind = self.pos - start
        if behind > len(self.tail):
            return next((data for at, data in self.blocks if at == start), None)
        have = self.tail[len(self.tail) - behind :] if behind else b""
        return have + self.read(TAR_BLOCK - len(have)) if len(have) < TAR_BLOCK else have[:TAR_BLOCK]

    def zeros_to_end(self, start: int, most: int) -> tuple[int | None, tuple[int, bytes] | None]:
        """Read from ``start`` to the end of the stream, which must hold zeros only.

        Returns:
            (the number of zero bytes, None) when it does; (None, None) past ``most`` zero bytes;
            (None, (the position of the first other byte, the block that starts there)) otherwise.
        """
        if self.pos < start:
            self.seek(start)
        zeros = 0
        while chunk := self.read(CHUNK):
            rest = chunk.lstrip(b"\x00")
            if rest:
                where = self.pos - len(rest)
                aligned = where - where % TAR_BLOCK
                block = bytes(where - aligned) + rest[: TAR_BLOCK - (where - aligned)]
                if len(block) < TAR_BLOCK:
                    block += self.read(TAR_BLOCK - len(block))
                return None, (where, block)
            zeros += len(chunk)
            if zeros > most:
                return None, None
        return zeros, None


def zip_directory(raw: io.BufferedReader) -> tuple[int, int, int, bool]:
    """Where a zip's central directory is, as zipfile finds it: (start, size, entries declared, zip64).

    The end of central directory record is the last 22 bytes, or, after a comment, the last
    signature in the last 64 KiB; a zip64 locator just before it points to the zip64 record.

    Raises:
        ValueError: there is none, or it points outside the file.
    """
    size = raw.seek(0, os.SEEK_END)
    if size < EOCD.size:
        raise ValueError("too short for a zip file")
    raw.seek(size - EOCD.size)
    data = raw.read(EOCD.size)
    if data[:4] == b"PK\x05\x06" and data[-2:] == b"\x00\x00":
        end = size - EOCD.size
    else:
        low = max(size - 0xFFFF - EOCD.size, 0)
        raw.seek(low)
        tail = raw.read()
        found = tail.rfind(b"PK\x05\x06")
        if found < 0 or len(tail) - found < EOCD.size:
            raise ValueError("no end of central directory record")
        end, data = low + found, tail[found : found + EOCD.size]
    _, _, _, _, declared, cd_size, _, _ = EOCD.unpack(data)
    cd_end, zip64 = end, False
    if end >= EOCD64_LOCATOR.size + EOCD64.size:
        raw.seek(end - EOCD64_LOCATOR.size)
        locator = raw.read(EOCD64_LOCATOR.size)
        if locator[:4] == b"PK\x06\x07":
            raw.seek(end - EOCD64_LOCATOR.size - EOCD64.size)
            record = EOCD64.unpack(raw.read(EOCD64.size))
            if record[0] == b"PK\x06\x06":
                declared, cd_size, zip64 = record[7], record[8], True
                cd_end = end - EOCD64_LOCATOR.size - EOCD64.size
    if cd_size > cd_end:
        raise ValueError(f"its central directory of {cd_size:,} bytes would start before the file")
    return cd_end - cd_size, cd_size, declared, zip64


def walk_central_directory(
    raw: io.BufferedReader, start: int, size: int, stop: int
) -> tuple[int, str | None]:
    """Count the entries of a zip's central directory, as zipfile would read them, keeping nothing.

    Returns:
        (the number of entries, None), or, at the ``stop + 1``-th entry, (stop + 1, its name).

    Raises:
        ValueError: where an entry is not one.
    """
    raw.seek(start)
    n = walked = 0
    while walked < size:
        header = raw.read(CENTRAL.size)
        if len(header) != CENTRAL.size or header[:4] != b"PK\x01\x02":
            raise ValueError(f"no central directory entry at byte {start + walked:,} (entry {n + 1:,})")
        fields = CENTRAL.unpack(header)
        flags, name_len, rest = fields[5], fields[12], fields[13] + fields[14]
        n += 1
        if n > stop:
            name = raw.read(name_len).decode("utf-8" if flags & 0x800 else "cp437", "replace")
            return n, name.split("\x00", 1)[0]  # as zipfile names it
        raw.seek(name_len + rest, os.SEEK_CUR)
        walked += CENTRAL.size + name_len + rest
    return n, None
