"""The tuning database, read side: measured best configs per (GPU kind, V, H, dtype, token bucket), looked up at
run time by ``choose`` (the writing side, used by ``flce-tune``, is ``flce_compile.tuning.db``).

Why a database: the best chunk size and CE-kernel launch parameters depend on the GPU and on the problem
shape, and measuring them costs minutes, so they are measured once (``flce-tune``) and looked up at run time.

Files. Every file has the same format (``FORMAT``, ``SCHEMA_VERSION``, a list of entries)::

    {"format": "flce_compile.tuning_db", "schema_version": 1,
     "entries": [{"device": ..., "vocab": ..., "hidden": ..., "dtype": ..., "tokens": ...,
                  "config": {...FLCEConfig...}, "ms": ..., "peak_gb": ..., "default_ms": ..., ...}, ...]}

  (the fields are those of ``Entry``; ``tuning_db/README.md`` describes each one).

Budget tiers. An entry may carry ``"budget_tier_gb": G``: it was tuned under an absolute memory budget of G GiB
(``flce-tune --budget-gb G``) and answers only calls that give a memory budget of at least G
(``memory_budget_gb``). It sits beside the plain entry of the same (GPU, V, H, dtype, bucket), never over it:
the tier is part of ``Entry.key``. A file holding such entries is written as schema version 2, because a
version-1 reader would take them for plain entries; a file without them stays version 1, readable by older
versions. This reader reads both.

* Shipped files: ``tuning_db/<gpu kind>.json`` at the repository top level (one file per GPU kind); in a built
  wheel they are package data under ``flce_compile/tuning_db/``.
* The user file: ``$FLCE_TUNING_DB`` or ``~/.cache/flce_compile/tuning_db.json`` (any number of GPU kinds);
  its entries override shipped ones.

Lookup (``lookup``, plain entries only) answers, in this order: user exact -> shipped exact -> nearest token bucket (same GPU, V, H,
dtype) -> nearest (V, H) on the same GPU -> ``None`` (the caller uses its heuristic); and a kind of the GPU's
family (``GPU_FAMILIES``: the H100 and H200 are one) answers too where it has a closer entry (exact before nearest
bucket before nearest shape, then the nearer bucket or shape; the GPU's own first among equally close ones): an
H100 runs the H200's entries. It sits on the op's hot path, so the files are parsed once into dicts and every
answer, a miss too, is memoised. The loaded index is re-validated at most every ``RECHECK_S`` (the environment
variables and the user file's mtime, size and inode), so a user file rewritten by another process is noticed;
``invalidate_cache`` drops everything at once (tests, and the writer after every write).

Robustness: a corrupt, foreign or newer-schema file is reported once through the logger and ignored until it
changes; the other files still answer. Without a home directory (and no ``$FLCE_TUNING_DB``) there is no user
layer. ``lookup`` never raises.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from ..log import logger
from . import registry
from .config import FLCEConfig
from .layout import vocab_needs_padding

#: The value of the "format" key; a JSON file without it is foreign and ignored.
FORMAT = "flce_compile.tuning_db"
#: The newest schema this reader understands. Bump when an existing reader could misread new files. Files with a
#: larger version are ignored (with a warning) and never overwritten. Version 2 added budget tiers
#: (``Entry.budget_tier_gb``); a file without tier entries is still written as ``PLAIN_SCHEMA_VERSION``.
SCHEMA_VERSION = 2
#: The version of a file that holds no budget-tier entries: what every reader since version 1 understands.
PLAIN_SCHEMA_VERSION = 1
#: Environment variable naming the user database file.
ENV_USER_DB = "FLCE_TUNING_DB"
#: Environment variable naming a directory of shipped-format files used *instead of* the packaged ones
#: (development and tests).
ENV_SHIPPED_DIR = "FLCE_TUNING_DB_SHIPPED"
#: A borrowed config's chunk may hold this much more logits memory (relative) than the measured one, so a
#: vocab a few percent larger does not drop the chunk a whole grid step.
RESCALE_TOLERANCE = 0.05
#: Entries whose (V, H) are further than this from the query (sum of |ln ratio| of V and H, plus dtype and
#: token terms) are not borrowed by the nearest-shape fallback; the heuristic is safer than a far-off config.
MAX_SHAPE_DISTANCE = 1.5

#: GPU kinds whose configs carry over to one another: the same SM design (shared memory, registers, tensor cores),
#: so a config tuned on one runs as it was measured on the others, and its chunk and tile trade-offs hold there. A
#: kind with no entry for a call, or only a farther one, reads its family's (``_lookup_in_family``). Measured for
#: the Hopper kinds: on an H100 (then without entries of its own), the H200's entries ran the four multi-chunk
#: benchmark shapes in 4-20% less time than the heuristic's
#: (``benchmarks/results/bench_flce_NVIDIA_H100_80GB_HBM3_s40_h100_*``).
#: A MIG slice ("h100_mig") is in no family: it has a fraction of the SMs and memory.
GPU_FAMILIES: dict[str, str] = {"h100": "hopper", "h200": "hopper", "h800": "hopper", "gh200": "hopper"}

_DTYPE_NAMES: dict[str, str] = {
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
}
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# ----------------------------------------------------------------------------------------------------------
# Normalisation helpers
# ----------------------------------------------------------------------------------------------------------

#: Words in a GPU name that say nothing about its speed class (vendor, form factor, memory size).
_NOISE_TOKENS = re.compile(
    r"^(nvidia|geforce|tesla|quadro|amd|instinct|radeon|graphics|sxm\d*|pcie|nvl|oam|hbm\d*e?|\d+(gb|g)|"
    r"accelerator|gpu|pro|max-?q|cuda|device|generation|gen)$"
)


def normalize_device_name(name: str) -> str:
    """Map a GPU name to its kind key: every H200 variant to "h200", every H100 to "h100", and so on.

    "NVIDIA H200", "NVIDIA H200 NVL" and "H200 SXM 141GB" are one kind for tuning purposes; the vendor,
    form factor and memory size are dropped. A MIG slice keeps a "_mig" suffix because it is much smaller than
    the whole GPU. Unknown names keep their remaining words joined by "_" (e.g. "rtx_4090").
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"device name {name!r} must be a non-empty string such as 'NVIDIA H200'")
    words = re.split(r"[^a-z0-9]+", name.lower())
    words = [w for w in words if w]
    mig = False
    if "mig" in words:  # "NVIDIA H100 80GB HBM3 MIG 1g.10gb": the slice is what runs
        words = words[: words.index("mig")]
        mig = True
    kept = [w for w in words if not _NOISE_TOKENS.match(w)]
    if not kept:
        kept = words or ["unknown"]
    # A model token such as h200, a100, a10g, l40s, mi300x, gh200, b200 names the kind on its own.
    model = next((w for w in kept if re.fullmatch(r"[a-z]{1,3}\d{1,4}[a-z]?", w)), None)
    key = model if model is not None else "_".join(kept)
    return key + "_mig" if mig else key


def normalize_dtype(dtype: torch.dtype | str) -> str:
    """Map torch.bfloat16 / "bfloat16" / "bf16" to the DB's short name ("bf16", "fp16" or "fp32")."""
    name = _DTYPE_NAMES.get(str(dtype).lower())
    if name is None:
        raise ValueError(f"dtype={dtype!r} is not tunable; use one of bf16, fp16, fp32")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a DB dtype name ("bf16" -> torch.bfloat16)."""
    return _TORCH_DTYPES[normalize_dtype(name)]


def token_bucket(tokens: int) -> int:
    """The power of two nearest to ``tokens`` in log scale (ties go up); entries are stored per bucket."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"tokens={tokens!r} must be a positive int")
    low = 1 << (tokens.bit_length() - 1)
    if low == tokens:
        return tokens
    high = low * 2
    return high if math.log2(tokens) - math.log2(low) >= 0.5 else low


_device_key_cache: dict[Any, str] = {}


def device_key(device: torch.device | str | int | None) -> str:
    """The GPU kind key for a torch device, a CUDA index, or a GPU name (memoised; cheap after the first call)."""
    cached = _device_key_cache.get(device)
    if cached is not None:
        return cached
    if isinstance(device, str) and not re.fullmatch(r"(cuda|cpu)(:\d+)?", device):
        key = normalize_device_name(device)  # already a name such as "NVIDIA H200" or "h200"
    else:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        if dev.type != "cuda":
            key = "cpu"
        else:
            key = normalize_device_name(torch.cuda.get_device_name(dev))
    _device_key_cache[device] = key
    return key


# ----------------------------------------------------------------------------------------------------------
# Entries and files
# ----------------------------------------------------------------------------------------------------------


def schema_version_for(entries: Iterable["Entry"]) -> int:
    """The schema version a file of ``entries`` is written with: 2 when any is a budget-tier entry (a version-1
    reader would misread it as a plain one), else 1, so files without tiers stay readable by older versions."""
    return SCHEMA_VERSION if any(e.budget_tier_gb is not None for e in entries) else PLAIN_SCHEMA_VERSION


def _budget_tier(value: Any) -> float | None:
    """A budget tier read from a file: None (a plain entry) or a positive finite number of GiB."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"budget_tier_gb={value!r} must be a number of GiB or null")
    tier = float(value)
    if not math.isfinite(tier) or tier <= 0:
        raise ValueError(f"budget_tier_gb={value!r} must be a positive finite number of GiB or null")
    return tier


@dataclass(frozen=True)
class Entry:
    """One measured result: the best config for (device, V, H, dtype, token bucket), within a memory budget tier
    when ``budget_tier_gb`` is set, and what it was worth."""

    device: str
    vocab: int
    hidden: int
    dtype: str
    tokens: int
    config: FLCEConfig
    ms: float
    peak_gb: float | None = None
    default_ms: float | None = None
    default_peak_gb: float | None = None
    trials: int = 0
    torch: str | None = None
    triton: str | None = None
    date: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    #: The absolute memory budget (GiB) the entry was tuned under (``flce-tune --budget-gb``), or None for a
    #: plain entry. A tier entry answers only calls with ``memory_budget_gb`` >= it (see ``find_budget_matches``).
    budget_tier_gb: float | None = None

    @property
    def key(self) -> tuple[str, int, int, str, int, float | None]:
        """What a file holds one entry per: (device, V, H, dtype, token bucket, budget tier or None)."""
        return (self.device, self.vocab, self.hidden, self.dtype, self.tokens, self.budget_tier_gb)

    @property
    def sort_key(self) -> tuple[str, int, int, str, int, float]:
        """``key`` with plain entries (tier None) first: the order of entries in a written file."""
        return (*self.key[:5], -1.0 if self.budget_tier_gb is None else self.budget_tier_gb)

    @property
    def measured_tokens(self) -> int:
        """The token count the entry was timed at (``extra["measured_tokens"]``, written by flce-tune), or its
        bucket when the entry does not say or says something that is no positive int (a hand-edited file must
        not break a call)."""
        tokens = self.extra.get("measured_tokens")
        return tokens if type(tokens) is int and tokens > 0 else self.tokens

    @property
    def speedup(self) -> float | None:
        """default_ms / ms, or None when the default was not measured."""
        if self.default_ms is None or not self.ms:
            return None
        return self.default_ms / self.ms

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "device": self.device, "vocab": self.vocab, "hidden": self.hidden, "dtype": self.dtype,
            "tokens": self.tokens, "config": self.config.to_dict(), "ms": self.ms, "peak_gb": self.peak_gb,
            "default_ms": self.default_ms, "default_peak_gb": self.default_peak_gb, "trials": self.trials,
            "torch": self.torch, "triton": self.triton, "date": self.date,
        }
        if self.budget_tier_gb is not None:  # plain entries are written exactly as before tiers existed
            data["budget_tier_gb"] = self.budget_tier_gb
        data.update({k: v for k, v in self.extra.items() if k not in data})
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Entry":
        """Parse one entry; raises ValueError/KeyError/TypeError/OverflowError on a malformed one (callers
        skip it)."""
        known = {"device", "vocab", "hidden", "dtype", "tokens", "config", "ms", "peak_gb", "default_ms",
                 "default_peak_gb", "trials", "torch", "triton", "date", "budget_tier_gb"}
        ms = data["ms"]
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms <= 0:
            raise ValueError(f"ms={ms!r} must be a positive number")
        vocab, hidden, tokens = (_positive_int(data, name) for name in ("vocab", "hidden", "tokens"))
        if not isinstance(data["device"], str):
            raise ValueError(f"device={data['device']!r} must be a string (a GPU kind such as \"h200\")")
        if not isinstance(data["config"], Mapping):
            raise TypeError(f"config={data['config']!r} must be an object of config fields")
        if data["config"].get("fp32_logits"):
            raise ValueError("config.fp32_logits=true: fp32 logits are the caller's precision choice "
                             "(precision=\"precise\"), never a tuned field; set it false")
        extra = {k: v for k, v in data.items() if k not in known}
        if not strict_json(extra):  # (JSON's 1e999 reads as infinity: the writer could not write it back)
            raise ValueError(f"a field outside the schema holds a non-finite number ({sorted(extra)})")
        return cls(
            device=normalize_device_name(data["device"]),
            vocab=vocab,
            hidden=hidden,
            dtype=normalize_dtype(data["dtype"]),
            tokens=token_bucket(tokens),
            config=FLCEConfig.from_dict(data["config"]),
            ms=ms,
            peak_gb=_opt_float(data, "peak_gb"),
            default_ms=_opt_float(data, "default_ms"),
            default_peak_gb=_opt_float(data, "default_peak_gb"),
            trials=int(data.get("trials") or 0),
            torch=data.get("torch"),
            triton=data.get("triton"),
            date=data.get("date"),
            extra=extra,
            budget_tier_gb=_budget_tier(data.get("budget_tier_gb")),
        )


def strict_json(item: Any) -> bool:
    """Whether ``item`` is strict JSON (no NaN or infinity, nothing JSON cannot hold): what the writer can write."""
    try:
        json.dumps(item, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def _positive_int(data: Mapping[str, Any], name: str) -> int:
    """``data[name]`` as a positive int; a float (even 32064.0), a bool or anything else is an error."""
    value = data[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return value


def _opt_float(data: Mapping[str, Any], name: str) -> float | None:
    """``data[name]`` as a finite float, or None when absent/null. A number written as a string (a hand edit) is
    read as before; a bool, anything else, or a non-finite value (JSON's ``1e999`` reads as infinity, "nan" as NaN)
    is an error: the writer could not write it back as strict JSON."""
    value = data.get(name)
    if value is None:
        return None
    try:
        number = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None
    except ValueError:
        number = None
    if number is None or not math.isfinite(number):
        raise ValueError(f"{name}={value!r} must be a finite number or null")
    return number


class DBFileError(ValueError):
    """A database file that cannot be used: unreadable, corrupt, foreign or of a newer schema."""


class DBCorruptError(DBFileError):
    """A database file whose bytes are not strict JSON (bad UTF-8, ``NaN``/``Infinity``, too deep, truncated):
    the writer moves it aside instead of refusing to overwrite it, as it does for a foreign file."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _parse_json(path: Path, raw: bytes) -> Any:
    """Strict JSON from a file's bytes; raises DBCorruptError for anything a strict JSON reader would refuse."""
    fix = "delete it or fix it (flce-tune moves a corrupt user DB aside on its next write)"
    try:
        # Python's json accepts NaN/Infinity; other tools do not, and an infinite time is no measurement. A
        # leading byte-order mark (some editors save one) is dropped, as JSON allows (such a file was once set
        # aside as corrupt).
        return json.loads(raw.decode("utf-8-sig"), parse_constant=_reject_constant)
    except UnicodeDecodeError as exc:
        raise DBCorruptError(f"tuning DB file {path} is not UTF-8 ({exc}); {fix}") from exc
    except RecursionError as exc:  # json's C scanner recurses per nesting level
        raise DBCorruptError(f"tuning DB file {path} nests too deep to be a tuning DB; {fix}") from exc
    except ValueError as exc:
        raise DBCorruptError(f"tuning DB file {path} is not valid JSON ({exc}); {fix}") from exc


@dataclass(frozen=True)
class FileScan:
    """What one file holds: its valid ``entries`` (one a key, the file's last), the per-entry ``problems``, the
    raw objects this version cannot parse (``unread``: a plugin strategy's entries, fields of a newer
    version, hand edits; a rewrite keeps them as they are) and the file's ``schema_version``."""

    entries: list[Entry]
    problems: list[str]
    unread: list[Any]
    schema_version: int


def scan_file(path: Path) -> FileScan:
    """Read one file. Raises DBFileError (its subclass DBCorruptError for bytes that are not strict JSON, which
    the writer moves aside), or FileNotFoundError for a missing file."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise DBFileError(f"cannot read tuning DB file {path}: {exc}") from exc
    data = _parse_json(path, raw)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise DBFileError(f"{path} is not an flce_compile tuning DB (no \"format\": \"{FORMAT}\"); ignored")
    version = data.get("schema_version")
    if not isinstance(version, int) or version < 1:
        raise DBFileError(f"tuning DB file {path} has an invalid schema_version={version!r}")
    if version > SCHEMA_VERSION:
        raise DBFileError(
            f"tuning DB file {path} has schema_version={version}, newer than this flce_compile understands "
            f"({SCHEMA_VERSION}); upgrade flce_compile or point {ENV_USER_DB} elsewhere"
        )
    raw_entries = data.get("entries")
    if not isinstance(raw_entries, list):
        raise DBFileError(f"tuning DB file {path} has no \"entries\" list")
    by_key: dict[tuple, tuple[int, Entry]] = {}  # one entry a key, the file's last (a hand edit can repeat one)
    problems: list[str] = []
    unread: list[Any] = []
    for i, item in enumerate(raw_entries):
        try:
            if not isinstance(item, Mapping):
                raise TypeError("entry is not an object")
            entry = Entry.from_dict(item)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int(1e400)
            problems.append(f"entry {i}: {type(exc).__name__}: {exc}")
            unread.append(item)  # (a hand-written note in the list too: a rewrite keeps it)
            continue
        if entry.key in by_key:
            problems.append(f"entry {by_key[entry.key][0]}: the same GPU kind, V, H, dtype, token bucket and tier as "
                            f"entry {i}, which is used instead")
        by_key[entry.key] = (i, entry)
    entries = [entry for _, entry in sorted(by_key.values(), key=lambda pair: pair[0])]
    return FileScan(entries, problems, unread, version)


def parse_file(path: Path) -> tuple[list[Entry], list[str]]:
    """Read one file; returns its valid entries and a list of per-entry problems (``scan_file``'s)."""
    scan = scan_file(path)
    return scan.entries, scan.problems


def read_file(path: str | os.PathLike[str], *, strict: bool = False) -> list[Entry]:
    """Entries of one file. A missing file is empty. A bad file raises DBFileError if ``strict``, else it is
    reported once through the logger and read as empty."""
    p = Path(path)
    try:
        entries, problems = parse_file(p)
    except FileNotFoundError:
        return []
    except DBFileError as exc:
        if strict:
            raise
        _warn_once(str(p), str(exc))
        return []
    if problems:
        _warn_once(str(p), f"tuning DB file {p}: skipped {len(problems)} malformed entries ({problems[0]})")
    return entries


_warned: set[tuple[str, str]] = set()
_warn_lock = threading.Lock()


def _warn_once(path: str, message: str) -> None:
    with _warn_lock:
        if (path, message) in _warned:
            return
        _warned.add((path, message))
    logger.warning("%s", message)


# ----------------------------------------------------------------------------------------------------------
# Locations
# ----------------------------------------------------------------------------------------------------------


def user_db_path() -> Path | None:
    """The user database file: ``$FLCE_TUNING_DB`` or ``~/.cache/flce_compile/tuning_db.json``.

    ``None`` when neither names a file: no ``$FLCE_TUNING_DB`` and no home directory (a container running as
    an arbitrary UID has no ``$HOME`` and no passwd entry). Lookups then use the shipped files alone.
    """
    env = os.environ.get(ENV_USER_DB)
    try:
        if env:
            return Path(env).expanduser()
        return Path.home() / ".cache" / "flce_compile" / "tuning_db.json"
    except (RuntimeError, KeyError, OSError):  # Path.home/expanduser: RuntimeError (3.11), KeyError (older)
        return None


def shipped_dirs(package_dir: Path | None = None) -> list[Path]:
    """Directories holding the shipped ``<gpu kind>.json`` files.

    ``$FLCE_TUNING_DB_SHIPPED`` if set; else ``flce_compile/tuning_db/`` when it exists (an installed wheel,
    where it is package data); else the repository's top-level ``tuning_db/`` (a source checkout or an
    editable install, where that directory is the source of truth). ``package_dir`` (the ``flce_compile``
    directory; default: this installation's) is for tests of an installed layout.
    """
    env = os.environ.get(ENV_SHIPPED_DIR)
    if env and package_dir is None:
        chosen = Path(env).expanduser()
        if not chosen.is_dir():  # a typo would silently drop every shipped entry
            _warn_once(f"${ENV_SHIPPED_DIR}", f"${ENV_SHIPPED_DIR}={env} is not a directory: no shipped tuning "
                                              "entries are read; unset it to use the packaged ones")
        return [chosen]
    package_dir = Path(package_dir) if package_dir is not None else Path(__file__).resolve().parent.parent
    packaged = package_dir / "tuning_db"
    if packaged.is_dir():
        return [packaged]
    repo = package_dir.parent
    top = repo / "tuning_db"
    if top.is_dir() and ((repo / "pyproject.toml").exists() or (repo / ".git").exists()):
        return [top]
    return []


def shipped_files() -> list[Path]:
    """The shipped JSON files, sorted by name."""
    files: list[Path] = []
    for d in shipped_dirs():
        files.extend(sorted(p for p in d.glob("*.json") if p.is_file()))
    return files


# ----------------------------------------------------------------------------------------------------------
# The loaded, indexed database and lookup
# ----------------------------------------------------------------------------------------------------------

_Key = tuple[str, int, int, str, int, "float | None"]
#: (device, V, H, dtype): the shape a budget-tier lookup searches, over every bucket and tier.
_ShapeKey = tuple[str, int, int, str]


#: A loaded index is re-validated (both environment variables, and the user file's mtime, size and inode) at
#: most this often. Measured on the 2-core CI box (min of 7 x 20000 calls): a cached lookup 1.0-1.3 us with
#: this throttle, 16-34 us re-validating on every call (os.stat alone 2.6 us, the environment reads 2.4 us;
#: time.monotonic 0.06 us), and os.stat on a network home directory can take milliseconds. A second is soon
#: enough to notice a DB that another process (flce-tune beside a training job) rewrote; ``invalidate_cache``
#: makes it immediate.
RECHECK_S = 1.0
_clock = time.monotonic  # a module attribute so tests can move time forward

#: How a lookup answered, most specific first (``Match.kind``); no match means the heuristic.
MATCH_KINDS = ("user exact", "shipped exact", "nearest bucket", "nearest shape")


@dataclass(frozen=True)
class Match:
    """What a lookup found: the config to run, where it came from and the entry it was taken from."""

    config: FLCEConfig
    #: The op's source string ("tuning_db:user_exact", ...), shown in the debug log and by explain().
    source: str
    #: One of MATCH_KINDS.
    kind: str
    #: The entry the config comes from; a nearest-shape answer rescales its chunk, so ``config`` may differ.
    entry: Entry
    #: The GPU kind whose entry answered when it is not the call's own (``GPU_FAMILIES``), else None.
    borrowed_from: str | None = None


class _Index:
    """Both layers (user, shipped) indexed for dict lookups, per-device lists of plain entries for the fallbacks,
    per-shape lists of budget-tier entries, and the memoised answers (misses included) for exactly this content."""

    def __init__(self, user: list[Entry], shipped: list[Entry], signature: tuple[Any, ...]) -> None:
        self.user: dict[_Key, Entry] = {e.key: e for e in user}
        self.shipped: dict[_Key, Entry] = {e.key: e for e in shipped}
        merged = dict(self.shipped)
        merged.update(self.user)  # user overrides shipped
        self.merged = merged
        self.by_device: dict[str, list[tuple[Entry, str]]] = {}
        self.tiers: dict[_ShapeKey, list[tuple[Entry, str]]] = {}
        for key, entry in merged.items():
            layer = "user" if key in self.user else "shipped"
            if entry.budget_tier_gb is None:
                self.by_device.setdefault(entry.device, []).append((entry, layer))
            else:
                self.tiers.setdefault(key[:4], []).append((entry, layer))
        self.signature = signature
        self.recheck_at = _clock() + RECHECK_S
        #: Distinct for every loaded index: callers that memoise answers derived from lookups key them on it
        #: (``generation``), so a reloaded DB misses their caches.
        self.generation = next(_index_generations)
        # The memo belongs to the index: a reload starts an empty one, so no stale answer can outlive its file.
        self.memo: dict[tuple[Any, ...], Any] = {}  # Match | None, or a tuple of budget-tier Matches


_state_lock = threading.Lock()
_index: _Index | None = None
_index_generations = itertools.count(1)
_MISS = object()


def invalidate_cache() -> None:
    """Forget the loaded files and memoised answers; the next lookup re-reads the files.

    Called by ``write_entries``. Lookups notice a changed environment variable or user file by themselves
    within ``RECHECK_S``; call this to make that immediate (tests, a DB edited by hand in a running process).
    """
    global _index
    with _state_lock:
        _index = None
        _device_key_cache.clear()


def _signature() -> tuple[Any, ...]:
    """What decides the loaded content: both environment variables, the user file's identity (mtime, size,
    inode: a rewrite by another process renames a new inode into place), and, last, the strategy registry's
    generation (entries are checked against the registered strategies as they are read: one naming a strategy
    registered later is dropped until a reload, and one naming a strategy since unregistered must go)."""
    path = user_db_path()
    try:
        st = os.stat(path) if path is not None else None
    except OSError:
        st = None
    ident = None if st is None else (st.st_mtime_ns, st.st_size, st.st_ino)
    return (os.environ.get(ENV_USER_DB), os.environ.get(ENV_SHIPPED_DIR), path, ident, registry.generation())


def _read_layer(paths: Iterable[Path]) -> list[Entry]:
    entries: list[Entry] = []
    for path in paths:
        try:
            entries.extend(read_file(path))
        except Exception as exc:  # noqa: BLE001 - an unforeseen failure of one file must not hide the others
            _warn_once(str(path), f"tuning DB file {path} could not be read ({type(exc).__name__}: {exc}); ignored")
    return entries


def _get_index() -> _Index:
    """The loaded index; cheap (one clock read and the registry's generation) until ``RECHECK_S`` has passed since
    it was last validated, or at once after the strategy registry changed."""
    global _index
    index = _index
    if index is not None and _clock() < index.recheck_at and index.signature[-1] == registry.generation():
        return index
    sig = _signature()
    with _state_lock:
        if _index is not None and _index.signature == sig:
            _index.recheck_at = _clock() + RECHECK_S
            return _index
        user_path = sig[2]  # None: no home directory and no $FLCE_TUNING_DB, so no user layer
        shipped = _read_layer(shipped_files())
        user = _read_layer([user_path] if user_path is not None else [])
        _index = _Index(user, shipped, sig)
        logger.debug("tuning DB loaded: %d user entries (%s), %d shipped entries", len(user),
                     user_path or "no user DB: no home directory and no $" + ENV_USER_DB, len(shipped))
        return _index


def generation() -> int:
    """A number that changes whenever the loaded content may have changed (a reload after ``RECHECK_S`` found
    a changed file or environment variable, or ``invalidate_cache``): part of the key of any answer memoised
    outside this module (``choose.op_config``). As cheap as a lookup's own validation: one clock read until
    ``RECHECK_S`` has passed."""
    return _get_index().generation


def load_entries(*, layer: str = "merged") -> list[Entry]:
    """All loaded entries of one layer: "user", "shipped" or "merged" (user overriding shipped)."""
    index = _get_index()
    table = {"user": index.user, "shipped": index.shipped, "merged": index.merged}.get(layer)
    if table is None:
        raise ValueError(f"layer={layer!r} is unknown; use 'user', 'shipped' or 'merged'")
    return sorted(table.values(), key=lambda e: e.sort_key)


def _chunk_grid_floor(limit: float) -> int:
    """The largest chunk of the tuner's grid (powers of two and the 1.5x steps between them) not above ``limit``."""
    low = 1 << (max(1, int(limit)).bit_length() - 1)
    return 3 * low // 2 if low >= 2 and 3 * low // 2 <= limit else low


def _at_vocab(config: FLCEConfig, from_vocab: int, to_vocab: int, dtype: str) -> FLCEConfig:
    """A config measured at ``from_vocab``, for a call at ``to_vocab``.

    The logits chunk (chunk_tokens x V) keeps about its size: the largest grid chunk whose logits are at most
    ``RESCALE_TOLERANCE`` larger than the measured ones. ``pad_vocab`` follows the call's V as the heuristic's does:
    an entry at an aligned V (128256) holds False because padding changes nothing there, which at an odd V
    (128257, a pad token added) would leave the GEMMs unaligned, 3.2x slower at GPT-2's shape
    (``choose.heuristic_config``); an entry measured at an odd V keeps its own choice."""
    if from_vocab == to_vocab:
        return config
    chunk = _chunk_grid_floor(config.chunk_tokens * from_vocab / to_vocab * (1 + RESCALE_TOLERANCE))
    itemsize = _TORCH_DTYPES[dtype].itemsize
    odd = vocab_needs_padding(to_vocab, itemsize)
    pad = odd and (config.pad_vocab or not vocab_needs_padding(from_vocab, itemsize))
    if (chunk, pad) == (config.chunk_tokens, config.pad_vocab):
        return config
    return dataclasses.replace(config, chunk_tokens=chunk, pad_vocab=pad)


def _lookup_uncached(index: _Index, dev: str, vocab: int, hidden: int, dtype: str, bucket: int) -> Match | None:
    key = (dev, vocab, hidden, dtype, bucket, None)
    entry = index.user.get(key)
    if entry is not None:
        return Match(entry.config, "tuning_db:user_exact", "user exact", entry)
    entry = index.shipped.get(key)
    if entry is not None:
        return Match(entry.config, "tuning_db:shipped_exact", "shipped exact", entry)
    candidates = index.by_device.get(dev, [])
    log_bucket = math.log2(bucket)
    # Nearest token bucket, same (V, H, dtype); the user layer wins ties.
    same_shape = [(e, layer) for e, layer in candidates if (e.vocab, e.hidden, e.dtype) == (vocab, hidden, dtype)]
    if same_shape:
        e, layer = min(same_shape, key=lambda el: (_bucket_distance(el[0], log_bucket), el[1] != "user", el[0].tokens))
        return Match(e.config, f"tuning_db:nearest_tokens({layer} tokens={e.tokens})", "nearest bucket", e)
    # Nearest (V, H) on the same GPU: log-ratio distance, a dtype penalty (same itemsize only), a small token term.
    best: tuple[float, Entry, str] | None = None
    for e, layer in candidates:
        if _TORCH_DTYPES[e.dtype].itemsize != _TORCH_DTYPES[dtype].itemsize:
            continue
        dist = _shape_distance(e, vocab, hidden, dtype, log_bucket) + (0.0 if layer == "user" else 1e-9)
        if best is None or dist < best[0]:
            best = (dist, e, layer)
    if best is not None and best[0] <= MAX_SHAPE_DISTANCE:
        _, e, layer = best
        source = f"tuning_db:nearest_shape({layer} V={e.vocab} H={e.hidden} dtype={e.dtype} tokens={e.tokens})"
        return Match(_at_vocab(e.config, e.vocab, vocab, dtype), source, "nearest shape", e)
    return None


def _bucket_distance(e: Entry, log_bucket: float) -> float:
    """How far entry ``e``'s token bucket is from a call's (``log_bucket``: log2 of it), in doublings."""
    return abs(math.log2(e.tokens) - log_bucket)


def _shape_distance(e: Entry, vocab: int, hidden: int, dtype: str, log_bucket: float) -> float:
    """How far entry ``e`` is from a call of another (V, H): log-ratio distance, a dtype penalty (same itemsize
    only: the caller filters), a small token term."""
    return (abs(math.log(e.vocab / vocab)) + abs(math.log(e.hidden / hidden)) + (0.0 if e.dtype == dtype else 0.5)
            + 0.05 * _bucket_distance(e, log_bucket))


def family_kinds(kind: str) -> list[str]:
    """The other GPU kinds of ``kind``'s family (``GPU_FAMILIES``), by name; none for a kind in no family."""
    family = GPU_FAMILIES.get(kind)
    return [] if family is None else sorted(k for k, f in GPU_FAMILIES.items() if f == family and k != kind)


def kind_is_served(kind: str, held: set[str]) -> bool:
    """Whether entries of the GPU kinds ``held`` can answer calls on ``kind``: its own, or its family's. (Where not,
    a lookup for it is the heuristic's, and the kind may be misspelt: ``which_config`` and ``flce-tune --which``
    say so.)"""
    return kind in held or not held.isdisjoint(family_kinds(kind))


def _borrowed(match: Match, kind: str) -> Match:
    """``match`` (found among ``kind``'s entries) as the answer for a GPU of ``kind``'s family."""
    return dataclasses.replace(match, source=f"{match.source} (borrowed from {kind})", borrowed_from=kind)


#: How close a match's entry is to the call: measured at its token bucket, at another bucket, at another shape.
_CLOSENESS = {"user exact": 0, "shipped exact": 0, "nearest bucket": 1, "nearest shape": 2}


def _lookup_in_family(index: _Index, dev: str, vocab: int, hidden: int, dtype: str, bucket: int) -> Match | None:
    """``_lookup_uncached`` on ``dev`` and on the other kinds of its family: the closest answer (``_CLOSENESS``,
    then, between two nearest-bucket or two nearest-shape answers, the distance each kind's lookup minimised),
    ``dev``'s own where it is as close as a borrowed one, then the first kind by name. An entry of the call's
    token bucket measured on a GPU of the family is a better guess than one of ``dev``'s own at another bucket
    or shape: the chunk and tile trade-offs follow the shape and token count more than the kind."""
    candidates = [(dev, _lookup_uncached(index, dev, vocab, hidden, dtype, bucket))]
    candidates += [(kind, _lookup_uncached(index, kind, vocab, hidden, dtype, bucket))
                   for kind in family_kinds(dev) if kind in index.by_device]
    log_bucket = math.log2(bucket)

    def distance(m: Match) -> float:  # within a closeness class: the distance the kind's own lookup minimised
        if m.kind == "nearest bucket":
            return _bucket_distance(m.entry, log_bucket)
        if m.kind == "nearest shape":
            return _shape_distance(m.entry, vocab, hidden, dtype, log_bucket)
        return 0.0

    found = [(_CLOSENESS[m.kind], distance(m), kind != dev, kind, m) for kind, m in candidates if m is not None]
    if not found:
        return None
    _, _, borrowed, kind, match = min(found, key=lambda c: c[:4])
    return _borrowed(match, kind) if borrowed else match


def find_match(
    *, vocab: int, hidden: int, dtype: torch.dtype | str, tokens: int, device: torch.device | str | int | None
) -> Match | None:
    """``lookup``'s answer with the entry it came from (``which_config`` reports it); ``None``: the heuristic.

    Same rules, same cache and the same guarantee as ``lookup``: never raises.
    """
    try:
        index = _get_index()
        bucket = token_bucket(int(tokens))
        memo_key = (device, vocab, hidden, dtype, bucket)
        hit = index.memo.get(memo_key, _MISS)
        if hit is not _MISS:
            return hit  # type: ignore[return-value]
        dev = device_key(device)
        shape = (int(vocab), int(hidden), normalize_dtype(dtype), bucket)
        match = _lookup_in_family(index, dev, *shape)
        if match is None:
            logger.debug("tuning DB: no entry for %s V=%d H=%d %s tokens=%d -> heuristic", dev, vocab, hidden, dtype, tokens)
        else:
            logger.debug("tuning DB: %s V=%d H=%d %s tokens=%d -> %s %s", dev, vocab, hidden, dtype, tokens,
                         match.source, match.config.to_json())
        index.memo[memo_key] = match  # misses too: a shape without an entry is asked again on every call
        return match
    except Exception as exc:  # noqa: BLE001 - the DB must never break the op
        _warn_once("lookup", f"tuning DB lookup failed ({type(exc).__name__}: {exc}); using the heuristic")
        return None


def lookup(
    *, vocab: int, hidden: int, dtype: torch.dtype | str, tokens: int, device: torch.device | str | int | None
) -> tuple[FLCEConfig, str] | None:
    """The tuned config for this problem, and where it came from; ``None`` means "use the heuristic".

    ``device`` is a torch device, a CUDA index, or a GPU name ("NVIDIA H200", "h200"). Order: user exact ->
    shipped exact -> nearest token bucket -> nearest (V, H) on the same GPU -> None; the other kinds of its
    family (``GPU_FAMILIES``) answer the same way, and the closest answer wins, the GPU's own among equally close
    ones (a borrowed answer's source ends "(borrowed from h200)"). The source string
    ("tuning_db:user_exact", ...) is also logged at debug level. Never raises: a problem is logged once and
    answered with None, so a bad DB can never break a training run.
    """
    match = find_match(vocab=vocab, hidden=hidden, dtype=dtype, tokens=tokens, device=device)
    return None if match is None else (match.config, match.source)


def _budget_match(entry: Entry, layer: str, bucket: int) -> Match:
    """The Match of one budget-tier entry; its source names the tier ("tuning_db:shipped_exact(budget 0.5 GiB)")."""
    tier = f"budget {entry.budget_tier_gb:g} GiB"
    if entry.tokens == bucket:
        return Match(entry.config, f"tuning_db:{layer}_exact({tier})", f"{layer} exact", entry)
    return Match(entry.config, f"tuning_db:nearest_tokens({layer} tokens={entry.tokens}, {tier})", "nearest bucket",
                 entry)


def _budget_matches_uncached(index: _Index, dev: str, vocab: int, hidden: int, dtype: str, bucket: int,
                             budget_gb: float) -> tuple[Match, ...]:
    """Tier entries of this (GPU, V, H, dtype) tuned under at most ``budget_gb``, most preferred first: nearest
    token bucket, then the largest tier (it had the most room), then the user layer, then the smaller bucket."""
    log_bucket = math.log2(bucket)
    fitting = [(e, layer) for e, layer in index.tiers.get((dev, vocab, hidden, dtype), [])
               if e.budget_tier_gb is not None and e.budget_tier_gb <= budget_gb]
    fitting.sort(key=lambda el: (abs(math.log2(el[0].tokens) - log_bucket), -(el[0].budget_tier_gb or 0.0),
                                 el[1] != "user", el[0].tokens))
    return tuple(_budget_match(e, layer, bucket) for e, layer in fitting)


def find_budget_matches(
    *, vocab: int, hidden: int, dtype: torch.dtype | str, tokens: int, device: torch.device | str | int | None,
    budget_gb: float,
) -> tuple[Match, ...]:
    """The budget-tier entries a call with ``memory_budget_gb=budget_gb`` may use, most preferred first.

    Only entries of the same GPU kind, V, H and dtype whose tier is at most ``budget_gb``: the exact token bucket
    before the nearest ones, and within a bucket the largest tier (tuned with the most room) first. The caller
    (``plan.choose``) takes the first whose memory bound at the real token count fits the budget. There is no
    nearest-shape fallback: a tier entry's config is only known to fit its own shape. A kind with none of its own
    within the budget takes those of the first kind of its family (``GPU_FAMILIES``, by name) that has some.
    Memoised like ``lookup``, and like it never raises (a problem is logged once and answered with no entries).
    """
    try:
        index = _get_index()
        bucket = token_bucket(int(tokens))
        memo_key = ("budget", device, vocab, hidden, dtype, bucket, float(budget_gb))
        hit = index.memo.get(memo_key, _MISS)
        if hit is not _MISS:
            return hit  # type: ignore[return-value]
        dev = device_key(device)
        shape = (int(vocab), int(hidden), normalize_dtype(dtype))
        matches = _budget_matches_uncached(index, dev, *shape, bucket, float(budget_gb))
        for kind in family_kinds(dev) if not matches else ():  # none of its own within the budget: its family's
            matches = tuple(_borrowed(m, kind) for m in
                            _budget_matches_uncached(index, kind, *shape, bucket, float(budget_gb)))
            if matches:
                break
        logger.debug("tuning DB: %d budget-tier entries within %g GiB for %s V=%d H=%d %s tokens=%d", len(matches),
                     budget_gb, dev, vocab, hidden, dtype, tokens)
        index.memo[memo_key] = matches  # type: ignore[assignment]
        return matches
    except Exception as exc:  # noqa: BLE001 - the DB must never break the op
        _warn_once("budget lookup", f"tuning DB budget lookup failed ({type(exc).__name__}: {exc}); using the "
                                    "plain lookup")
        return ()
