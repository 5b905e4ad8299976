"""Which address each stage listens on, sends to and reports to (docs/design#coordinator, data plane).

Stage k runs on devices[k]; it listens on port `stage_port + k` of its device
and sends to stage k+1. Three ways to connect them:

- `local`: every stage on this host, all on 127.0.0.1.
- `wifi`: phones on one network talk directly, IP to IP; the coordinator is
  this host's address on that network.
- `usb`: phones only on USB. Stage k+1's port is forwarded to the host
  (`adb forward tcp:H tcp:P` on its phone) and reversed into stage k's phone
  (`adb reverse tcp:P tcp:H`), so stage k sends to its own 127.0.0.1:P and the
  bytes travel phone -> host -> phone. The coordinator's host port C is
  reversed into every phone as 127.0.0.1:C.

    stage k (phone A) --127.0.0.1:P--> adb reverse --host:H--> adb forward --127.0.0.1:P--> stage k+1 (phone B)
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from zl_base.errors import ZLError

MODES = ("auto", "local", "wifi", "usb")
DEFAULT_STAGE_PORT = 7100  # stage k listens on 7100 + k on its device
DEFAULT_HOST_PORT = 7200  # usb: stage k's forward on the host is 7200 + k
DEFAULT_COORDINATOR_PORT = 7099


@dataclass(frozen=True)
class Tunnel:
    """One adb port mapping. forward: host:host_port -> phone:device_port; reverse: phone:device_port -> host:host_port."""

    serial: str
    direction: Literal["forward", "reverse"]
    host_port: int
    device_port: int

    def command(self) -> str:
        """The equivalent adb command line (for logs and for users debugging by hand)."""
        if self.direction == "forward":
            return f"adb -s {self.serial} forward tcp:{self.host_port} tcp:{self.device_port}"
        return f"adb -s {self.serial} reverse tcp:{self.device_port} tcp:{self.host_port}"


@dataclass(frozen=True)
class StageAddresses:
    """The runner config's address fields for one stage ("" = not used by this stage)."""

    stage: int
    device: str
    listen: str = ""  # stages > 0
    downstream: str = ""  # all but the last stage
    coordinator: str = ""

    def config_fields(self) -> dict[str, str]:
        """{"listen": ..., "downstream": ..., "coordinator": ...} without the empty ones."""
        fields = {"listen": self.listen, "downstream": self.downstream, "coordinator": self.coordinator}
        return {k: v for k, v in fields.items() if v}


@dataclass(frozen=True)
class AddressPlan:
    mode: str  # local | wifi | usb
    stages: tuple[StageAddresses, ...]
    tunnels: tuple[Tunnel, ...]  # usb only, in the order to set them up


def host_ip_towards(peer_ip: str) -> str:
    """This host's address on the route to `peer_ip` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer_ip, 9))
            return s.getsockname()[0]
        except OSError as e:
            raise ZLError(f"no route from this host to {peer_ip} ({e}); put the host on the phones' Wi-Fi "
                          "network or use --network usb.") from e


def plan_addresses(
    devices: Sequence,
    mode: str = "auto",
    stage_port: int = DEFAULT_STAGE_PORT,
    host_port: int = DEFAULT_HOST_PORT,
    coordinator_port: int | None = DEFAULT_COORDINATOR_PORT,
    host_ip: str | None = None,
) -> AddressPlan:
    """Addresses for a pipeline whose stage k runs on devices[k].

    Args:
        devices: `Device`s (anything with .name, .kind and .address()).
        mode: auto (local for local devices; wifi when every phone has a Wi-Fi address, else usb), local,
            wifi or usb.
        stage_port: stage k listens on stage_port + k on its device.
        host_port: usb: stage k's port is forwarded to host_port + k on the host.
        coordinator_port: the coordinator's port on the host; None = run without one.
        host_ip: wifi: the host's address the phones reach (default: found from the route to the first phone).

    Raises:
        ZLError: local and phone devices mixed, a phone without Wi-Fi in wifi mode, colliding ports.
    """
    if mode not in MODES:
        raise ZLError(f"network mode {mode!r}: expected one of {', '.join(MODES)}.")
    if not devices:
        raise ZLError("no devices to plan addresses for.")
    kinds = {d.kind for d in devices}
    if len(kinds) > 1:
        raise ZLError(f"devices {', '.join(d.name for d in devices)} mix kinds {sorted(kinds)}; "
                      "use only local devices or only phones in one pipeline.")
    k = len(devices)
    stage_ports = [stage_port + i for i in range(k)]
    host_ports = [host_port + i for i in range(k)]
    # A phone's listen port and its reversed coordinator port share the phone; host forwards share the host
    # with the coordinator.
    if coordinator_port in stage_ports or coordinator_port in host_ports:
        raise ZLError(f"coordinator port {coordinator_port} collides with the stage ports {stage_ports} or the "
                      f"host forwards {host_ports}; pick another --coordinator-port.")

    if kinds == {"local"}:
        if mode not in ("auto", "local"):
            raise ZLError(f"--network {mode} applies to phones; local devices always use 127.0.0.1.")
        return _plan_direct("local", devices, stage_ports, ["127.0.0.1"] * k, "127.0.0.1", "127.0.0.1",
                            coordinator_port)
    if mode == "local":
        raise ZLError("--network local applies to local devices; phones use wifi or usb.")

    ips = [d.address() for d in devices] if mode in ("auto", "wifi") else [None] * k
    if mode == "auto":
        mode = "wifi" if all(ips) else "usb"
    if mode == "wifi":
        missing = [d.name for d, ip in zip(devices, ips) if not ip]
        if missing:
            raise ZLError(f"phones {', '.join(missing)} have no Wi-Fi address (wlan0); connect them to the "
                          "host's network or use --network usb.")
        coordinator_host = host_ip or host_ip_towards(ips[0])
        return _plan_direct("wifi", devices, stage_ports, ips, "0.0.0.0", coordinator_host, coordinator_port)
    return _plan_usb(devices, stage_ports, host_ports, coordinator_port)


def _plan_direct(mode, devices, ports, ips, bind, coordinator_host, coordinator_port) -> AddressPlan:
    stages = []
    for i, device in enumerate(devices):
        downstream = ""
        if i + 1 < len(devices):
            same = devices[i + 1].name == device.name
            downstream = f"{'127.0.0.1' if same else ips[i + 1]}:{ports[i + 1]}"
        stages.append(StageAddresses(
            i, device.name,
            listen=f"{bind}:{ports[i]}" if i > 0 else "",
            downstream=downstream,
            coordinator=f"{coordinator_host}:{coordinator_port}" if coordinator_port else ""))
    return AddressPlan(mode, tuple(stages), ())


def _plan_usb(devices, ports, host_ports, coordinator_port) -> AddressPlan:
    stages, tunnels = [], []
    for i, device in enumerate(devices):
        downstream = ""
        if i + 1 < len(devices):
            receiver = devices[i + 1]
            if receiver.name != device.name:
                tunnels.append(Tunnel(receiver.name, "forward", host_ports[i + 1], ports[i + 1]))
                tunnels.append(Tunnel(device.name, "reverse", host_ports[i + 1], ports[i + 1]))
            downstream = f"127.0.0.1:{ports[i + 1]}"
        stages.append(StageAddresses(
            i, device.name,
            listen=f"127.0.0.1:{ports[i]}" if i > 0 else "",
            downstream=downstream,
            coordinator=f"127.0.0.1:{coordinator_port}" if coordinator_port else ""))
    if coordinator_port:
        for serial in dict.fromkeys(d.name for d in devices):
            tunnels.append(Tunnel(serial, "reverse", coordinator_port, coordinator_port))
    return AddressPlan("usb", tuple(stages), tuple(tunnels))


def apply_tunnels(plan: AddressPlan, devices: Sequence) -> None:
    """Set up the plan's adb forwards and reverses on the phones (`AdbDevice.forward` / `.reverse`)."""
    by_name = {d.name: d for d in devices}
    for t in plan.tunnels:
        if t.direction == "forward":
            by_name[t.serial].forward(t.host_port, t.device_port)
        else:
            by_name[t.serial].reverse(t.device_port, t.host_port)


def free_port_base(count: int, start: int = 20000, stop: int = 60000) -> int:
    """A base port with `count` consecutive free ports on 127.0.0.1 (local devices share this host).

    The ports come from [start, stop) minus the kernel's ephemeral range (Linux: 32768-60999), from which it gives
    every outgoing connection its local port: a port free when checked there can be some client's by the time a
    runner binds it (a run once failed so, `bind 127.0.0.1:41010: Address already in use`).
    """
    rng = secrets.SystemRandom()
    low, high = _ephemeral_ports()
    ranges = [(a, b) for a, b in ((start, min(stop, low)), (max(start, high + 1), stop)) if b - a > count]
    if not ranges:
        ranges = [(start, stop)]
    for _ in range(200):
        a, b = rng.choice(ranges)
        base = rng.randrange(a, b - count)
        socks = []
        try:
            for p in range(base, base + count):
                sock = socket.socket()
                sock.bind(("127.0.0.1", p))
                socks.append(sock)
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise ZLError("found no free local ports for the stages; is the host out of ports?")


def _ephemeral_ports(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections; Linux's default where it cannot be read."""
    try:
        low, high = (int(v) for v in Path(path).read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999
