"""`python -m trainer.serve`: the embedded engine behind tinker 0.38's HTTP protocol (see app.py)."""

import ipaddress


def is_loopback(address: str | None) -> bool:
    """Whether an address (a peer's, or the `--host` to bind) is a loopback one. One test serves both the
    start-up host policy and the per-request peer check; a host name other than `localhost` may resolve to
    any interface, so it is not loopback; an IPv6 zone suffix (`%lo`) is ignored."""
    if address == "localhost":
        return True
    try:
        return address is not None and ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False
