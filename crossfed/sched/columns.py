"""The probe table's columns, importable without pandas (a closed round's empty table)."""

PROBE_COLUMNS = (
    "probed_at",
    "site",
    "shape",
    "partition",
    "nodes",
    "gpus_per_node",
    "walltime_s",
    "ok",
    "reason",
    "detail",
    "est_start",
    "wait_s",
    "job_id",
)
