"""Several gateway processes on one port, from one command (``kns gateway --processes N``).

A gateway process is one event loop on one core; a host's other cores take more processes. Every process:

* listens on the gateway's port with SO_REUSEPORT (the kernel spreads new connections over the processes that
  accept, so a restarting one gets none until it serves);
* is a gateway instance of its own (``<instance id>/<index>``): its own reply partition of the token topic, its
  own liveness, its streams resumable on any other, as between hosts;
* answers on a port of its own as well (``own_port``: the first one + its index), where ``/metrics`` and ``/health``
  are that process's alone.

The processes are supervised one by one (``runtime/fleet.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

from runtime.settings import GatewaySettings


def process_envs(gateway: GatewaySettings, processes: int, first_own_port: int,
                 base: Mapping[str, str]) -> list[dict[str, str]]:
    """The environment of each of ``processes`` gateway processes."""
    if processes < 1:
        raise ValueError("at least one process")
    return [{**base, "KNS_GATEWAY__REUSE_PORT": "true",
             "KNS_GATEWAY__INSTANCE_ID": f"{gateway.instance_id}/{index}",
             "KNS_GATEWAY__OWN_PORT": str(first_own_port + index)}
            for index in range(processes)]
