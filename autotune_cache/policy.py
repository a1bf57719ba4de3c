"""Miss policy: what happens when no usable tuning record exists for a kernel and shape bucket.

    readonly  (deploy default) a miss raises `TuningMiss`, naming the kernel, the bucket, the store and
              the exact `k31c tune` command that produces the record;
    fallback  the template's declared heuristic config; every launch that used it is counted in `misses`
              (per bucket id, shown by `k31c explain` / `Executor.stats()`);
    tune      calls the tuner hook `tuner(template, key_dims, bucket, env) -> TuningRecord`, stores the
              record in the cache and uses its config.

Records found with soft mismatches (k31c patch, CUDA minor, ...) are used; their notes are kept in
`soft` so the caller can report them. Resolutions are memoised per bucket id; counters count launches.
"""

from __future__ import annotations

import json
import shlex
from collections import Counter
from typing import Callable

from .records import CacheStore, Environment, TuningRecord, canonical_json

MODES = ("readonly", "fallback", "tune")


def bucket_id(family: str, bucket: dict) -> str:
    """'gemm:{"K": 64, "N": 128}' (the executor and the artifact's configs.json key buckets this way)."""
    return family + ":" + json.dumps(dict(bucket), sort_keys=True)


def tune_command(family: str, bucket: dict, *, artifact: str | None = None, target: str | None = None) -> str:
    """The command that tunes exactly this kernel and bucket on the machine it is run on."""
    what = shlex.quote(artifact) if artifact else f"--target {shlex.quote(target or 'THIS_TARGET')}"
    return f"k31c tune {what} --kernel {shlex.quote(family)} --bucket {shlex.quote(canonical_json(dict(bucket)))}"


class TuningMiss(LookupError):
    """No usable tuning record under the readonly policy; the message says how to produce one."""

    def __init__(self, family: str, bucket: dict, command: str, store_path: str, env: Environment, notes: list):
        self.family, self.bucket, self.command = family, dict(bucket), command
        detail = "".join(f"\n  - {n}" for n in notes)
        super().__init__(
            f"no tuning record for kernel {family} bucket {canonical_json(dict(bucket))} on {env.device} "
            f"({env.arch}) in {store_path}{detail}\n"
            f"tune it on this machine:  {command}\n"
            f"or accept the declared heuristic config with the 'fallback' miss policy")


class MissPolicy:
    """Resolves a kernel's config for a shape: tuning store first, then the mode's answer to a miss."""

    def __init__(self, mode: str = "readonly", store: CacheStore | None = None, *, live=None,
                 target: str = "cpu", artifact: str | None = None, tuner: Callable | None = None):
        if mode not in MODES:
            raise ValueError(f"miss policy {mode!r}: expected one of {', '.join(MODES)}")
        if mode == "tune" and tuner is None:
            raise ValueError("miss policy 'tune' needs a tuner hook: tuner(template, key, bucket, env) -> TuningRecord")
        self.mode, self.target, self.artifact, self.tuner = mode, target, artifact, tuner
        self.store = store if store is not None else CacheStore()
        self.env = Environment.coerce(live)
        self.misses: Counter = Counter()  # bucket id -> launches that used the heuristic
        self.hits: Counter = Counter()  # bucket id -> launches that used a record
        self.tuned: Counter = Counter()  # bucket id -> records produced by the tuner hook
        self.soft: dict[str, list] = {}  # bucket id -> soft-mismatch notes of the record used
        self._resolved: dict[str, tuple[dict, bool]] = {}

    def config(self, template, key: dict) -> dict:
        """The config to launch `template` with on shape `key` (its key_dims)."""
        bucket = template.bucket(key)
        bid = bucket_id(template.family, bucket)
        if bid not in self._resolved:
            self._resolved[bid] = self._resolve(template, key, bucket, bid)
        config, from_record = self._resolved[bid]
        (self.hits if from_record else self.misses)[bid] += 1
        return dict(config)

    def forget(self) -> None:
        """Resolve every bucket again at its next launch (after a template's heuristic or the store changed)."""
        self._resolved.clear()

    def _resolve(self, template, key: dict, bucket: dict, bid: str) -> tuple[dict, bool]:
        config, status = self.store.lookup(template, bucket, self.env)
        if config is not None:
            if status.outcome == "soft":
                self.soft[bid] = list(status.notes)
            return config, True
        if self.mode == "fallback":
            return template.heuristic(key, self.target), False
        if self.mode == "tune":
            rec = self.tuner(template, key, bucket, self.env)
            if not isinstance(rec, TuningRecord):
                raise TypeError(f"tuner hook returned {type(rec).__name__} for {bid}, expected a TuningRecord")
            if rec.family != template.family or canonical_json(rec.bucket) != canonical_json(dict(bucket)):
                raise ValueError(f"tuner hook returned a record for {bucket_id(rec.family, rec.bucket)}, "
                                 f"asked for {bid}")
            self.store.put(rec)
            self.tuned[bid] += 1
            return dict(rec.config), True
        cmd = tune_command(template.family, bucket, artifact=self.artifact, target=self.target)
        raise TuningMiss(template.family, bucket, cmd, self.store.path, self.env, status.notes)

    def stats(self) -> dict:
        return {"policy": self.mode, "store": self.store.path, "record_launches": dict(self.hits),
                "config_misses": dict(self.misses), "tuned": dict(self.tuned), "soft_mismatches": dict(self.soft)}
