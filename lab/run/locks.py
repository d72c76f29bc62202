"""One process at a time in a folder: an advisory lock on <folder>/.lock, never following a link."""
import contextlib
import errno
import fcntl
import os

from lab.run import torchrun


@contextlib.contextmanager
def locked(folder, shared=False):
    """Hold `folder` (made if need be) for this process: an advisory lock (fcntl.flock) on <folder>/.lock, holding our
    pid. A second process (train.py or evaluate.py) on the same folder stops at once with a ValueError naming the folder
    and the holder's pid, unless both are `shared` (evaluations, each writing its own result files). The lock goes
    with the process, so a killed run (kill -9 included) leaves none behind. Under torchrun the first process holds
    it for all of them."""
    if torchrun.rank_and_world()[0] != 0:
        yield
        return
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise OSError(f"--out {folder}: cannot make the folder ({e.strerror or e})") from e
    path = os.path.join(folder, ".lock")
    fd, made = open_lock(path)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ValueError(f"{folder} is in use by another run (pid {holder}); wait for it to finish or choose "
                         "another --out") from None
    try:
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        except OSError as e:
            if made:
                os.remove(path)  # ours, empty: not left behind
            raise OSError(f"could not write the lock file {path} ({e.strerror or e})") from e
        yield
    finally:
        os.close(fd)


def open_lock(path):
    """(descriptor of the lock file at `path`, whether this call made it); an OSError naming it if it cannot be.
    Made exclusively (O_EXCL), so only the process that made the file may remove it; never through a symbolic link
    (O_NOFOLLOW: a link there is refused, and what it points to untouched)."""
    for made, verb, exclusive in ((True, "make", os.O_EXCL), (False, "open", 0)):
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | exclusive, 0o666), made
        except FileExistsError:  # only with O_EXCL: someone made it first, open it
            continue
        except OSError as e:
            if e.errno == errno.ELOOP or os.path.islink(path):
                raise OSError(f"the lock file {path} is a symbolic link, which is never followed; remove it") \
                    from None
            raise OSError(f"could not {verb} the lock file {path} ({e.strerror or e})") from e
