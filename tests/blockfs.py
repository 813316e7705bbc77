"""A read-only FUSE pass-through of one directory that hangs on demand, as an NFS or FUSE mount does when its
server stops answering: while the file FLAG exists (outside the mount), every getattr, open and read of a
path below the root waits until FLAG is removed. Each call that starts waiting appends a line ("getattr
/shard_0.safetensors") to FLAG + ".calls", so a test knows a call reached the file system and is held. A FLAG
that holds a number N holds only the reads of bytes at N or past it: a file's header (its first bytes) reads, its
data waits (a staging held, its planning not).

A held call the kernel interrupts (its process is killed, or exits with the call in flight) gets EINTR, as
an NFS mount's killable waits give: without that, the kernel waits for the answer even for a dying process
(FUSE's request_wait_answer), and the process lingers until the file system comes back.

Mount it with attr_timeout=0, entry_timeout=0 and negative_timeout=0 (done here): the kernel's caches then
cannot answer a stat for it.

    python blockfs.py SOURCE_DIR MOUNTPOINT FLAG
"""
import errno
import os
import sys
import threading
import time

import mfusepy as fuse


class BlockFS(fuse.Operations):
    use_ns = True

    def __init__(self, root: str, flag: str) -> None:
        self.root, self.flag, self._lock = root, flag, threading.Lock()

    def _path(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def _hold(self, what: str, path: str, offset: int | None = None) -> None:
        if path == "/" or not os.path.exists(self.flag):
            return
        try:
            with open(self.flag) as f:
                text = f.read().strip()
        except FileNotFoundError:
            return
        if text and (offset is None or offset < int(text)):
            return
        with self._lock, open(self.flag + ".calls", "a") as f:
            f.write(f"{what} {path}\n")
        while os.path.exists(self.flag):
            if fuse._libfuse.fuse_interrupted():
                raise fuse.FuseOSError(errno.EINTR)
            time.sleep(0.01)

    def getattr(self, path, fh=None):
        self._hold("getattr", path)
        try:
            st = os.lstat(self._path(path))
        except FileNotFoundError:
            raise fuse.FuseOSError(errno.ENOENT) from None
        return {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid")} | {
            "st_atime": st.st_atime_ns, "st_mtime": st.st_mtime_ns, "st_ctime": st.st_ctime_ns}

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._path(path))]

    def open(self, path, flags):
        self._hold("open", path)
        return os.open(self._path(path), os.O_RDONLY)

    def read(self, path, size, offset, fh):
        self._hold("read", path, offset + size - 1)
        return os.pread(fh, size, offset)

    def release(self, path, fh):
        os.close(fh)
        return 0


if __name__ == "__main__":
    source, mountpoint, flag = sys.argv[1:4]
    fuse.FUSE(BlockFS(source, flag), mountpoint, foreground=True, ro=True, attr_timeout=0, entry_timeout=0,
              negative_timeout=0)
