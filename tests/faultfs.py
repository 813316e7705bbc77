"""A read-only FUSE pass-through of one directory that answers EIO for reads touching one byte of one file:
a real read error, from the kernel, for pled's staging to meet. (No device-mapper on this machine: FUSE is
the way to get one without a failing disk.)

    python faultfs.py SOURCE_DIR MOUNTPOINT FILE_NAME OFFSET
"""
import errno
import os
import sys

import mfusepy as fuse


class FaultFS(fuse.Operations):
    use_ns = True
    def __init__(self, root: str, bad_name: str, bad_offset: int) -> None:
        self.root, self.bad_name, self.bad_offset = root, bad_name, bad_offset

    def _path(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def getattr(self, path, fh=None):
        try:
            st = os.lstat(self._path(path))
        except FileNotFoundError:
            raise fuse.FuseOSError(errno.ENOENT) from None
        return {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_atime",
                                             "st_mtime", "st_ctime")} | {"st_mtime_ns": st.st_mtime_ns}

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._path(path))]

    def open(self, path, flags):
        return os.open(self._path(path), os.O_RDONLY)

    def read(self, path, size, offset, fh):
        if os.path.basename(path) == self.bad_name and offset <= self.bad_offset < offset + size:
            raise fuse.FuseOSError(errno.EIO)
        return os.pread(fh, size, offset)

    def release(self, path, fh):
        os.close(fh)
        return 0


if __name__ == "__main__":
    source, mountpoint, name, offset = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    fuse.FUSE(FaultFS(source, name, offset), mountpoint, foreground=True, ro=True, nothreads=True)
