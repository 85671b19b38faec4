"""Backend factory: a Tinker-style ServiceClient, real or embedded. Nothing above knows which."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from trainer.config.schema import BackendCommonConfig, Config, LocalBackendConfig, TinkerBackendConfig

log = logging.getLogger(__name__)
_B = TypeVar("_B", bound=BackendCommonConfig)


class BackendConfigError(RuntimeError):
    pass


class Backend:
    """What the trainer may ask of a backend, declared here once per backend instead of asked by name or
    probed on the client: the loop, main, setup and the gates read these fields and call these methods.

    - `local_state`: checkpoints are written to this machine's disk (main checks the free space first);
    - `renews_session`: a recovery builds a new client (a restarted service knows none of the old ids);
    - `auto_requests`: what `sampling.requests=auto` means here (`per_group` | `per_sample`);
    - `custom_losses`: the client has `create_custom_loss` (the one-pass loss path; without it
      `backend.loss_path=auto` takes the two-pass path);
    - `reports_loss_placement`: a registered custom loss's handle says whether the service runs it
      server-side (`loss_id`), which the run logs;
    - `check(backend_cfg)`: what can be checked before any compute (a key, a URL), BackendConfigError;
    - `build(cfg, run_dir)`: the Tinker-shaped ServiceClient;
    - `precision(client)`: the engine's resolved dtypes (what a resume and the gates' reports check);
      `engine_record(client, base_model)`: run_info.json's `engine`, those dtypes with every implementation
      choice of the engine (None, both: the service decides its own)."""

    name: str
    local_state = False
    renews_session = False
    auto_requests = "per_group"
    custom_losses = False
    reports_loss_placement = False

    def check(self, b: BackendCommonConfig) -> None:
        """Nothing to check before the client is built."""

    def build(self, cfg: Config, run_dir: Path) -> Any:
        raise NotImplementedError

    def precision(self, client: Any) -> dict[str, Any] | None:
        return None

    def engine_record(self, client: Any, base_model: str) -> dict[str, Any] | None:
        return None


class LocalBackend(Backend):
    """The embedded CPU engine (`trainer.backends.local`)."""

    name = "local"
    local_state = True
    custom_losses = True

    def build(self, cfg: Config, run_dir: Path) -> Any:
        from trainer.backends.local import LocalServiceClient

        b = _own_config(cfg.backend, LocalBackendConfig)
        f = b.faults
        injected = (f.p_sample, f.p_forward_backward, f.p_optim_step, f.p_save_state, f.latency_s)
        faults = ({k: float(v) for k, v in dataclasses.asdict(f).items()} if any(v > 0 for v in injected)
                  else None)
        try:
            return LocalServiceClient(
                state_dir=Path(b.state_dir) if b.state_dir else Path(run_dir) / "engine",
                sampler_dtype=b.sampler_dtype, train_dtype=b.train_dtype, micro_batch_size=b.micro_batch_size,
                micro_batch_tokens=b.micro_batch_tokens,
                max_sample_batch=b.max_sample_batch, lora_alpha=cfg.model.lora_alpha, num_threads=b.num_threads,
                sample_batch_wait_s=b.sample_batch_wait_s, faults=faults, sampler_quant=b.sampler_quant,
                sampler_logit_noise=b.sampler_logit_noise, sampling_coupling=cfg.sampling.coupling)
        except ValueError as e:  # a bad setting or environment variable, before any model is loaded
            raise BackendConfigError(f"backend=local: {e}") from None

    def precision(self, client: Any) -> dict[str, Any] | None:
        return client.precision

    def engine_record(self, client: Any, base_model: str) -> dict[str, Any] | None:
        # every implementation choice of the engine, made once for this model and logged
        return client.engine_record(base_model)


class TinkerBackend(Backend):
    """A Tinker service (the real one, or `python -m trainer.serve`) through the SDK's ServiceClient."""

    name = "tinker"
    renews_session = True
    auto_requests = "per_sample"  # the service batches samples itself; one request each spreads them
    custom_losses = True
    reports_loss_placement = True

    def check(self, b: BackendCommonConfig) -> None:
        check_tinker(_own_config(b, TinkerBackendConfig))

    def build(self, cfg: Config, run_dir: Path) -> Any:
        return _tinker_client(_own_config(cfg.backend, TinkerBackendConfig))


#: the backends by `backend.name`
BACKENDS: dict[str, Backend] = {b.name: b for b in (LocalBackend(), TinkerBackend())}


def _own_config(b: BackendCommonConfig, cls: type[_B]) -> _B:
    """The backend group as this backend's own config class; BackendConfigError when `backend.name` was
    changed on the command line to another backend than the group's option (`backend=<name>` chooses both)."""
    if not isinstance(b, cls):
        raise BackendConfigError(f"backend.name={b.name!r} does not match the backend group's options "
                                 f"({type(b).__name__}); choose the backend with backend={b.name}")
    return b


def backend_of(cfg: Config) -> Backend:
    """The backend `cfg.backend.name` names; BackendConfigError for an unknown name."""
    b = BACKENDS.get(cfg.backend.name)
    if b is None:
        raise BackendConfigError(f"backend.name: unknown backend {cfg.backend.name!r} ({' | '.join(BACKENDS)})")
    return b


def build_service_client(cfg: Config, run_dir: Path) -> Any:
    return backend_of(cfg).build(cfg, run_dir)


def close_service_client(sc: Any) -> None:
    """Release a Tinker service client the trainer replaces after losing it (nothing for the local engine).

    tinker 0.38's `ServiceClient.close()` first asks the service to finish the session, retrying for
    minutes when the server is gone, and closes the connections only after that; meanwhile the old
    client's pending calls keep retrying and would reach a restarted server. Its holders' `close()`
    cancels the session heartbeat and the futures' pollers and closes the connection pools at once, which
    ends those retries (a closed pool refuses every request). An abandoned session expires on the service
    when its heartbeats stop."""
    for name in ("_session_holder", "_rest_holder"):
        holder = getattr(sc, name, None)
        if holder is not None:
            holder.close()


def finish_service_client(sc: Any, status: str, timeout_s: float) -> None:
    """End a run's session: the service is told it finished (`status`: success | errored | interrupted)
    and the client's heartbeat and connections stop. Without it a process that runs several arms in turn
    (a Hydra multirun) keeps every earlier arm's session alive, heartbeating, until the process exits.
    A service that does not answer within `timeout_s` is left to expire the session itself; the local
    engine's close frees its schedulers and training clients."""
    try:
        sc.close(status).result(timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 - the run is over and saved; an unfinished session only expires
        # after a failed run the service is often what failed: its one-line error has been said already
        log.log(logging.WARNING if status == "success" else logging.INFO,
                "the backend session was not finished (%s: %s); it expires on the service", type(e).__name__, e)
    finally:
        close_service_client(sc)


@contextlib.contextmanager
def session_finished(current: Callable[[], Any], timeout_s: float) -> Iterator[None]:
    """The block's session (`current()`, read at the end: a recovery may have replaced the client)
    finished with the block: success, interrupted on Ctrl-C, errored on any other exception."""
    status = "errored"
    try:
        yield
        status = "success"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        finish_service_client(current(), status, timeout_s)


def check_tinker(b: TinkerBackendConfig) -> tuple[str, str]:
    """(base URL, API key) of a Tinker service that answers; BackendConfigError naming the problem otherwise."""
    key = os.environ.get(b.api_key_env)
    if not key:
        raise BackendConfigError(
            f"backend=tinker needs an API key: set the environment variable {b.api_key_env} "
            "(and TINKER_BASE_URL for a non-default deployment), or run with backend=local")
    from tinker.lib.base_url import resolve_base_url

    base_url = resolve_base_url(b.base_url or os.environ.get("TINKER_BASE_URL") or None)
    probe_service(base_url, key, float(b.connect_timeout_s), b.api_key_env)
    return base_url, key


def _tinker_client(b: TinkerBackendConfig) -> Any:
    import tinker

    base_url, key = check_tinker(b)
    return tinker.ServiceClient(api_key=key, base_url=base_url)


def probe_service(base_url: str, key: str, timeout_s: float, key_env: str = "TINKER_API_KEY") -> None:
    """Fail fast, naming the URL, unless a Tinker service answers `POST /api/v1/client/config`.

    The SDK's first request (`InternalClientHolder._fetch_client_config`, tinker 0.38) retries connection
    errors for 300 s, and each later client creation does so again, so a wrong `TINKER_BASE_URL` would
    hang a run for most of an hour before failing. Connection errors and 5xx are retried here within
    `timeout_s`; a refused key or a non-Tinker answer fails at once."""
    import time

    import httpx
    import tinker

    from trainer.redaction import add_secrets, scrub

    url = base_url.rstrip("/") + "/api/v1/client/config"
    add_secrets([key])  # a password in the URL (or the key) is no part of a message
    shown, shown_url = scrub(base_url), scrub(url)
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BackendConfigError(f"the Tinker service at {shown} did not answer within {timeout_s:.0f} s "
                                     f"({scrub(last)}); check TINKER_BASE_URL / backend.base_url and "
                                     "the network")
        try:
            r = httpx.post(url, json={"sdk_version": tinker.__version__}, headers={"X-API-Key": key},
                           timeout=httpx.Timeout(min(5.0, left)))
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        else:
            if r.status_code in (401, 403):
                raise BackendConfigError(f"the Tinker service at {shown} refused the API key in "
                                         f"${key_env} (HTTP {r.status_code}: {r.text[:200]})")
            if r.status_code < 300:
                try:
                    r.json()
                    return
                except ValueError:
                    raise BackendConfigError(f"{shown} answered {shown_url} with a non-JSON body: it does "
                                             "not look like a Tinker service") from None
            if r.status_code < 500 and r.status_code not in (408, 429):
                raise BackendConfigError(f"{shown} answered {shown_url} with HTTP {r.status_code}: it does "
                                         f"not look like a Tinker service ({r.text[:200]!r})")
            last = f"HTTP {r.status_code}"
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
