"""What ``sbatch --test-only`` says when it refuses a job, read into typed reasons and advice.

Pure text in, ``ProbeReason`` out. The message forms are those of Slurm 22.05 to 25.11:

* ``sbatch --test-only`` reports a refusal as ``allocation failure: <slurm_strerror>``
  and a real submission as ``sbatch: error: Batch job submission failed: <strerror>``
  (``src/sbatch/sbatch.c``); the strerror texts are ``src/common/slurm_errno.c``'s.
* When an association or QOS limit refuses the job, slurmctld names the limit (its
  job_state_reason string, e.g. ``QOSMaxGRESPerJob``) in the reply and the client prints it
  on an ``sbatch: error:`` line *before* the generic ``Job violates accounting/QOS policy
  (job submit limit, user's size and/or time limits)``. The named limit decides the
  reason; the generic line alone (no name) is ``policy``.

At submission Slurm checks the job *alone* against the limits, except for the counts of
submitted jobs, so: wall-clock and TRES-minutes limits mean a shorter walltime; node
limits a different node count; CPU, memory, GRES, billing and the rest a different shape;
job-count limits and throttles mean waiting; QOS and group permissions are account or
partition problems; an unreachable controller or database, socket timeouts, rate limiting
and disabled submissions mean trying later.

* A job_submit plugin that refuses a job answers with the same accounting-policy errno and
  its own text on an ``sbatch: error:`` line before it (job_submit/throttle:
  ``Reached jobs per hour limit``, in every version since 2.x): that text decides.
* With ``-M``/``SLURM_CLUSTERS`` sbatch asks slurmdbd for the cluster first; when slurmdbd
  does not answer it prints ``There is a problem talking to the database: <errno>.  Only
  local cluster communication is available, ...`` (``src/common/slurmdb_defs.c``; sacct's
  and sacctmgr's say ``Problem talking to the database``): trying later. (``'<name>' can't
  be reached now, or it is an invalid entry for --cluster`` may be a typo as well: left to
  a person.)
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping


class ProbeReason(enum.StrEnum):
    """Why a probe row is (not) usable."""

    OK = "ok"
    NO_SCHEDULER = "no_scheduler"
    TIME_LIMIT = "time_limit"  # walltime (or TRES-minutes) over a limit
    NODE_COUNT = "node_count"  # node count outside a limit
    NODE_CONFIG = "node_config"  # no node of the partition has what the shape asks
    SHAPE = "shape"  # GRES, memory, CPU, topology or another per-job resource limit
    PARTITION = "partition"
    ACCOUNT = "account"  # account, QOS, group or reservation permission
    WAIT = "wait"  # job-count limit or throttle: the same shape fits later
    TRY_LATER = "try_later"  # controller, database, rate limit, submissions disabled
    POLICY = "policy"  # an accounting/QOS limit Slurm did not name
    UNAVAILABLE = "unavailable"  # no sbatch to run
    TIMEOUT = "timeout"  # sbatch did not answer in time
    UNPARSED = "unparsed"


class Advice(enum.StrEnum):
    """What the planner does with a probe of each reason."""

    USE = "use"  # a candidate
    SHORTEN_WALLTIME = "shorten_walltime"  # skip the shape; a shorter walltime would fit
    RESIZE_NODES = "resize_nodes"  # skip the shape; another node count would fit
    RESHAPE = "reshape"  # skip the shape; it asks for resources the site does not give
    FIX_ACCESS = "fix_access"  # skip the shape; the account/partition/QOS is not allowed
    WAIT = "wait"  # skip the shape for now; it fits once jobs leave the queue
    TRY_LATER = "try_later"  # the probe says nothing; keep the newest informative one
    CHECK = "check"  # skip the shape; a person has to read the detail


ADVICE: Mapping[ProbeReason, Advice] = {
    ProbeReason.OK: Advice.USE,
    ProbeReason.NO_SCHEDULER: Advice.USE,
    ProbeReason.TIME_LIMIT: Advice.SHORTEN_WALLTIME,
    ProbeReason.NODE_COUNT: Advice.RESIZE_NODES,
    ProbeReason.NODE_CONFIG: Advice.RESHAPE,
    ProbeReason.SHAPE: Advice.RESHAPE,
    ProbeReason.PARTITION: Advice.FIX_ACCESS,
    ProbeReason.ACCOUNT: Advice.FIX_ACCESS,
    ProbeReason.WAIT: Advice.WAIT,
    ProbeReason.TRY_LATER: Advice.TRY_LATER,
    ProbeReason.TIMEOUT: Advice.TRY_LATER,
    ProbeReason.POLICY: Advice.CHECK,
    ProbeReason.UNAVAILABLE: Advice.CHECK,
    ProbeReason.UNPARSED: Advice.CHECK,
}


def advice_for(reason: str) -> Advice:
    """The advice for a reason as stored in a probe table (unknown names: ``check``)."""
    try:
        return ADVICE[ProbeReason(reason)]
    except ValueError:
        return Advice.CHECK


# ----------------------------------------------------------------------------- limit names

# job_state_reason strings sbatch prints on their own ``sbatch: error:`` line.
_LIMIT_NAME = re.compile(
    r"^(?:QOS|Assoc|Association|Partition|Max|JobArrayTask)[A-Za-z]*$"
    r"|^(?:InvalidAccount|InvalidQOS|AccountNotAllowed|AccountingPolicy)$"
)
# First match wins; order matters (``AssocMaxNodePerJobLimit`` is a node limit, not a job count).
_LIMIT_RULES: tuple[tuple[re.Pattern[str], ProbeReason], ...] = (
    (re.compile(r"Submit"), ProbeReason.WAIT),  # submitted-job counts include queued jobs
    (re.compile(r"Minutes|RunMins"), ProbeReason.TIME_LIMIT),  # TRES x walltime of the job
    (re.compile(r"Wall|TimeLimit$"), ProbeReason.TIME_LIMIT),
    (re.compile(r"(?<!Per)Node(?!s)"), ProbeReason.NODE_COUNT),  # not ...PerNode
    (
        re.compile(r"MaxJobs|GrpJobs|JobsPer|^(?:QOS|Association)JobLimit$|JobArrayTask"),
        ProbeReason.WAIT,
    ),
    (re.compile(r"UsageThreshold|MaxPoweredUpNodes"), ProbeReason.WAIT),
    (re.compile(r"NotAllowed|^Invalid(?:Account|QOS)$"), ProbeReason.ACCOUNT),
    (re.compile(r"^Partition(?:Down|Inactive)$"), ProbeReason.TRY_LATER),
    (re.compile(r"^AccountingPolicy$"), ProbeReason.POLICY),
)


def limit_reason(name: str) -> ProbeReason | None:
    """The reason for a Slurm limit name (``QOSMaxNodePerJobLimit``); None if not one."""
    if not _LIMIT_NAME.match(name):
        return None
    for pattern, reason in _LIMIT_RULES:
        if pattern.search(name):
            return reason
    return ProbeReason.SHAPE  # CPU, memory, GRES, billing, energy, licence, burst buffer


# ----------------------------------------------------------------------------- strerror texts

# slurm_errno.c texts (and sbatch.c's own retry messages), lower-cased substrings.
_ERRNO_TEXTS: tuple[tuple[ProbeReason, tuple[str, ...]], ...] = (
    (
        ProbeReason.TRY_LATER,
        (
            "unable to contact slurm controller",
            "rate limit exceeded",
            "socket timed out on send/recv operation",
            "zero bytes were transmitted or received",
            "communication connection failure",
            "message send failure",
            "message receive failure",
            "communication shutdown failure",
            "unable to connect to database",
            "database connection reference is invalid",
            "problem talking to the database",  # slurmdbd unreachable (-M, SLURM_CLUSTERS)
            "reached jobs per hour limit",  # job_submit/throttle: the same job fits later
            "system submissions disabled",
            "requested operation is presently disabled",
            "backup controller in standby mode",
            "controller is in standby mode",
            "unable to create job record, try again",
            "job creation temporarily disabled",
            "slurm temporarily unable to accept job",
            "slurm job queue full",
            "required ports are in use",
            "required partition not available (inactive or drain)",
            "partition in down state",
            "individual job submission scheduling attempts deferred",
            "resource temporarily unavailable",
            "protocol authentication error",
            "invalid authentication credential",
            "authentication credential expired",
        ),
    ),
    (
        ProbeReason.WAIT,
        (
            "breached requested qos usage threshold",
            "max powered up nodes reached",
            "licenses currently unavailable",
            "job can not start due to maintenance reservation",
        ),
    ),
    (ProbeReason.POLICY, ("job violates accounting/qos policy",)),
    (
        ProbeReason.TIME_LIMIT,
        (
            "requested time limit is invalid",
            "invalid time-min specification",
            "time limit specification required",
        ),
    ),
    (ProbeReason.NODE_COUNT, ("node count specification invalid",)),
    (ProbeReason.NODE_CONFIG, ("requested node configuration is not available",)),
    (
        ProbeReason.SHAPE,
        (
            "requested topology configuration is not available",
            "requested partition configuration not available",
            "generic resource (gres) specification",
            "invalid gres specification",
            "requested gres option unsupported",
            "insufficient gres available",
            "memory required by task is not available",
            "more processors requested than permitted",
            "cpu count specification invalid",
            "task count specification invalid",
            "task distribution specification invalid",
            "more threads per core than the job allocation",
            "invalid feature specification",
            "invalid trackable resource (tres) specification",
            "job size specification needs to be provided",
            "restrictedcorespergpu",
        ),
    ),
    (
        ProbeReason.PARTITION,
        (
            "invalid partition name specified",
            "invalid partition specified",
            "no partition specified or system default partition",
        ),
    ),
    (
        ProbeReason.ACCOUNT,
        (
            "invalid account or account/partition combination",
            "access/permission denied",
            "group not permitted to use this partition",
            "invalid qos specification",
            "invalid or unknown association",
            "invalid wckey specification",
            "access denied to requested reservation",
        ),
    ),
)
# The line that carries sbatch's errno: --test-only's and a real submission's.
_ERRNO_LINE = re.compile(r"(?:allocation failure|Batch job submission failed):\s*(?P<msg>.+)$")
_ERROR_LINE = re.compile(r"^\s*\S+:\s+error:\s+(?P<msg>.+?)\s*$")
_LAST_RESORT: tuple[tuple[re.Pattern[str], ProbeReason], ...] = (
    (re.compile(r"\btime limit\b", re.I), ProbeReason.TIME_LIMIT),
    (re.compile(r"\baccount\b", re.I), ProbeReason.ACCOUNT),
)


def errno_reason(message: str) -> ProbeReason | None:
    """The reason for one strerror text (``Node count specification invalid``)."""
    low = message.lower()
    for reason, texts in _ERRNO_TEXTS:
        if any(t in low for t in texts):
            return reason
    return None


def named_limits(text: str) -> list[str]:
    """Limit names printed alone on ``<prog>: error:`` lines, in order."""
    out = []
    for line in text.splitlines():
        m = _ERROR_LINE.match(line)
        if m and _LIMIT_NAME.match(m.group("msg")):
            out.append(m.group("msg"))
    return out


def plugin_reason(text: str) -> ProbeReason | None:
    """The reason a job_submit plugin gave on its own ``<prog>: error:`` line before
    Slurm's generic accounting-policy refusal (the plugins answer with that errno and their
    own text: job_submit/throttle's ``Reached jobs per hour limit``); None if none is known."""
    for line in text.splitlines():
        m = _ERROR_LINE.match(line)
        if m and not _ERRNO_LINE.search(line):
            reason = errno_reason(m.group("msg"))
            if reason is not None and reason is not ProbeReason.POLICY:
                return reason
    return None


def classify_failure(text: str) -> ProbeReason:
    """The reason for a refused ``sbatch --test-only`` from everything it printed.

    The errno line decides; when it is the generic accounting-policy text, the limit Slurm
    named before it decides. Without an errno line, named limits, then any known strerror
    text anywhere, then loose words; ``unparsed`` when nothing is recognised.
    """
    errno_lines = [m.group("msg") for ln in text.splitlines() if (m := _ERRNO_LINE.search(ln))]
    names = named_limits(text)
    named = next((r for n in names if (r := limit_reason(n)) is not None), None)
    if errno_lines:
        reason = errno_reason(errno_lines[-1])
        if reason is ProbeReason.POLICY:
            return named or plugin_reason(text) or ProbeReason.POLICY
        if reason is not None:
            return reason
    if named is not None:
        return named
    reason = errno_reason(text)
    if reason is not None:
        return reason
    for pattern, loose in _LAST_RESORT:
        if pattern.search(text):
            return loose
    return ProbeReason.UNPARSED
