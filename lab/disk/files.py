"""Files written whole or not at all (atomic writes, folders replaced at once), stale temporary files, and
checked caches (a header, shape, byte count and checksum)."""
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import time
import zlib

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save
from tqdm import tqdm


def generated(root, write):
    """`root`, written by write(folder) first if it is not there: into a temporary folder beside it, then renamed
    into place, so an interrupted generation never leaves a half-written dataset; if another process finished first,
    its copy is kept."""
    if os.path.isdir(root):
        return root
    os.makedirs(os.path.dirname(root), exist_ok=True)
    remove_stale_tmp(os.path.dirname(root))
    tmp = tmp_name(root)
    os.mkdir(tmp, 0o700)
    try:
        write(tmp)
        os.chmod(tmp, 0o755)  # private while written
        os.rename(tmp, root)
    except OSError:
        if not os.path.isdir(root):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def discard(folder):
    """Remove a folder the project wrote, at once for its readers: renamed to a temporary name first (then removed;
    a kill leaves only that name, which remove_stale_tmp removes). No folder there: nothing to do."""
    if not os.path.isdir(folder) or os.path.islink(folder):  # a link is not this project's folder (replaced says so)
        return
    gone = tmp_name(folder)
    try:
        os.rename(folder, gone)
    except OSError as e:
        raise OSError(f"could not remove the old {folder} ({e.strerror or e})") from e
    shutil.rmtree(gone, ignore_errors=True)


def replaced(root, write):
    """Write the folder `root` whole or not at all: write(folder) fills a temporary folder beside it, which then takes
    its place (the old folder renamed to a temporary name first and removed after), so a kill leaves the old folder
    whole, none, or the new one whole, never a mix; leftovers are temporary names (remove_stale_tmp). A failed write
    is an OSError naming `root`."""
    parent = os.path.dirname(os.path.abspath(root))
    tmp = old = None
    try:
        os.makedirs(parent, exist_ok=True)
        remove_stale_tmp(parent)
        tmp = tmp_name(root)
        os.mkdir(tmp)
        write(tmp)
        if os.path.lexists(root):
            if not os.path.isdir(root) or os.path.islink(root):  # not a folder this project wrote
                raise FileExistsError(f"{root} is there and is not a folder; move it away")
            old = tmp_name(root)
            os.rename(root, old)
        try:
            os.rename(tmp, root)
        except OSError:
            if old:  # put the previous folder back
                os.rename(old, root)
                old = None
            raise
    except OSError as e:
        raise OSError(f"could not write the folder {root} ({e.strerror or e}); the previous one, if any, is "
                      "unchanged") from e
    finally:
        for leftover in (tmp, old):
            if leftover and os.path.lexists(leftover):
                shutil.rmtree(leftover) if os.path.isdir(leftover) and not os.path.islink(leftover) else \
                    os.remove(leftover)
    return root


def plain_name(name):
    """`name`, a string from data that becomes a file's name (a yes-no task's category: its MME results file
    <category>.txt): not empty, "." or "..", and no path separator or NUL, so that a downloaded task file never names
    a file outside the folder written. Anything else is a ValueError saying why (the caller names file, line, field)."""
    if name in ("", ".", "..") or any(c in name for c in ("/", "\\", "\0")):
        raise ValueError(f"{name!r} cannot be a file's name (it names a results file): no path separator, NUL, "
                         "'.' or '..'")
    return name


# The writes every script makes (train.py, evaluate.py and lab's files), their leftovers cleaned up.

def atomic_write(path, write, durable=True):
    """Call write(f) on a new binary file beside `path`, then rename it over `path`: readers see the old file or the
    new one, never half of one; the new file follows the umask. durable: flushed to the disk (fsync) before the
    rename, so that even a power loss leaves the old file or the new one (checkpoints, adapters, results); caches
    pass False (a crash of the machine, not of the process, may then leave a renamed file whose bytes did not reach
    the disk, which read_cache refuses). A failed write, a full disk included, is an OSError naming `path`, which
    stays as it was. What killed writes left in the folder is removed first (remove_stale_tmp)."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise OSError(f"could not create the folder {folder} for {path} ({e.strerror or e})") from e
    remove_stale_tmp(folder)
    tmp = tmp_name(path)
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
            write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise NamedError(f"could not write {path} ({e.strerror or e}); the previous file, if any, is unchanged",
                         e) from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class NamedError(OSError):
    """An OSError whose message names the file, keeping the errno and strerror of the error it reports (`cause`), so a
    full disk (ENOSPC) is still told apart by whoever catches it."""

    def __init__(self, message, cause):
        super().__init__(cause.errno, cause.strerror)
        self.message = message

    def __str__(self):
        return self.message


def write_json(path, obj, indent=None):
    """Write obj as JSON to path atomically (atomic_write), creating its folder."""
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=indent).encode()))


STALE_TMP_S = 15 * 60  # a temporary file of another machine untouched this long has no live writer

TMP_MARK = "hyper-icl-tmp"

# Only names of this form are ever removed: .<name>.hyper-icl-tmp-<host>-<pid>-<12 hex>.tmp, never a user's file
TMP_NAME = re.compile(r"^\..*\." + TMP_MARK + r"-(?P<host>[A-Za-z0-9]{1,32})-(?P<pid>[0-9]{1,10})-[0-9a-f]{12}\.tmp$")


def this_host():
    """The host name as it goes into a temporary name: letters and digits only, at most 32."""
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"


def tmp_name(path, pid=None):
    """A new temporary name beside `path` that only this project makes: it names the writing host and process."""
    folder, base = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{base[:120]}.{TMP_MARK}-{this_host()}-{pid or os.getpid()}-"
                                f"{secrets.token_hex(6)}.tmp")


def is_stale_tmp(path):
    """Whether `path` is a temporary file or folder of a write that is over: a name tmp_name made whose process is
    gone (on this machine), or, from another machine, untouched for STALE_TMP_S. Any other name is never stale."""
    m = TMP_NAME.match(os.path.basename(path))
    if m is None:
        return False
    if m["host"] == this_host():
        try:
            os.kill(int(m["pid"]), 0)
        except ProcessLookupError:
            return True  # its process is gone
        except OSError:
            pass  # it exists, owned by someone else
        return False
    return time.time() - os.path.getmtime(path) > STALE_TMP_S


def remove_stale_tmp(folder):
    """Delete what killed writes left in `folder` (is_stale_tmp): atomic_write's files, `generated`'s folders.
    Nothing else is touched, whatever its name or age."""
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        try:
            if is_stale_tmp(path):
                shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        except FileNotFoundError:
            pass  # another process removed it first


def file_digest(path):
    """sha256 (hex) of a file's bytes, read 1 MB at a time: what an image is to a cache key or a data fingerprint (its
    cost beside a cache read: docs/efficiency.md), so a file replaced by another of the same size and time is told
    apart."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def sorted_metadata(raw):
    """safetensors bytes (safetensors.torch.save's) with their metadata in key order: safetensors writes a dict of
    metadata in the order of a hash map, which changes from one save to the next, so an adapter of several keys would
    not be the same bytes twice. The header is padded to 8 bytes as safetensors pads it; the tensors' bytes follow."""
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + raw[8 + n:]


def weights_digest(tensors):
    """sha256 of a state dict's names, shapes, dtypes and bytes (in name order): a cached file's checksum."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def bytes_checksum(tensors):
    """A cheap checksum of a state dict (in name order): each tensor's name, shape, dtype and the CRC-32 of its bytes
    (zlib's, several GB/s): any changed, swapped or reordered bytes, a zeroed tail, a truncation change it. It costs
    a fraction of reading the bytes (sha256 cost more than the read itself); it guards against damage, not against
    someone forging a file."""
    parts = []
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        crc = zlib.crc32(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else 0
        parts.append(f"{name}{tuple(t.shape)}{t.dtype}:crc32:{crc:08x}")
    return ";".join(parts)


def write_cache(path, tensors, key):
    """Write tensors to a cache file atomically, with their settings key and bytes_checksum in the metadata; not
    flushed to the disk (a cache is recomputed when a crash damaged it: read_cache)."""
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    meta = {"key": key, "checksum": bytes_checksum(tensors)}
    atomic_write(path, lambda f: f.write(save(tensors, metadata=meta)), durable=False)


def read_cache(path, key, shapes):
    """The tensors of a cache file written by write_cache, or None when there is none or it is unusable: unreadable
    (truncated, foreign), other tensors, shapes or dtypes than `shapes` ({name: (shape, dtype)}; a dimension or dtype
    None may be any), another settings key or bytes that do not match its checksum (reported in one line). A read
    costs about what reading the file's bytes costs (README)."""
    if not os.path.exists(path):
        return None
    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(path)
    except Exception as e:  # a truncated or foreign file: safetensors raises its own error types
        return cache_warning(path, f"unreadable: {str(e)[:80]}")
    if set(tensors) != set(shapes):
        return cache_warning(path, f"holds {sorted(tensors)}, expected {sorted(shapes)}")
    for name, (shape, dtype) in shapes.items():
        t = tensors[name]
        if len(t.shape) != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)) or \
                dtype is not None and t.dtype != dtype:
            return cache_warning(path, f"{name} is {tuple(t.shape)} {t.dtype}, expected "
                                       f"{tuple('*' if s is None else s for s in shape)} {dtype or ''}".rstrip())
    if meta.get("key") != key:
        return cache_warning(path, "it was written for other settings")
    if meta.get("checksum") != bytes_checksum(tensors):
        return cache_warning(path, "its bytes do not match their checksum")
    return tensors


def cache_warning(path, why):
    """Report an unusable cache file in one line; returns None (read_cache's answer for it)."""
    tqdm.write(f"warning: cache file {path} is unusable ({why}); computing it again")
    return None


def size(n):
    """n bytes in decimal units: "21.3 GB", "48.4 kB"."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"
