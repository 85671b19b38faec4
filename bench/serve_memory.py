"""Server RSS against the number of samplers a session holds (issue 52: samplers must be bounded in memory).

    python bench/serve_memory.py [--ranks 8,64] [--counts 1,2,4,8,16] [--base-model ...]

Starts `python -m trainer.serve` on 127.0.0.1 with its default flags (a fresh state dir), then per LoRA rank,
under a key and session of its own: creates a training client of SmolLM2-135M-Instruct (the model
`trainer.model_registry` builds into ~/.cache/pairedrl/models), and makes snapshot samplers one at a time
(`save_weights_for_sampler` without a path: what `save_weights_and_get_sampling_client` sends, once per RL
step), each answering one 1-sample, 4-token request as an RL loop's sampler would. With the training
client alone and at each count in `--counts` it prints the server's RSS (its `/proc/<pid>/status` VmRSS)
and what `/stats` `memory` reports (peak RSS, live snapshots, their adapter MiB, merged sampler weight sets
cached). After the last count the session is finished and the RSS read again: what its end gave back.
`--counts` must stay within `--max-samplers-per-session` (16 by default) so that no sampler is retired.

RSS is a size, not a time: the figures do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import httpx
from tinker import types

from trainer.model_registry import SMOLLM2

POLL_LIMIT_S = 600.0  # one request's result; past it the bench stops with an error


class Client:
    """One key's raw HTTP view of the server: its session and its requests' results."""

    def __init__(self, url: str, key: str):
        self.http = httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": key}, timeout=60)
        self.session = self.ok("create_session", types.CreateSessionRequest(
            sdk_version="bench", tags=[], user_metadata=None))["session_id"]

    def ok(self, endpoint: str, body: object) -> dict:
        r = self.http.post("/" + endpoint, json=body.model_dump(mode="json") if hasattr(body, "model_dump")
                           else body)
        if r.status_code != 200:
            raise SystemExit(f"error: {endpoint} answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def result(self, request_id: str) -> httpx.Response:
        t = time.monotonic()
        while time.monotonic() - t < POLL_LIMIT_S:
            r = self.http.post("/retrieve_future", json={"request_id": request_id})
            if r.headers["content-type"].startswith("application/x-protobuf"):
                return r
            body = r.json()
            if r.status_code != 200 or "error" in body:
                raise SystemExit(f"error: request {request_id} failed: {r.text[:300]}")
            if body.get("type") != "try_again":
                return r
        raise SystemExit(f"error: request {request_id} gave no result within {POLL_LIMIT_S:g} s")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise SystemExit("error: no VmRSS in /proc")


def memory(url: str, key: str) -> dict:
    return httpx.get(url + "/stats", headers={"X-API-Key": key}, timeout=60).json()["memory"]


def run_rank(url: str, pid: int, base_model: str, rank: int, counts: list[int]) -> list[dict]:
    key = f"tml-memory-r{rank}"
    c = Client(url, key)
    reply = c.ok("create_model", types.CreateModelRequest(
        session_id=c.session, model_seq_id=0, base_model=base_model, lora_config=types.LoraConfig(rank=rank)))
    c.result(reply["request_id"])
    model_id = reply["model_id"]
    rows = [{"rank": rank, "samplers": 0, "rss": rss_mib(pid), **memory(url, key)}]
    print(_line(rows[-1]), flush=True)
    for n in range(1, max(counts) + 1):
        snap = c.ok("save_weights_for_sampler", types.SaveWeightsForSamplerRequest(
            model_id=model_id, seq_id=n, sampling_session_seq_id=n))
        c.result(snap["request_id"])
        sampler = f"{c.session}:sample:{n}"
        sample = c.ok("asample", types.SampleRequest(
            sampling_session_id=sampler, seq_id=0, num_samples=1,
            prompt=types.ModelInput.from_ints([1, 2, 3]),
            sampling_params=types.SamplingParams(max_tokens=4, seed=n)))
        c.result(sample["request_id"])
        if n in counts:
            rows.append({"rank": rank, "samplers": n, "rss": rss_mib(pid), **memory(url, key)})
            print(_line(rows[-1]), flush=True)
    c.http.post(f"/sessions/{c.session}/finish", json={"reason": {"type": "success"}})
    time.sleep(12)  # the expiry loop hands dropped samplers' pages back every 5 s
    rows.append({"rank": rank, "samplers": "finished", "rss": rss_mib(pid), **memory(url, key)})
    print(_line(rows[-1]), flush=True)
    return rows


def _line(r: dict) -> str:
    return (f"| {r['rank']} | {r['samplers']} | {r['rss']:.0f} | {r.get('peak_rss_mb', 0):.0f} | "
            f"{r.get('snapshots', 0):.0f} | {r.get('snapshot_mb', 0):.0f} | "
            f"{r.get('merged_cached', 0):.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="8,64")
    ap.add_argument("--counts", default="1,2,4,8,16")
    ap.add_argument("--base-model", default=SMOLLM2)
    args = ap.parse_args()
    try:
        ranks = [int(x) for x in args.ranks.split(",")]
        counts = sorted({int(x) for x in args.counts.split(",")})
    except ValueError:
        print("error: --ranks and --counts take comma-separated integers", file=sys.stderr)
        sys.exit(2)
    if not counts or counts[0] < 1 or counts[-1] > 16 or not all(1 <= r <= 128 for r in ranks):
        print("error: --counts must lie in [1, 16] (the per-session sampler cap) and --ranks in [1, 128]",
              file=sys.stderr)
        sys.exit(2)
    with tempfile.TemporaryDirectory() as state:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        proc = subprocess.Popen([sys.executable, "-m", "trainer.serve", "--state-dir", state, "--port", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        try:
            line = proc.stdout.readline().strip()
            if not line.startswith("listening on http://127.0.0.1:"):
                raise SystemExit(f"error: the server did not start: {line!r}")
            url = line.split()[-1]
            print(f"server RSS at start: {rss_mib(proc.pid):.0f} MiB (base model not loaded yet)")
            print("| LoRA rank | samplers | server RSS MiB | peak RSS MiB | live snapshots | snapshot MiB | "
                  "merged weight sets cached |")
            print("|---|---|---|---|---|---|---|")
            for rank in ranks:
                run_rank(url, proc.pid, args.base_model, rank, counts)
        finally:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
