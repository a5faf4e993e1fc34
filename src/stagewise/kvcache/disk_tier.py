"""The prefix cache's disk tier of one stage: full KV blocks ("pages") of cached prefixes kept as
files, one per block, under a directory named by everything that changes their bytes (model file
identity, dtype, block shape, the stage's layer range, tensor-parallel rank), bounded by a byte
budget with least-recently-used eviction. Pages are written by a background thread (a step only
copies the block out) and read back, checksum verified, when the driver asks for them.

It owns no policy: which blocks to write or read is the driver's call (kvcache/block_manager.py);
how pages reach the KV tensors is kvcache/pages.py's.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import queue
import stat
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("stagewise.kv_disk")

FORMAT_VERSION = 1
MAGIC = b"SWKV"
# magic, format version, block digest (32 bytes), payload bytes, crc32 of the payload
HEADER = struct.Struct("<4sI32sQI")
SUFFIX = ".kvp"
READ_DEADLINE_S = 5.0            # one page read slower than this fails (the page is recomputed)
QUEUE_BYTES = 256 << 20           # pages waiting for the writer, at most; more are dropped (never block a step)
WRITER_NICE = 10
SAMPLE_BYTES = 1 << 20            # model identity: bytes hashed at each end of a weight file, and ...
SAMPLES = 16                      # ... this many 64 KiB pieces spread between them
COUNTERS = ("enabled", "writable", "budget_bytes", "bytes_on_disk", "pages_on_disk", "pages_written",
            "bytes_written", "pages_read", "bytes_read", "pages_missing", "pages_corrupt", "pages_evicted",
            "pages_dropped", "write_errors", "save_copy_us", "writer_cpu_us")


def model_identity(model_path: str) -> str:
    """A digest of the model's files that is cheap at start (milliseconds for gigabytes): each
    weight or config file's name, size, modification time and samples of its bytes (both ends and
    16 pieces between). A different or rewritten file gets another identity; a copy of the same
    file too (its mtime differs), which only costs misses."""
    path = Path(model_path)
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.is_file() and p.suffix in (".gguf", ".safetensors", ".bin", ".json"))
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        with open(f, "rb") as fh:
            for offset in _sample_offsets(st.st_size):
                fh.seek(offset)
                h.update(fh.read(SAMPLE_BYTES if offset in (0, max(0, st.st_size - SAMPLE_BYTES)) else 64 << 10))
    return h.hexdigest()


def _sample_offsets(size: int) -> list[int]:
    last = max(0, size - SAMPLE_BYTES)
    inner = [SAMPLE_BYTES + (last - SAMPLE_BYTES) * i // (SAMPLES + 1) for i in range(1, SAMPLES + 1)] \
        if last > 2 * SAMPLE_BYTES else []
    return [0, *inner, last] if last else [0]


@dataclass
class TierStats:
    pages_written: int = 0
    bytes_written: int = 0
    pages_read: int = 0
    bytes_read: int = 0
    pages_missing: int = 0
    pages_corrupt: int = 0
    pages_evicted: int = 0
    pages_dropped: int = 0
    write_errors: int = 0
    save_copy_us: int = 0             # the step's thread copying blocks out (kvcache/pages.py)
    writer_cpu_us: int = 0            # the writer thread's CPU time


@dataclass
class _Write:
    digest: bytes
    payload: Any                      # a uint8 tensor (or anything with the buffer protocol)
    nbytes: int = field(default=0)


class DiskTier:
    """Pages of one stage in `root/<namespace>/`; `key` names everything that changes their bytes."""

    def __init__(self, root: str | Path, key: dict, page_bytes: int, budget_bytes: int):
        self.page_bytes, self.budget_bytes = page_bytes, budget_bytes
        self.stats = TierStats()
        self.index: OrderedDict[bytes, int] = OrderedDict()       # digest -> file bytes, least recent first
        self.lock = threading.Lock()
        self.enabled = self.writable = False
        self.queue: queue.Queue[_Write | None] = queue.Queue()
        self.queued_bytes = 0
        self.read_deadline_s = READ_DEADLINE_S
        self.reading_since: float | None = None   # a read in progress (monotonic start): shows a stalled disk
        self.dir = Path(root) / namespace_of(key)
        try:
            Path(root).mkdir(mode=0o700, parents=True, exist_ok=True)
            _private_dir(self.dir)
            meta = self.dir / "key.json"
            if not meta.exists():
                _write_private(meta, json.dumps(key, indent=1, sort_keys=True).encode())
            self._scan()
        except OSError as exc:
            log.warning("The KV disk tier is off: %s is not usable (%s); the prefix cache stays in RAM only.",
                        self.dir, exc)
            return
        self.enabled = self.writable = True
        self.writer = threading.Thread(target=self._write_loop, name="stagewise-kv-writer", daemon=True)
        self.writer.start()

    # reading (the step's thread)
    def has(self, digest: bytes) -> bool:
        with self.lock:
            return digest in self.index

    def read(self, digest: bytes) -> bytearray | None:
        """The page (header and payload), or None if it is absent or damaged (then dropped, with one warning)."""
        buf = bytearray(HEADER.size + self.page_bytes)
        return buf if self.read_into(digest, memoryview(buf)) else None

    def read_into(self, digest: bytes, buf: memoryview) -> bool:
        """Read the page into `buf` (HEADER.size + page_bytes); False if it is absent or damaged."""
        if not self.enabled or not self.has(digest):
            return False
        path = self._path(digest)
        self.reading_since = time.monotonic()
        try:
            n, extra = _read_regular(path, buf, self.read_deadline_s)
        except FileNotFoundError:
            self._forget(digest)
            self.stats.pages_missing += 1
            return False
        except OSError as exc:
            self._damaged(digest, path, f"unreadable ({exc.strerror or type(exc).__name__})")
            return False
        finally:
            self.reading_since = None
        why = self._check(buf, n, extra, digest)
        if why is not None:
            self._damaged(digest, path, why)
            return False
        with self.lock:
            if digest in self.index:
                self.index.move_to_end(digest)
        try:
            os.utime(path)            # the LRU order the next process sees
        except OSError:
            pass
        self.stats.pages_read += 1
        self.stats.bytes_read += self.page_bytes
        return True

    def _check(self, buf: memoryview, n: int | None, extra: bytes, digest: bytes) -> str | None:
        if n != len(buf) or extra:
            return f"{(n or 0) + len(extra)} bytes, expected {len(buf)}"
        magic, version, stored, length, crc = HEADER.unpack_from(buf)
        if magic != MAGIC or version != FORMAT_VERSION or stored != digest or length != self.page_bytes:
            return "a bad header"
        if zlib.crc32(buf[HEADER.size:]) != crc:
            return "a checksum mismatch"
        return None

    def _damaged(self, digest: bytes, path: Path, why: str) -> None:
        log.warning("KV page %s is damaged (%s); dropped it, and its tokens are recomputed.", path, why)
        self.stats.pages_corrupt += 1
        self._forget(digest)
        try:
            path.unlink()
        except OSError:
            pass

    def _forget(self, digest: bytes) -> None:
        with self.lock:
            self.index.pop(digest, None)

    # writing (queued by the step's thread, written by the writer)
    def save(self, digest: bytes, payload) -> bool:
        """Queue a page (a uint8 tensor of `page_bytes`, a copy the caller gives up); False if the
        tier is not writing, already holds it, or too much waits for the disk (the page is dropped)."""
        if not self.writable or self.has(digest):
            return False
        if self.queued_bytes + self.page_bytes > QUEUE_BYTES:
            self.stats.pages_dropped += 1       # the disk is slower than pages come
            return False
        self.queued_bytes += self.page_bytes
        self.queue.put(_Write(digest, payload, self.page_bytes))
        return True

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait (at most `timeout_s`) until the queued pages are on disk (before a process exits)."""
        if self.enabled and self.writer.is_alive():
            done = self._flushed = threading.Event()
            self.queue.put(None)
            done.wait(timeout_s)

    def _write_loop(self) -> None:
        # NOTE: Linux: this thread only. Nice 10 weighs ~1/10 of a step thread when both want a core, so
        # the steps keep theirs; not 19, which a busy shared machine starves (a shutdown's flush would time out)
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except (OSError, AttributeError):
            pass
        while True:
            item = self.queue.get()
            if item is None:
                flushed = getattr(self, "_flushed", None)
                if flushed is not None:
                    flushed.set()
                continue
            cpu = time.thread_time()
            try:
                if self.writable and not self.has(item.digest):
                    self._write(item)
            except OSError as exc:
                self._stop_writing(exc)
            finally:
                self.queued_bytes -= item.nbytes
                self.stats.writer_cpu_us += int((time.thread_time() - cpu) * 1e6)

    def _write(self, item: _Write) -> None:
        data = item.payload.numpy() if hasattr(item.payload, "numpy") else item.payload
        view = memoryview(data).cast("B")
        path = self._path(item.digest)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        if len(view) + HEADER.size > self.budget_bytes:
            self.stats.pages_dropped += 1         # a budget smaller than one page holds none
            return
        header = HEADER.pack(MAGIC, FORMAT_VERSION, item.digest, len(view), zlib.crc32(view))
        self._make_room(len(view) + HEADER.size)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, header)
            written = 0
            while written < len(view):
                written += os.write(fd, view[written:])
        except OSError:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, path)       # NOTE: atomic: a reader sees the whole page or none
        with self.lock:
            self.index[item.digest] = len(view) + HEADER.size
        self.stats.pages_written += 1
        self.stats.bytes_written += len(view) + HEADER.size

    def _make_room(self, nbytes: int) -> None:
        """Evict least recently used pages until `nbytes` more fit the budget."""
        while True:
            with self.lock:
                if not self.index or self.bytes_on_disk + nbytes <= self.budget_bytes:
                    return
                digest, _ = self.index.popitem(last=False)
            self._path(digest).unlink(missing_ok=True)
            self.stats.pages_evicted += 1

    def _stop_writing(self, exc: OSError) -> None:
        self.stats.write_errors += 1
        if self.writable:
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            log.warning("The KV disk tier stops writing pages to %s (%s%s); the prefix cache goes on in RAM "
                        "(pages already there are still read).", self.dir, "disk full: " if full else "", exc)
        self.writable = False

    # the directory
    def _path(self, digest: bytes) -> Path:
        return self.dir / (digest.hex() + SUFFIX)

    def _scan(self) -> None:
        """Index the pages a previous process left (oldest first), drop its half-written files, and
        evict down to this budget."""
        found, strays = [], []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(".tmp") and entry.is_file(follow_symlinks=False):
                Path(entry.path).unlink(missing_ok=True)
                continue
            digest = _digest_of(entry.name)
            st = entry.stat(follow_symlinks=False)
            if digest is None or not stat.S_ISREG(st.st_mode):
                if entry.name != "key.json":
                    strays.append(entry.name)
                continue
            found.append((st.st_mtime_ns, digest, st.st_size))
        if strays:          # NOTE: the directory is untrusted: what this tier did not write, it never opens
            log.warning("The KV disk tier ignores %d entr%s in its directory that it did not write (e.g. %r).",
                        len(strays), "y" if len(strays) == 1 else "ies", strays[0][:80])
        for _, digest, size in sorted(found):
            self.index[digest] = size
        self._make_room(0)

    @property
    def bytes_on_disk(self) -> int:
        return sum(self.index.values())

    def counters(self) -> list[int]:
        """This tier's numbers in `COUNTERS` order (they travel to the driver with each plan)."""
        s = self.stats
        with self.lock:
            on_disk, pages = sum(self.index.values()), len(self.index)
        return [int(self.enabled), int(self.writable), self.budget_bytes, on_disk, pages, s.pages_written,
                s.bytes_written, s.pages_read, s.bytes_read, s.pages_missing, s.pages_corrupt, s.pages_evicted,
                s.pages_dropped, s.write_errors, s.save_copy_us, s.writer_cpu_us]


def _digest_of(name: str) -> bytes | None:
    """The digest a page file's name spells (64 hex digits + SUFFIX), else None."""
    stem = name[:-len(SUFFIX)] if name.endswith(SUFFIX) else ""
    if len(stem) != 64 or any(c not in "0123456789abcdef" for c in stem):
        return None
    return bytes.fromhex(stem)


def _read_regular(path: Path, buf: memoryview, deadline_s: float) -> tuple[int, bytes]:
    """(bytes read into `buf`, the byte after them if any) of a regular file: a symlink, FIFO, device
    or socket planted in its place is refused at open (O_NOFOLLOW, O_NONBLOCK: a FIFO with no writer
    does not block) or by fstat; a read slower than `deadline_s` fails (a stalled disk)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        t0, n = time.monotonic(), 0
        while n < len(buf):
            got = os.readv(fd, [buf[n:]])
            if got == 0:
                break
            n += got
            if time.monotonic() - t0 > deadline_s:
                raise OSError(errno.ETIMEDOUT, f"read slower than {deadline_s:g} s")
        return n, os.read(fd, 1)
    finally:
        os.close(fd)


def namespace_of(key: dict) -> str:
    """The directory of a key: readable prefix (layers) and a digest of the whole key."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return f"layers{key.get('layers', ['?', '?'])[0]}-{key.get('layers', ['?', '?'])[1]}-{digest}"


def _private_dir(path: Path) -> None:
    """The tier's own directory: made, or made private (0700), and usable."""
    path.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, "not writable", str(path))


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def stage_budget(config, stage) -> int:
    """A stage's share of the disk budget: its share of the layers (every stage then holds as many
    pages, as a page holds the KV of the stage's layers)."""
    return config.cache.kv_cache_disk * (stage.end - stage.start) // stage.num_layers


