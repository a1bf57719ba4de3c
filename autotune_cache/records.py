"""Tuning records: schema, canonical key, and the JSON-lines store (DESIGN §6).

One record per line, a self-describing JSON object:

    schema          1
    family          kernel template family ("gemm")
    template_sha256 sha256 of the code the template runs: its module and the kernel-backend modules it reaches,
                    docstrings and comments left out (`KernelTemplate.code()`)
    k31c_version    "0.1.0"
    triton, tvm, cuda  toolchain versions (null when absent)
    device, arch    device name and compute capability ("9.0"), gfx arch ("gfx950") or "cpu"
    bucket          the shape bucket, `template.bucket(key_dims)` (dict)
    config          the tuned config (dict)
    median_us, spread_us, trials   the measurement (spread = max - min of the finalists' repeats)
    created_by      the command that produced it; created_at  ISO-8601 UTC time
    key             sha256 of the canonical JSON of exactly the KEYED_FIELDS

canonical JSON = `json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)`, so the
key changes when any keyed field changes and never when a measurement or the provenance does.

Matching a record against the live machine (`match_problems`):
  hard (record rejected): template source, family, bucket, device, arch, the major.minor of the
      template backend's compiler (triton for triton templates, tvm for tvm ones), CUDA major,
      k31c major.minor;
  soft (record used, mismatch reported): k31c patch, CUDA minor, compiler patch, the other backend's
      compiler version.

Writes take an exclusive `flock` on a sibling lock file `.<name>.lock`, write the whole new file to a
temporary file in the same directory, fsync it and `os.replace` it over the store, so a reader sees
either the old or the new file and concurrent writers never interleave.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields

SCHEMA_VERSION = 1
KEYED_FIELDS = ("family", "template_sha256", "k31c_version", "triton", "tvm", "cuda", "device", "arch", "bucket")
ENV_VAR = "K31C_TUNING_CACHE"
RECORDS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "records")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class RecordError(ValueError):
    """A line or record that is not a valid tuning record; the message says which field and why."""


def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def template_sha256(template) -> str:
    return sha256_text(template.code())


def device_slug(device: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200'; the store file name of a device."""
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "unknown"


def _major_minor(v: str | None) -> tuple:
    return tuple(re.findall(r"\d+", v or "")[:2]) if v else ()


# ---- the live environment ---------------------------------------------------------------------
@dataclass(frozen=True)
class Environment:
    """What a record must match: device, arch and toolchain versions of the machine that serves."""
    device: str
    arch: str
    k31c_version: str
    triton: str | None = None
    tvm: str | None = None
    cuda: str | None = None

    @property
    def slug(self) -> str:
        return device_slug(self.device)

    @classmethod
    def from_live(cls, live: dict) -> "Environment":
        """From `k31c.artifact.live_machine()` (optionally with an "arch" key, e.g. a gfx arch)."""
        tc = live.get("toolchain", {})
        arch = live.get("arch") or live.get("capability") or "cpu"
        return cls(device=live.get("device", "cpu"), arch=str(arch), k31c_version=tc.get("k31c", "unknown"),
                   triton=tc.get("triton"), tvm=tc.get("tvm"), cuda=tc.get("cuda") or tc.get("hip"))

    @classmethod
    def current(cls) -> "Environment":
        from k31c.artifact import live_machine
        live = live_machine()
        try:
            import torch

            if getattr(torch.version, "hip", None) and torch.cuda.is_available():
                live["arch"] = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
        except ImportError:
            pass
        return cls.from_live(live)

    @classmethod
    def coerce(cls, live) -> "Environment":
        """None -> the current machine; a `live_machine()` dict -> converted; an Environment -> itself."""
        return cls.current() if live is None else live if isinstance(live, Environment) else cls.from_live(live)


# ---- the record -------------------------------------------------------------------------------
@dataclass(frozen=True)
class TuningRecord:
    family: str
    template_sha256: str
    k31c_version: str
    triton: str | None
    tvm: str | None
    cuda: str | None
    device: str
    arch: str
    bucket: dict
    config: dict
    median_us: float
    spread_us: float
    trials: int
    created_by: str
    created_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    schema: int = SCHEMA_VERSION

    @property
    def key(self) -> str:
        return record_key({f: getattr(self, f) for f in KEYED_FIELDS})

    def to_json(self) -> dict:
        return {**asdict(self), "key": self.key}

    def to_line(self) -> str:
        return canonical_json(self.to_json())

    @classmethod
    def from_json(cls, obj) -> "TuningRecord":
        """Validate one parsed line; raises RecordError naming every problem found."""
        if not isinstance(obj, dict):
            raise RecordError(f"expected a JSON object, found {type(obj).__name__}")
        names = [f.name for f in fields(cls)] + ["key"]
        problems = [f"missing field {n!r}" for n in names if n not in obj]
        problems += [f"unknown field {n!r}" for n in sorted(set(obj) - set(names))]
        if problems:
            raise RecordError("; ".join(problems))
        problems += _type_problems(obj)
        if problems:
            raise RecordError("; ".join(problems))
        rec = cls(**{n: obj[n] for n in names if n != "key"})
        if rec.key != obj["key"]:
            raise RecordError(f"key {obj['key'][:12]}… does not match the content (expected {rec.key[:12]}…): "
                              "the record was edited or corrupted")
        return rec


def record_key(keyed: dict) -> str:
    """sha256 of the canonical JSON of exactly the keyed fields."""
    missing = [f for f in KEYED_FIELDS if f not in keyed]
    if missing:
        raise RecordError(f"cannot key a record without {missing}")
    return sha256_text(canonical_json({f: keyed[f] for f in KEYED_FIELDS}))


def expected_key(template, bucket: dict, env: Environment) -> str:
    """The key a record for (template, bucket) measured on `env` has."""
    return record_key({"family": template.family, "template_sha256": template_sha256(template),
                       "k31c_version": env.k31c_version, "triton": env.triton, "tvm": env.tvm,
                       "cuda": env.cuda, "device": env.device, "arch": env.arch, "bucket": dict(bucket)})


def make_record(template, bucket: dict, config: dict, *, median_us: float, spread_us: float, trials: int,
                created_by: str, live=None) -> TuningRecord:
    env = Environment.coerce(live)
    rec = TuningRecord(family=template.family, template_sha256=template_sha256(template),
                       k31c_version=env.k31c_version, triton=env.triton, tvm=env.tvm, cuda=env.cuda,
                       device=env.device, arch=env.arch, bucket=dict(bucket), config=dict(config),
                       median_us=float(median_us), spread_us=float(spread_us), trials=int(trials),
                       created_by=created_by)
    TuningRecord.from_json(json.loads(rec.to_line()))  # same validation as reading it back
    return rec


def _type_problems(obj: dict) -> list[str]:
    def is_num(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")

    text, hex64, version = ((lambda x: isinstance(x, str) and x, "a non-empty string"),
                            (lambda x: isinstance(x, str) and _HEX64.match(x), "64 lowercase hex digits"),
                            (lambda x: x is None or isinstance(x, str), "a version string or null"))
    checks = {"schema": (lambda x: x == SCHEMA_VERSION, f"schema version {SCHEMA_VERSION}"),
              "template_sha256": hex64, "key": hex64, "triton": version, "tvm": version, "cuda": version,
              **{n: text for n in ("family", "k31c_version", "device", "arch", "created_by", "created_at")},
              "bucket": (lambda x: isinstance(x, dict) and all(isinstance(v, (int, str)) for v in x.values()),
                         "an object of int/str dims"),
              "config": (lambda x: isinstance(x, dict) and x and all(isinstance(v, (int, float, str, bool))
                                                                     for v in x.values()), "a non-empty object of scalars"),
              "median_us": (lambda x: is_num(x) and x > 0, "a positive number"),
              "spread_us": (lambda x: is_num(x) and x >= 0, "a non-negative number"),
              "trials": (lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 1, "an integer >= 1")}
    return [f"field {n!r} must be {want}, found {obj[n]!r}" for n, (ok, want) in checks.items() if not ok(obj[n])]


def match_problems(rec: TuningRecord, template_sha: str, backend: str, env: Environment) -> tuple[list, list]:
    """(hard, soft) mismatches of a record against the live template source and environment."""
    hard, soft = [], []
    if rec.template_sha256 != template_sha:
        hard.append(f"template source changed (record {rec.template_sha256[:12]}…, code {template_sha[:12]}…)")
    if (rec.device, rec.arch) != (env.device, env.arch):
        hard.append(f"measured on {rec.device} ({rec.arch}), this machine is {env.device} ({env.arch})")
    for tool in ("triton", "tvm"):
        have, want = getattr(rec, tool), getattr(env, tool)
        if have == want:
            continue
        msg = f"{tool} {have} in the record, {want} here"
        (hard if tool == backend and _major_minor(have) != _major_minor(want) else soft).append(msg)
    if rec.cuda != env.cuda:
        cuda_major_differs = _major_minor(rec.cuda)[:1] != _major_minor(env.cuda)[:1]
        (hard if cuda_major_differs else soft).append(f"cuda {rec.cuda} in the record, {env.cuda} here")
    if rec.k31c_version != env.k31c_version:
        hard_v = _major_minor(rec.k31c_version) != _major_minor(env.k31c_version)
        (hard if hard_v else soft).append(f"k31c {rec.k31c_version} in the record, {env.k31c_version} here")
    return hard, soft


# ---- reading ----------------------------------------------------------------------------------
@dataclass
class Line:
    """One line of a store file: a valid record, or the reason it is not one."""
    lineno: int
    text: str
    record: TuningRecord | None = None
    error: str | None = None


def parse_lines(text: str) -> list[Line]:
    out = []
    for i, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            out.append(Line(i, raw, error=f"not valid JSON ({e.msg} at column {e.colno})"))
            continue
        try:
            out.append(Line(i, raw, record=TuningRecord.from_json(obj)))
        except RecordError as e:
            out.append(Line(i, raw, error=str(e)))
    return out


def default_store_path(live=None) -> str:
    """$K31C_TUNING_CACHE (a file, or a directory holding <device-slug>.jsonl), else
    autotune_cache/records/<device-slug>.jsonl."""
    slug = Environment.coerce(live).slug
    override = os.environ.get(ENV_VAR)
    if override:
        return os.path.join(override, f"{slug}.jsonl") if os.path.isdir(override) else override
    return os.path.join(RECORDS_DIR, f"{slug}.jsonl")


# ---- the store --------------------------------------------------------------------------------
@dataclass
class LookupStatus:
    """How a lookup was answered: outcome 'hit' (exact key), 'soft' (usable record with reported
    mismatches) or 'miss'; notes say why records were rejected or what was soft."""
    outcome: str
    key: str
    record: TuningRecord | None = None
    notes: list = field(default_factory=list)

    def __str__(self):
        return self.outcome + (": " + "; ".join(self.notes) if self.notes else "")


class CacheStore:
    def __init__(self, path: str | None = None):
        self.path = os.path.abspath(path or default_store_path())
        self._stamp = None
        self._lines: list[Line] = []
        self._by_bucket: dict = {}

    # -- reading
    def lines(self) -> list[Line]:
        """Every non-empty line, parsed and validated (re-read when the file changed)."""
        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp != self._stamp:
            text = ""
            if stamp is not None:
                with open(self.path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
            self._lines, self._stamp = parse_lines(text), stamp
            self._by_bucket = defaultdict(list)
            for ln in self._lines:
                if ln.record is not None:
                    self._by_bucket[(ln.record.family, canonical_json(ln.record.bucket))].append(ln.record)
        return self._lines

    def records(self) -> list[TuningRecord]:
        return [ln.record for ln in self.lines() if ln.record is not None]

    def lookup(self, template, bucket: dict, live=None) -> tuple[dict | None, LookupStatus]:
        """The config of the newest usable record for (template, bucket) on `live`, and how it was found."""
        env = Environment.coerce(live)
        sha = template_sha256(template)  # not cached by id(): ids of collected templates are reused
        key = expected_key(template, bucket, env)
        self.lines()
        candidates = self._by_bucket.get((template.family, canonical_json(dict(bucket))), [])
        exact = [r for r in candidates if r.key == key]
        if exact:
            rec = newest(exact)
            return dict(rec.config), LookupStatus("hit", key, rec)
        usable, notes = [], []
        for r in candidates:
            hard, soft = match_problems(r, sha, template.backend, env)
            if hard:
                notes.append(f"record {r.key[:12]}… rejected: " + "; ".join(hard))
            else:
                usable.append((r, soft))
        if usable:
            rec, soft = max(reversed(usable), key=lambda rs: rs[0].created_at)
            return dict(rec.config), LookupStatus("soft", key, rec, [f"record {rec.key[:12]}… used despite: "
                                                                    + "; ".join(soft)] + notes)
        if not candidates:
            notes.append(f"no record for this bucket in {self.path}")
        return None, LookupStatus("miss", key, None, notes)

    # -- writing
    def put(self, record: TuningRecord) -> str:
        """Append one record (atomically, under the store's lock); returns its key."""
        self.put_many([record])
        return record.key

    def put_many(self, records: list[TuningRecord]) -> None:
        for r in records:
            TuningRecord.from_json(r.to_json())
        self.rewrite(lambda old: [ln for ln in old if ln.strip()] + [r.to_line() for r in records])

    def rewrite(self, edit) -> None:
        """Under the exclusive lock: `edit(raw lines, blanks included) -> lines`, then replace the file atomically."""
        d = os.path.dirname(self.path)
        os.makedirs(d, exist_ok=True)
        lock_path = os.path.join(d, f".{os.path.basename(self.path)}.lock")
        with open(lock_path, "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                try:
                    with open(self.path, encoding="utf-8", errors="replace") as f:
                        old = f.read().splitlines()
                except FileNotFoundError:
                    old = []
                lines = edit(old)
                fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{os.path.basename(self.path)}.", suffix=".tmp")
                try:
                    with os.fdopen(fd, "w", encoding="utf-8") as f:
                        f.write("".join(ln + "\n" for ln in lines))
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, self.path)
                except BaseException:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
                    raise
                _fsync_dir(d)
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
        self._stamp = None


IN_GRAPH_MARKS = ("--in-graph", "--sections graph_tune")  # in created_by: a config chosen by timing the whole step


def chosen_in_graph(record: TuningRecord | None) -> bool:
    """Whether the record's config was chosen inside the decode step (`k31c tune --in-graph`,
    autotune_cache/graph_tune.py): the kernel-alone tuner leaves such buckets alone."""
    return record is not None and any(m in record.created_by for m in IN_GRAPH_MARKS)


def newest(records: list[TuningRecord]) -> TuningRecord:
    """The most recently created record (the later one in the file on a tie)."""
    return max(reversed(records), key=lambda r: r.created_at)


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
