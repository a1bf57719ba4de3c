"""Tuning records per target device (DESIGN §6): committed JSON-lines stores under `records/` and the code
that keys, reads, writes and checks them.

    store = CacheStore()                                  # $K31C_TUNING_CACHE or records/<device>.jsonl
    config, status = store.lookup(template, template.bucket(key), live)   # status.outcome: hit|soft|miss
    store.put(make_record(template, bucket, config, median_us=.., spread_us=.., trials=.., created_by=..))
    policy = MissPolicy("readonly" | "fallback" | "tune", store, target="h200", artifact="build/x")
    config = policy.config(template, key)                 # raises TuningMiss under readonly
"""

from .policy import MODES, MissPolicy, TuningMiss, bucket_id, tune_command
from .records import (ENV_VAR, KEYED_FIELDS, CacheStore, Environment, LookupStatus, RecordError, TuningRecord,
                      default_store_path, device_slug, expected_key, make_record, record_key)

__all__ = ["MODES", "MissPolicy", "TuningMiss", "bucket_id", "tune_command", "ENV_VAR", "KEYED_FIELDS",
           "CacheStore", "Environment", "LookupStatus", "RecordError", "TuningRecord", "default_store_path",
           "device_slug", "expected_key", "make_record", "record_key"]
