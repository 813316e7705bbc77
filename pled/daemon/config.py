"""pled.toml: read with tomllib, validated by pydantic, every error naming the key and the file.

Every key, with its default and a comment: config/pled.toml (installed as /usr/share/doc/pled/examples/pled.toml).
Relative table paths, and a relative metrics_file, are taken relative to the directory of the config file.
"""
from __future__ import annotations

import grp
import os
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from pled.daemon.config_errors import describe as _describe
from pled.daemon.config_values import (  # noqa: F401 (writer_uid, page_size_bytes: the daemon finds them here)
    _check_numa,
    _check_page_size,
    page_size_bytes,
    writer_uid,
)
from pled.shared.boundary import BoundaryError, clip
from pled.shared.config_file import (  # noqa: F401 (resolve_path)
    DOCS,
    EXAMPLE_CONFIG,
    MAX_DEPTH,
    check_socket_path,
    parse_toml,
    read_text,
    resolve_path,
)
from pled.shared.errors import ConfigError
from pled.shared.protocol import DEFAULT_SOCKET
from pled.shared.sizes import parse_size

HugePages = Literal["auto", "prefer-hugetlb", "hugetlb", "off"]
Numa = Literal["interleave", "local"] | tuple[StrictInt, ...]  # a list of nodes: bind to them
GpuAccess = Literal["read-only", "writable"]
GpuRoute = Literal["read-only", "pageable", "writable"]
GPU_ROUTES: tuple[str, ...] = ("read-only", "pageable", "writable")  # the default order
DEFAULT_VERIFY_INTERVAL = 60.0  # seconds between two verifies of a writable table


class TableConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    # One of the two: ``path``, whole files (a sidecar directory or a glob), or ``checkpoint``, a model checkpoint
    # whose PLE tables are assembled into arrays for vLLM 0.33's own PLE path (pled.daemon.sources.checkpoint).
    path: str | None = Field(default=None, min_length=1, max_length=4096)
    checkpoint: str | None = Field(default=None, min_length=1, max_length=4096)
    # Each one, where given, overrides the global key of the same name for this table (pageplan.py).
    huge_pages: HugePages | None = None
    huge_page_size: str | None = None
    numa: Numa | None = None
    # The GPU side (issue 45): "writable" lets the uids in ``writers`` map the table writable (for a GPU that cannot
    # register read-only memory); pled then verifies its bytes every ``verify_interval`` seconds.
    gpu_access: GpuAccess = "read-only"
    writers: tuple[StrictInt | str, ...] = ()
    gpu_routes: tuple[GpuRoute, ...] = GPU_ROUTES  # type: ignore[assignment]
    verify_interval: float | None = None  # seconds; None: DEFAULT_VERIFY_INTERVAL for a writable table
    # The writers' uids, resolved once when the config is loaded (start, reload): never through NSS at an Attach,
    # where a removed or renamed user would fail every Attach or hand the read-write fd to another uid.
    _writer_uids: frozenset[int] = PrivateAttr(default=frozenset())

    _page_size = field_validator("huge_page_size")(classmethod(lambda cls, v: _check_page_size(v)))
    _numa = field_validator("numa", mode="before")(classmethod(lambda cls, v: _check_numa(v)))

    @field_validator("writers")
    @classmethod
    def _writers(cls, writers: tuple[int | str, ...]) -> tuple[int | str, ...]:
        for w in writers:
            if isinstance(w, str):
                try:
                    writer_uid(w)
                except KeyError:
                    raise ValueError(f"no user named {clip(w, 64)!r} on this host; create it or use a uid") from None
            elif not 0 <= w < 2**32 - 1:
                raise ValueError(f"{w} is not a uid")
        if len(set(writers)) != len(writers):
            raise ValueError("names a writer twice")
        return writers

    @field_validator("gpu_routes")
    @classmethod
    def _routes(cls, routes: tuple[str, ...]) -> tuple[str, ...]:
        if not routes:
            raise ValueError("an empty list; name at least one of \"read-only\", \"pageable\", \"writable\"")
        if len(set(routes)) != len(routes):
            raise ValueError(f"{list(routes)} names a route twice")
        return routes

    @field_validator("verify_interval", mode="before")
    @classmethod
    def _interval(cls, value: object) -> object:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0.1 <= value <= 86400):
            raise ValueError("expected seconds, a number from 0.1 to 86400")
        return value

    @model_validator(mode="after")
    def _writable(self) -> TableConfig:
        if self.gpu_access != "writable":
            for key, given in (("writers", self.writers), ("verify_interval", self.verify_interval is not None)):
                if given:
                    raise ValueError(f"{key} is only for a table with gpu_access = \"writable\"; add that (read "
                                     f"{DOCS}/operations.md, \"The writable route\", first) or remove {key}")
        elif not self.writers:
            raise ValueError("gpu_access = \"writable\" needs writers = [...], the users (names or uids) who may "
                             "write the table, for example [\"vllm\"]")
        else:
            try:
                self._writer_uids = frozenset(writer_uid(w) for w in self.writers)
            except KeyError as err:  # removed between the key's check and here
                raise ValueError(f"no user named {clip(str(err), 64)} on this host; create it or use a uid") from None
        return self

    @property
    def writable(self) -> bool:
        return self.gpu_access == "writable"

    @property
    def writer_uids(self) -> frozenset[int]:
        """The uids that receive a read-write fd (empty unless writable), as resolved when the config was loaded."""
        return self._writer_uids

    @property
    def verify_seconds(self) -> float | None:
        """Seconds between two scheduled verifies; None for a read-only table (sealed: nothing can change)."""
        if not self.writable:
            return None
        return self.verify_interval if self.verify_interval is not None else DEFAULT_VERIFY_INTERVAL

    @field_validator("path", "checkpoint")
    @classmethod
    def _no_nul(cls, value: str | None) -> str | None:
        if value is not None and "\0" in value:
            raise ValueError("contains a NUL byte; a path cannot")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> TableConfig:
        if (self.path is None) == (self.checkpoint is None):
            raise ValueError("give either path (a sidecar directory, or a glob of .safetensors files, staged whole) "
                             "or checkpoint (a model checkpoint whose PLE tables vLLM 0.33 pins): "
                             + ("not both" if self.path else "neither is given"))
        return self

    @property
    def source(self) -> str:
        """What the table is staged from: its path or its checkpoint."""
        return self.path if self.path is not None else str(self.checkpoint)


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    socket: str = DEFAULT_SOCKET
    huge_pages: HugePages = "auto"
    huge_page_size: str | None = None  # None: the largest size the kernel offers whose pool has room (pageplan.py)
    numa: Numa | None = None  # None: interleave over every node with memory
    headroom_margin: int = 1024**3
    staging_bandwidth: int | None = None  # bytes/s; None: as fast as the disk goes
    allow_uids: tuple[StrictInt, ...] = ()  # Strict: TOML's true is no uid (Python's bool is an int)
    allow_groups: tuple[StrictInt | str, ...] = ()
    fdstore_max: StrictInt = Field(default=64, ge=0, le=1 << 20)  # FileDescriptorStoreMax=, where systemd does not say
    metrics_file: str | None = Field(default=None, min_length=1, max_length=4096)  # None: no metrics file
    metrics_interval: float = Field(default=15.0, ge=1, le=3600)  # seconds; the file is also written on each change
    verify_cpu_share: float = Field(default=0.1, gt=0, le=1)  # of one core, for the scheduled verify (writable tables)
    verify_bandwidth: int = 1_000_000_000  # bytes/s of memory the scheduled verify reads at most
    tables: tuple[TableConfig, ...] = Field(default=(), alias="table")
    _source: str = PrivateAttr(default="<defaults>")
    _allow_gids: frozenset[int] = PrivateAttr(default=frozenset())  # allow_groups resolved once, at load

    @property
    def source(self) -> str:
        """The file this configuration was read from."""
        return self._source

    def with_socket(self, socket: str) -> Config:
        """This config, from the same file, serving on ``socket`` (a reload cannot move a bound socket)."""
        config = self.model_copy(update={"socket": socket})
        config._source = self._source
        return config

    _page_size = field_validator("huge_page_size")(classmethod(lambda cls, v: _check_page_size(v)))
    _numa = field_validator("numa", mode="before")(classmethod(lambda cls, v: _check_numa(v)))

    @field_validator("metrics_file")
    @classmethod
    def _prom(cls, value: str | None) -> str | None:
        if value is not None and "\0" in value:
            raise ValueError("contains a NUL byte; a path cannot")
        if value is not None and not value.endswith(".prom"):  # node exporter's textfile collector reads only those
            raise ValueError(f"{clip(value, 80)!r} must end in .prom (the textfile collector reads only *.prom)")
        return value

    @field_validator("metrics_interval", mode="before")
    @classmethod
    def _seconds(cls, value: object) -> object:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("expected seconds, a number from 1 to 3600")
        return value

    @field_validator("headroom_margin", mode="before")
    @classmethod
    def _size(cls, value: object) -> int:
        if not isinstance(value, (int, str)):
            raise ValueError("expected bytes or a string like \"1GiB\"")
        return parse_size(value)

    @field_validator("verify_cpu_share", mode="before")
    @classmethod
    def _share(cls, value: object) -> object:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("expected a share of one core, a number above 0 and at most 1 (0.1: a tenth)")
        return value

    def table(self, name: str) -> TableConfig | None:
        """The table of that name in this config, if any."""
        return next((t for t in self.tables if t.name == name), None)

    @field_validator("staging_bandwidth", "verify_bandwidth", mode="before")
    @classmethod
    def _bandwidth(cls, value: object) -> int:
        """Bytes per second: 200000000, "200MB", "200MB/s", "1.5GiB/s"."""
        text = value[:-2] if isinstance(value, str) and value.endswith("/s") else value
        if not isinstance(text, (int, str)):
            raise ValueError("expected bytes per second or a string like \"500MB/s\"")
        rate = parse_size(text)
        if rate <= 0:
            raise ValueError("must be positive; leave it out for no limit")
        return rate

    @field_validator("allow_uids")
    @classmethod
    def _uids(cls, uids: tuple[int, ...]) -> tuple[int, ...]:
        for uid in uids:
            if not 0 <= uid < 2**32 - 1:
                raise ValueError(f"{uid} is not a uid")
        return uids

    @field_validator("allow_groups", mode="before")
    @classmethod
    def _group_kinds(cls, value: object) -> object:
        """One message for a member that is neither a gid nor a name (a boolean is neither: Python's bool is an
        int), not one per member of the union."""
        if isinstance(value, (list, tuple)):
            for g in value:
                if type(g) is not int and not isinstance(g, str):
                    shown = str(g).lower() if isinstance(g, bool) else clip(g, 40)
                    raise ValueError(f"expected gids or group names such as [0, \"adm\"], not {shown}")
        return value

    @field_validator("allow_groups")
    @classmethod
    def _groups(cls, groups: tuple[int | str, ...]) -> tuple[int | str, ...]:
        for g in groups:
            if isinstance(g, str):
                try:
                    grp.getgrnam(g)
                except KeyError:
                    raise ValueError(f"no group named {g!r} on this host; create it or use a gid") from None
            elif not 0 <= g < 2**32 - 1:
                raise ValueError(f"{g} is not a gid")
        return groups

    @model_validator(mode="after")
    def _resolve_groups(self) -> Config:
        try:
            self._allow_gids = frozenset(g if isinstance(g, int) else grp.getgrnam(g).gr_gid
                                         for g in self.allow_groups)
        except KeyError as err:  # removed between the key's check and here
            raise ValueError(f"allow_groups: no group named {clip(str(err), 64)} on this host") from None
        return self

    @property
    def allow_gids(self) -> frozenset[int]:
        """allow_groups as gids, resolved when the config was loaded (never through NSS on the loop)."""
        return self._allow_gids

    @field_validator("socket")
    @classmethod
    def _absolute(cls, value: str) -> str:
        return check_socket_path(value)

    @field_validator("tables")
    @classmethod
    def _unique_names(cls, tables: tuple[TableConfig, ...]) -> tuple[TableConfig, ...]:
        seen: set[str] = set()
        for table in tables:
            if table.name in seen:
                raise ValueError(f"table name {table.name!r} is used twice; names must be unique")
            seen.add(table.name)
        return tables


def parse(text: str, source: str) -> Config:
    """Validate TOML text; table paths are made absolute against the file's directory."""
    try:
        data = parse_toml(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(source, f"not valid TOML: {clip(err)}") from err
    except (BoundaryError, RecursionError, ValueError, OverflowError) as err:  # tomllib's int() and recursion
        raise ConfigError(source, f"not a config pled accepts: {clip(err) or type(err).__name__}") from err
    base = Path(source).resolve().parent
    if isinstance(data.get("table"), list):
        for entry in data["table"]:
            for key in ("path", "checkpoint"):
                if isinstance(entry, dict) and isinstance(entry.get(key), str) and entry[key]:
                    entry[key] = str(base / os.path.expanduser(entry[key]))
    if isinstance(data.get("metrics_file"), str) and data["metrics_file"]:  # as a table's path
        data["metrics_file"] = str(base / os.path.expanduser(data["metrics_file"]))
    try:
        config = Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(source, clip(_describe(err), 2000)) from err
    except (ValueError, OverflowError, RecursionError) as err:  # a validator's arithmetic on a hostile value
        raise ConfigError(source, f"a value is out of range ({clip(err)})") from err
    config._source = source
    return config


def load(explicit: str | None = None) -> Config:
    """The config file (-c PATH, else $PLED_CONFIG, else /etc/pled/pled.toml; config_file.py), validated."""
    path, text = read_text(explicit)
    return parse(text, path)
