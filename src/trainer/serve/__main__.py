"""`python -m trainer.serve [--host 127.0.0.1] [--port 0] [--faults SPEC] ...`

Serves the embedded engine over tinker 0.38's HTTP protocol, so that
`TINKER_API_KEY=tml-local TINKER_BASE_URL=http://HOST:PORT python train.py backend=tinker ...` runs the
real SDK end to end offline. The first stdout line is exactly `listening on http://HOST:PORT` (with the
port the OS picked for `--port 0`). Access: by default the server listens on loopback and answers
loopback clients only, with any key of the form `tml-<name>` (each key sees only what it created).
`--api-key-file FILE` (one key a line), `$PAIREDRL_SERVE_API_KEY` (comma-separated) or `--api-key KEY`
(repeatable; visible to every local user in `ps`, so prefer the file or the variable) accept exactly
those keys and are required for a non-loopback `--host`; `--insecure-allow-remote` lifts that with a
warning. The `--max-*` flags bound what one request, one key, one session, one custom loss or the whole
server may ask for (without a key, every invented `tml-` key shares the server-wide ones); a session ends
`--session-timeout-s` after its last heartbeat or request, and its queued and running work is cancelled. SIGINT / SIGTERM stop it cleanly. The engine
options mirror `backend=local` (`conf/backend/local.yaml`); LoRA alpha is not part of the Tinker protocol,
so a rehearsal of a model config with another alpha passes `--lora-alpha`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from trainer.config.enums import MAX_SAMPLER_LOGIT_NOISE, SAMPLER_QUANTS
from trainer.serve import is_loopback
from trainer.serve.limits import SDK_HEARTBEAT_S, SESSION_TIMEOUT_S, Limits


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit code 2 (no usage block)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(prog="python -m trainer.serve", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback only)")
    p.add_argument("--port", type=int, default=0, help="port (0 = any free port, printed on the first line)")
    p.add_argument("--faults", default="", help="fault injection spec, see trainer/serve/faults.py "
                   "(e.g. 'rate=0.1 seed=0' or 'at=optim_step#2:410')")
    p.add_argument("--latency-s", type=float, default=0.0, help="delay added to every API request (seconds)")
    p.add_argument("--poll-s", type=float, default=20.0, help="long-poll of retrieve_future (seconds, < 45)")
    p.add_argument("--print-env", action="store_true",
                   help="seed a Hugging Face cache with the served models' tokenizers (--hf-home) and print the "
                        "exports an unmodified Tinker / cookbook program needs offline, then exit")
    p.add_argument("--hf-home", default=os.path.expanduser("~/.cache/pairedrl/hf"),
                   help="the HF_HOME --print-env seeds (default ~/.cache/pairedrl/hf)")
    p.add_argument("--ttl-sweep-s", type=float, default=60.0,
                   help="how often expired checkpoints (save calls' ttl_seconds, set_checkpoint_ttl) are deleted")
    p.add_argument("--client-side-loss", action="store_true",
                   help="tell the SDK to run registered custom losses client-side (two passes), as the "
                        "service does when its config has custom_loss_server_side=false")
    p.add_argument("--state-dir", default=os.path.expanduser("~/.cache/pairedrl/serve"),
                   help="where the engine keeps checkpoints (tinker:// paths name folders under it)")
    p.add_argument("--sampler-dtype", default="auto", help="auto | bfloat16 | float32")
    p.add_argument("--train-dtype", default="auto", help="auto | bfloat16 | float32")
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--micro-batch-tokens", type=int, default=2048)
    p.add_argument("--max-sample-batch", type=int, default=128)
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 32, the engine's)")
    p.add_argument("--sampler-quant", default="none",
                   help="round the sampler's projection weights to a serving format and back, training "
                        "keeping the exact ones (a train-inference mismatch, docs/engine.md): "
                        "none | fp16 | fp8_e4m3 | int8 | int4")
    p.add_argument("--sampler-logit-noise", type=float, default=0.0,
                   help="sd (nats) of seeded Gaussian noise added to the sampler's logits at every sampled "
                        "token, in [0, 10] (default 0 = none)")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--api-key", action="append", default=[],
                   help="accept only this key (repeatable; required for a non-loopback --host). A key on the "
                        "command line shows in `ps` to every local user: prefer --api-key-file or "
                        "$PAIREDRL_SERVE_API_KEY (comma-separated)")
    p.add_argument("--api-key-file", default=None,
                   help="read the accepted keys from this file (one a line; blank lines, # comments skipped)")
    p.add_argument("--session-timeout-s", type=float, default=SESSION_TIMEOUT_S,
                   help=f"a session whose heartbeats (the SDK sends one every {SDK_HEARTBEAT_S:g} s) stop "
                        "ends after this long (any request of the session counts as a heartbeat), "
                        "releasing its models, samplers and futures and cancelling its queued and running "
                        "work (default "
                        f"{SESSION_TIMEOUT_S:g}, when the SDK warns that the session will be terminated; "
                        f"must be > {SDK_HEARTBEAT_S:g})")
    p.add_argument("--read-timeout-s", type=float, default=30.0,
                   help="a request's headers must arrive within this long, and its body within this long plus "
                        "1 s per 64 KiB; slower ones are answered 408 / disconnected (default 30)")
    p.add_argument("--insecure-allow-remote", action="store_true",
                   help="bind a non-loopback --host without --api-key (anyone who reaches the port can train "
                        "and sample; a warning is printed)")
    defaults = Limits()
    for f in fields(Limits):
        p.add_argument(Limits.flag(f.name), dest=f"limit_{f.name}", type=type(getattr(defaults, f.name)),
                       default=getattr(defaults, f.name), help=f"limit (default {getattr(defaults, f.name)}; see trainer/serve/limits.py)")
    args = p.parse_args(argv)
    env_keys = [k.strip() for k in os.environ.get("PAIREDRL_SERVE_API_KEY", "").split(",") if k.strip()]
    file_keys: list[str] = []
    if args.api_key_file is not None:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or e
            p.error(f"--api-key-file {args.api_key_file}: cannot read it ({why})")
        file_keys = [x.strip() for x in lines if x.strip() and not x.strip().startswith("#")]
        if not file_keys:
            p.error(f"--api-key-file {args.api_key_file} holds no key")
    args.api_key = [*args.api_key, *env_keys, *file_keys]
    if any(not k.startswith("tml-") or len(k) < 12 for k in args.api_key):
        p.error("--api-key must start with 'tml-' (the SDK refuses other keys) and be at least 12 characters")
    try:
        args.limits = Limits(**{f.name: getattr(args, f"limit_{f.name}") for f in fields(Limits)})
    except ValueError as e:
        p.error(str(e))
    if not is_loopback(args.host) and not args.api_key and not args.insecure_allow_remote:
        p.error(f"--host {args.host} is not a loopback address: start the server with --api-key (or "
                "$PAIREDRL_SERVE_API_KEY) so that only holders of the key can use it, or pass "
                "--insecure-allow-remote to accept anyone who can reach the port")
    if not args.session_timeout_s > SDK_HEARTBEAT_S:  # NaN fails too
        p.error(f"--session-timeout-s must be > {SDK_HEARTBEAT_S:g} (the SDK heartbeats every "
                f"{SDK_HEARTBEAT_S:g} s; a shorter timeout would end live sessions)")
    _descriptors_for(args.limits.connections, p)
    if not 0 < args.read_timeout_s <= 3600:
        p.error("--read-timeout-s must be in (0, 3600]")
    if not args.ttl_sweep_s > 0:
        p.error("--ttl-sweep-s must be > 0")
    if not 0 < args.poll_s < 45:
        p.error("--poll-s must be in (0, 45): the SDK reads retrieve_future with a 45 s timeout")
    if args.sampler_quant not in SAMPLER_QUANTS:
        p.error(f"--sampler-quant must be one of {list(SAMPLER_QUANTS)}, got {args.sampler_quant!r}")
    if not 0 <= args.sampler_logit_noise <= MAX_SAMPLER_LOGIT_NOISE:  # NaN fails too
        p.error(f"--sampler-logit-noise must be in [0, {MAX_SAMPLER_LOGIT_NOISE:g}] (nats), "
                f"got {args.sampler_logit_noise!r}")
    return args


def _descriptors_for(connections: int, p: _Parser) -> None:
    """Raise the soft limit on open files so that --max-connections fit beside the engine's own files
    (the model, checkpoints, pipes), or refuse to start."""
    import resource

    need = connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError):  # past the kernel's own ceiling (fs.nr_open)
            new = soft
        if new < need:
            p.error(f"--max-connections {connections} needs {need} open files, but this process may open "
                    f"{new} (ulimit -n / -Hn); lower --max-connections")


def build_engine(args: argparse.Namespace) -> Any:
    """The engine the server runs: a `LocalServiceClient` with the engine flags (a bad value: ValueError)."""
    from trainer.backends.local import LocalServiceClient

    return LocalServiceClient(state_dir=Path(args.state_dir), sampler_dtype=args.sampler_dtype,
                              train_dtype=args.train_dtype, micro_batch_size=args.micro_batch_size,
                              micro_batch_tokens=args.micro_batch_tokens,
                              max_sample_batch=args.max_sample_batch,
                              lora_alpha=args.lora_alpha, num_threads=args.num_threads,
                              sampler_quant=args.sampler_quant, sampler_logit_noise=args.sampler_logit_noise)


async def serve(args: argparse.Namespace) -> None:
    from aiohttp import web

    from trainer.serve.app import TinkerServer
    from trainer.serve.connections import JsonErrorRunner, flush_logs_forever, install_log_limit
    from trainer.serve.faults import FaultPlan

    faults = FaultPlan.parse(args.faults)
    engine = build_engine(args)
    server = TinkerServer(engine, faults, poll_s=args.poll_s, server_side_loss=not args.client_side_loss,
                          latency_s=args.latency_s, api_keys=args.api_key, limits=args.limits,
                          allow_remote=args.insecure_allow_remote and not args.api_key,
                          ttl_sweep_s=args.ttl_sweep_s, session_timeout_s=args.session_timeout_s,
                          read_timeout_s=args.read_timeout_s)
    if not is_loopback(args.host) and not args.api_key:
        print(f"WARNING: --insecure-allow-remote: {args.host}:{args.port} accepts any 'tml-' key from any client "
              "that can reach it; custom losses and checkpoints run and load on this machine", file=sys.stderr,
              flush=True)
    # keepalive_timeout also bounds a connection that never completes its headers (aiohttp arms it when
    # the connection opens); `bodies.Bodies.read` bounds the body, and after a reply to a request whose body
    # was not read aiohttp drains it for at most lingering_time (default 10 s) before closing
    runner = JsonErrorRunner(server.app(), access_log=None, handle_signals=False,
                             keepalive_timeout=args.read_timeout_s,
                             lingering_time=min(1.0, args.read_timeout_s))
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    host, port = site._server.sockets[0].getsockname()[:2]  # the port the OS picked for --port 0
    print(f"listening on http://{host}:{port}", flush=True)
    flusher = asyncio.get_running_loop().create_task(flush_logs_forever(install_log_limit()))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    flusher.cancel()
    await runner.cleanup()
    engine.close()
    if faults.active:
        print(f"faults injected: {faults.injected}", flush=True)
    print("stopped", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.print_env:  # trainer.serve.offline_env: what a client program needs, no server started
        from trainer.serve.offline_env import env_lines, seed_hf_cache

        seeded = seed_hf_cache(Path(args.hf_home))
        print("\n".join(env_lines(Path(args.hf_home), list(seeded))))
        return 0
    logging.basicConfig(level=args.log_level.upper(), format="[serve %(asctime)s] %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr)
    try:
        asyncio.run(serve(args))
    except ValueError as e:  # a bad --faults spec or engine option
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the port is taken, the host cannot be bound
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
