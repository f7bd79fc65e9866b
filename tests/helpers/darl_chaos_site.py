"""A lightweight DARL site process for the chaos tests: real HTTP and real files, no model.

It registers, leases, "trains" by sleeping per block with a heartbeat after each one (so a
steal is learnt before the next block starts), checkpoints (a delta file plus pending.json,
both fsynced) and only then submits the delta, which commits the blocks. A restarted process
first resends a checkpointed but unconfirmed delta. Everything it does goes to journal.jsonl
so the test can check coverage against what each site really trained.

Run: python tests/helpers/darl_chaos_site.py --url URL --token-file F --site NAME --work DIR
--digest HEX --delta PATH [--per-block S] [--want N] [--die before_checkpoint|after_checkpoint]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

RETRY_STATUS = {500, 502, 503, 504}


class Refused(Exception):
    """A 4xx answer; ``code`` is the coordinator's error word."""

    def __init__(self, status: int, code: str) -> None:
        super().__init__(f"{status} {code}")
        self.status, self.code = status, code


class Client:
    """Short requests with retries on transport errors and 5xx, like the real client."""

    def __init__(self, url: str, token: str, timeout_s: float, budget_s: float) -> None:
        self.http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s
        )
        self.budget_s = budget_s

    def call(self, method: str, path: str, **kwargs: Any) -> dict:
        deadline = time.monotonic() + self.budget_s
        delay = 0.1
        while True:
            try:
                response = self.http.request(method, path, **kwargs)
            except httpx.TransportError:
                response = None
            if response is not None and response.status_code < 400:
                return response.json()
            if response is not None and response.status_code not in RETRY_STATUS:
                try:
                    code = str(response.json().get("error", "error"))
                except ValueError:
                    code = "error"
                raise Refused(response.status_code, code)
            if time.monotonic() + delay > deadline:
                raise SystemExit(f"coordinator unreachable for {self.budget_s}s: {method} {path}")
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 1.0)


class Site:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.name = args.site
        self.work = Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        token = Path(args.token_file).read_text().strip()
        self.client = Client(args.url, token, args.timeout, args.budget)
        self.delta = Path(args.delta).read_bytes()
        self.journal_file = open(self.work / "journal.jsonl", "a")  # noqa: SIM115
        self.pending = self.work / "pending.json"

    def journal(self, event: str, **fields: Any) -> None:
        fields |= {"ev": event, "site": self.name, "pid": os.getpid(), "t": time.time()}
        self.journal_file.write(json.dumps(fields) + "\n")
        self.journal_file.flush()

    def die(self, where: str) -> None:
        self.journal("die", where=where)
        os.kill(os.getpid(), signal.SIGKILL)

    # ------------------------------------------------------------------ protocol
    def register(self) -> dict:
        body = {"digest": self.args.digest, "ranks": 1, "rtt_ms": 1.0}
        return self.client.call("POST", f"/v1/sites/{self.name}/register", json=body)

    def lease(self, round_no: int) -> dict | None:
        body = {
            "site": self.name,
            "round": round_no,
            "n_blocks": self.args.want,
            "t_step_s": self.args.per_block,
            "rtt_ms": 1.0,
        }
        try:
            return self.client.call("POST", "/v1/leases", json=body)["lease"]
        except Refused as exc:
            expected = ("round_closed", "round_not_open", "already_contributed", "already_holding")
            if exc.code not in expected:
                raise
            self.journal("no_lease", code=exc.code, round=round_no)
            return None

    def train(self, lease: dict) -> int | None:
        """Blocks trained (a prefix of the lease, never past a steal), or None if lost."""
        allowed, consumed, echo, received = lease["n_blocks"], 0, None, 0.0
        while consumed < allowed:
            time.sleep(self.args.per_block)
            consumed += 1
            body = {"site": self.name, "consumed": consumed, "t_step_s": self.args.per_block}
            if echo is not None:
                body |= {"echo": echo, "echo_held_s": time.perf_counter() - received}
            try:
                reply = self.client.call(
                    "POST", f"/v1/leases/{lease['lease_id']}/heartbeat", json=body
                )
            except Refused as exc:
                self.journal("lost", lease_id=lease["lease_id"], code=exc.code)
                return None
            echo, received = reply.get("echo"), time.perf_counter()
            if reply["lease"]["n_blocks"] < allowed:
                self.journal(
                    "stolen_from", lease_id=lease["lease_id"], now=reply["lease"]["n_blocks"]
                )
            allowed = reply["lease"]["n_blocks"]
            if consumed > allowed:  # the protocol promises this never happens
                self.journal("overrun", lease_id=lease["lease_id"], consumed=consumed)
            if reply["round"] != lease["round"]:  # the round closed: the delta would be stale
                self.journal("abandon", lease_id=lease["lease_id"])
                self.client.call(
                    "POST", f"/v1/leases/{lease['lease_id']}/release", json={"site": self.name}
                )
                return None
        return consumed

    def checkpoint(self, lease: dict, generation: int, consumed: int) -> dict:
        """The delta and the pending record, durable before anything is sent."""
        data = bytearray(self.delta)
        lid = lease["lease_id"]  # the last two bf16 values: small, and distinct per lease
        data[-4:] = bytes([lid & 0xFF, 0x3C, (lid >> 8) & 0xFF, 0x3C])
        path = self.work / f"delta-{lease['lease_id']}.safetensors"
        with open(path, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        pending = {
            "lease_id": lease["lease_id"],
            "round": lease["round"],
            "epoch": lease["epoch"],
            "generation": generation,
            "consumed": consumed,
            "blocks": lease["blocks"][:consumed],
            "delta": str(path),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        tmp = self.pending.with_suffix(".tmp")
        with open(tmp, "w") as handle:
            handle.write(json.dumps(pending))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.pending)
        self.journal("checkpoint", **{k: pending[k] for k in ("lease_id", "epoch", "blocks")})
        return pending

    def send(self, pending: dict) -> None:
        params = {
            "site": self.name,
            "lease_id": pending["lease_id"],
            "generation": pending["generation"],
            "tokens": 1000 * pending["consumed"],
            "steps": pending["consumed"],
            "consumed": pending["consumed"],
        }
        try:
            reply = self.client.call(
                "POST",
                f"/v1/rounds/{pending['round']}/deltas/inline",
                params=params,
                content=Path(pending["delta"]).read_bytes(),
                headers={"X-Content-SHA256": pending["sha256"]},
            )
            self.journal(
                "commit",
                lease_id=pending["lease_id"],
                epoch=pending["epoch"],
                blocks=pending["blocks"],
                already=reply.get("already", False),
            )
        except Refused as exc:
            self.journal("rejected", lease_id=pending["lease_id"], code=exc.code)
        self.pending.unlink(missing_ok=True)
        Path(pending["delta"]).unlink(missing_ok=True)

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        self.journal("start")
        if self.pending.exists():
            pending = json.loads(self.pending.read_text())
            self.journal("resend", lease_id=pending["lease_id"])
            self.send(pending)
            if self.args.once:
                return 0
        while True:
            joined = self.register()
            if joined["epoch"] >= self.args.stop_epoch:
                self.journal("done", epoch=joined["epoch"])
                return 0
            lease = self.lease(joined["round"])
            if lease is None:
                time.sleep(0.2 + 0.3 * random.random())
                continue
            self.journal("lease", lease_id=lease["lease_id"], blocks=lease["blocks"])
            consumed = self.train(lease)
            if not consumed:
                continue
            if self.args.die == "before_checkpoint":
                self.die("before_checkpoint")
            pending = self.checkpoint(lease, joined["generation"], consumed)
            if self.args.die == "after_checkpoint":
                self.die("after_checkpoint")
            self.send(pending)
            if self.args.once:
                return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--token-file", required=True)
    parser.add_argument("--site", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--digest", required=True)
    parser.add_argument("--delta", required=True, help="a valid bf16 delta (safetensors)")
    parser.add_argument("--per-block", type=float, default=0.05, help="seconds per block")
    parser.add_argument("--want", type=int, default=4, help="blocks per inner phase")
    parser.add_argument("--die", choices=["before_checkpoint", "after_checkpoint"])
    parser.add_argument("--once", action="store_true", help="stop after one delta or resend")
    parser.add_argument("--stop-epoch", type=int, default=1, help="leave once this epoch runs")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per request")
    parser.add_argument("--budget", type=float, default=120.0, help="retry budget, seconds")
    return Site(parser.parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
