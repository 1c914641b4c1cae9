"""The network lab: node A, node B and a store node in network namespaces, joined through a bridge, with
links we shape (rate), cut and make lossy. Test-only: it needs root, ``ip`` and ``tc`` (and ``nft`` for
loss and cuts).

Topology (every name carries the lab's id, so two labs never collide and a crashed one is found by name)::

    psl<ID>-a  eth0 10.77.X.1 ─┐
    psl<ID>-b  eth0 10.77.X.2 ─┼─ psl<ID>-hub: bridge br0 (a namespace of its own)
    psl<ID>-s  eth0 10.77.X.3 ─┘

Nothing touches the host's namespace: the bridge lives in a hub namespace, node links are veth pairs between
a node and the hub, addresses exist only inside the lab, there is no default route, no NAT and no
forwarding, so traffic cannot leave the lab. Each node's link is shaped in both directions with ``tbf``
(egress of the node's end, egress of the hub's end); this kernel has no ``netem``, so loss and cuts are
nftables rules in the node (``numgen random mod 100 < N drop``, or a plain drop toward the store). The store node
runs what the tests ask for: Redis (:meth:`Lab.start_redis`), Mooncake Store (:meth:`Lab.start_mooncake`), an SSH
server whose directory a node mounts with sshfs inside its own command's mount namespace
(:meth:`Lab.start_sshd`, :meth:`Lab.sshfs_wrap`).

:meth:`Lab.up` first removes what a crashed lab left (namespaces named ``psl<ID>-*`` whose creating process
is gone, with the processes inside them); :meth:`Lab.down` kills what the lab started and deletes its
namespaces; both are idempotent. Where the lab cannot be built (no root, no ``ip``), :func:`unavailable`
says why: tests skip with that reason, and on CI (``CI=true``) it is an error.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

NODES = ("a", "b", "s")
PREFIX = "psl"
#: tbf's burst and queue bound: a burst of 256 kB lets rates up to ~10 Gbit/s pass on a CPU host (tbf needs
#: burst >= rate / HZ), latency bounds the queue so a cut link does not buffer for seconds
BURST = "512kb"
TBF_LATENCY = "200ms"
CMD_TIMEOUT_S = 20


#: the store node's SSH server (the sshfs shared filesystem): AES-GCM uses the CPU's AES instructions (faster
#: than chacha20 on our 2-core host: 270 against 200 MB/s for a sequential copy); one SFTP connection per mount
#: (sshfs's max_conns=4 opened its extra connections on first use: +0.6 s on the first load of every mount)
SSH_PORT = 2222
SSH_CIPHER = "aes128-gcm@openssh.com"
SSHFS_CONNS = 1
#: Mooncake Store on the store node: master RPC, its HTTP metadata server, its metrics, the segment holder
MOONCAKE_PORTS = (50051, 8080, 9003, 17812)
#: the segment holder's memory: one link-table cell's rounds (3 x 604 MB at most, below the eviction
#: watermark); a fresh store per cell, as Mooncake refuses to delete an object read in the last 10 s (its read
#: lease) and a put into a full segment fails
MOONCAKE_SEGMENT_MB = 3072
#: an S3 stand-in on the store node (moto's server, from the test extra): its port, the bucket, and the virtual
#: host LMCache's S3 client asks for (``<bucket>.<host>``), resolved to the store node by a hosts file the lab
#: binds over /etc/hosts inside each command's own mount namespace
S3_PORT = 9000
S3_BUCKET = "kvstore"
S3_HOST = "s3.lab"


class LabError(RuntimeError):
    """A lab command failed (the command and its stderr are in the message)."""


def _run(args: list[str], *, check: bool = True, timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise LabError(f"{' '.join(args)}: rc {proc.returncode}: {proc.stderr.strip()[:400]}")
    return proc


def unavailable() -> str | None:
    """Why a lab cannot be built here (None: it can)."""
    if sys.platform != "linux":
        return "the network lab needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the network lab needs root (ip netns, tc, nft)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the network lab needs '{tool}' (iproute2)"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = _run(["ip", "netns", "add", probe], check=False)
    _run(["ip", "netns", "del", probe], check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()[:200]}"
    return None


def have_nft() -> bool:
    return shutil.which("nft") is not None


def sshfs_missing() -> str | None:
    """Why the sshfs shared filesystem cannot be mounted here (None: it can)."""
    for tool, package in (("sshfs", "sshfs"), ("sshd", "openssh-server"), ("ssh-keygen", "openssh-client"),
                          ("fusermount3", "fuse3")):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"the sshfs tier needs '{tool}' (Debian: apt-get install {package}; make services does)"
    if not Path("/dev/fuse").exists():
        return "the sshfs tier needs /dev/fuse (FUSE is not available on this machine)"
    return None


@dataclass(frozen=True)
class MooncakeStore:
    """Mooncake Store on the store node (see :meth:`Lab.start_mooncake`): the master's RPC address and the
    metadata server's URL, as the ``mooncake_store`` tier takes them."""

    master: str
    metadata: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list, compare=False, repr=False)


@dataclass(frozen=True)
class S3Bucket:
    """A bucket of the S3 stand-in on the store node (see :meth:`Lab.start_s3`)."""

    endpoint: str  #: ``bucket.host:port``, as the ``s3`` tier takes it
    hosts: Path  #: the hosts file that resolves the endpoint's host to the store node
    proc: subprocess.Popen[bytes] = field(compare=False, repr=False)


@dataclass(frozen=True)
class SshExport:
    """A directory the store node serves over SFTP (see :meth:`Lab.start_sshd`)."""

    host: str
    port: int
    path: Path
    key: Path


def commit() -> str:
    """The commit a lab run measured (``-dirty`` when tracked files had changes), for its results rows."""
    here = str(Path(__file__).resolve().parent)
    proc = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return proc.stdout.strip() + ("-dirty" if dirty else "")


def _namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _kill_inside(ns: str) -> None:
    pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def reap_stale() -> list[str]:
    """Delete the namespaces of labs whose creating process has died (a crashed test run); returns them."""
    removed = []
    for ns in _namespaces():
        if not ns.startswith(PREFIX) or "-" not in ns:
            continue
        owner = ns[len(PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not _alive(int(owner)):
            _kill_inside(ns)
            _run(["ip", "netns", "del", ns], check=False)
            removed.append(ns)
    return removed


@dataclass
class Link:
    """What is set on one node's link now (for rows and for the plan's arithmetic)."""

    rate_mbit: float | None = None
    loss_pct: int = 0
    cut: bool = False


@dataclass
class Lab:
    """One lab; ``with Lab() as lab:`` builds it and always takes it down."""

    lab_id: int = field(default_factory=os.getpid)
    subnet: int = field(default_factory=lambda: 64 + os.getpid() % 128)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    links: dict[str, Link] = field(default_factory=lambda: {n: Link() for n in NODES})

    # --- names ---------------------------------------------------------------------------------------------
    def ns(self, node: str) -> str:
        return f"{PREFIX}{self.lab_id}-{node}"

    @property
    def hub(self) -> str:
        return self.ns("hub")

    def ip(self, node: str) -> str:
        return f"10.77.{self.subnet}.{NODES.index(node) + 1}"

    def _hub_end(self, node: str) -> str:
        return f"v{node}"

    # --- lifecycle -----------------------------------------------------------------------------------------
    def up(self) -> Lab:
        reason = unavailable()
        if reason is not None:
            raise LabError(reason)
        reap_stale()
        self.down()  # idempotent: a lab of this id left half-built is rebuilt from nothing
        _run(["ip", "netns", "add", self.hub])
        self.in_ns(self.hub, ["ip", "link", "add", "br0", "type", "bridge"])
        self.in_ns(self.hub, ["ip", "link", "set", "br0", "up"])
        self.in_ns(self.hub, ["ip", "link", "set", "lo", "up"])
        for node in NODES:
            ns, hub_end = self.ns(node), self._hub_end(node)
            _run(["ip", "netns", "add", ns])
            # the pair is created inside the hub and one end moved into the node: nothing in the host namespace
            self.in_ns(self.hub, ["ip", "link", "add", hub_end, "type", "veth", "peer", "name", "eth0"])
            self.in_ns(self.hub, ["ip", "link", "set", "eth0", "netns", ns])
            self.in_ns(self.hub, ["ip", "link", "set", hub_end, "master", "br0", "up"])
            self.in_ns(ns, ["ip", "addr", "add", f"{self.ip(node)}/24", "dev", "eth0"])
            self.in_ns(ns, ["ip", "link", "set", "eth0", "up"])
            self.in_ns(ns, ["ip", "link", "set", "lo", "up"])
        self.check_isolated()
        return self

    def down(self) -> None:
        self.stop(list(self.procs))
        present = set(_namespaces())
        for name in [*(self.ns(n) for n in NODES), self.hub]:
            if name in present:
                _kill_inside(name)
                _run(["ip", "netns", "del", name], check=False)

    def __enter__(self) -> Lab:
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc: object) -> None:
        self.down()

    def check_isolated(self) -> None:
        """No node has a default route or an address outside the lab's subnet (loopback aside)."""
        for node in NODES:
            routes = self.in_ns(self.ns(node), ["ip", "route", "show", "default"]).stdout.strip()
            if routes:
                raise LabError(f"node {node} has a default route: {routes}")
            addrs = self.in_ns(self.ns(node), ["ip", "-o", "-4", "addr", "show"]).stdout
            for line in addrs.splitlines():
                addr = line.split()[3]
                if not (addr.startswith("127.") or addr.startswith(f"10.77.{self.subnet}.")):
                    raise LabError(f"node {node} has an address outside the lab: {addr}")

    # --- running things in a node --------------------------------------------------------------------------
    def in_ns(self, ns: str, args: list[str], *, check: bool = True,
              timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        return _run(["ip", "netns", "exec", ns, *args], check=check, timeout=timeout)

    def spawn(self, node: str, args: list[str], *, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start a long-running process in ``node`` (killed with its group by :meth:`down`)."""
        out = open(log, "ab")  # noqa: SIM115 - owned by the process for its lifetime
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(node), *args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        out.close()
        self.procs.append(proc)
        return proc

    def wait_port(self, node: str, port: int, *, from_node: str | None = None, timeout_s: float = 30.0) -> None:
        """Until ``node``'s ``port`` accepts a TCP connection from ``from_node`` (default: the node itself)."""
        probe = ("import socket,sys\ns=socket.socket();s.settimeout(1)\n"
                 f"sys.exit(s.connect_ex(('{self.ip(node)}',{port})))")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.in_ns(self.ns(from_node or node), [sys.executable, "-c", probe], check=False).returncode == 0:
                return
            time.sleep(0.3)
        raise LabError(f"{node}:{port} did not accept connections within {timeout_s:g} s")

    def start_redis(self, port: int, workdir: Path) -> subprocess.Popen[bytes]:
        """Redis on the store node, reachable from the lab only (it binds the store node's lab address)."""
        proc = self.spawn("s", ["redis-server", "--bind", self.ip("s"), "--port", str(port), "--protected-mode", "no",
                                "--save", "", "--appendonly", "no", "--dir", str(workdir)],
                          log=workdir / "redis.log")
        self.wait_port("s", port, from_node="a")
        return proc

    def start_sshd(self, workdir: Path, port: int = SSH_PORT) -> SshExport:
        """An SSH server on the store node exporting ``workdir/export`` over SFTP (a key made for this lab only,
        reachable from the lab only); nodes mount it with :meth:`sshfs_wrap`."""
        missing = sshfs_missing()
        if missing is not None:
            raise LabError(missing)
        keys = workdir / "ssh"
        keys.mkdir(parents=True, exist_ok=True)
        export = workdir / "export"
        export.mkdir(parents=True, exist_ok=True)
        for name in ("host", "user"):
            if not (keys / name).exists():
                _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)])
        (keys / "authorized_keys").write_text((keys / "user.pub").read_text())
        (keys / "authorized_keys").chmod(0o600)
        config = keys / "sshd_config"
        config.write_text("\n".join([
            f"Port {port}", f"ListenAddress {self.ip('s')}", f"HostKey {keys / 'host'}",
            f"AuthorizedKeysFile {keys / 'authorized_keys'}", "PermitRootLogin prohibit-password",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
            "Subsystem sftp internal-sftp", f"PidFile {keys / 'sshd.pid'}", ""]))
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        # -D: in the foreground, so the process is the lab's to kill; -e: its log to the log file
        self.spawn("s", [shutil.which("sshd") or "/usr/sbin/sshd", "-D", "-e", "-f", str(config)],
                   log=workdir / "sshd.log")
        self.wait_port("s", port, from_node="a")
        return SshExport(host=self.ip("s"), port=port, path=export, key=keys / "user")

    def sshfs_wrap(self, export: SshExport, mountpoint: Path, args: list[str]) -> list[str]:
        """``args`` run with ``export`` mounted at ``mountpoint`` by sshfs. Run it inside a node (``ip netns
        exec`` gives each command its own mount namespace, so the mount is seen by this command's processes
        only, and vanishes with them); unmounted when ``args`` end; exit 97 if the mount failed."""
        opts = ",".join([f"IdentityFile={export.key}", "StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null",
                         "BatchMode=yes", "LogLevel=ERROR", f"Ciphers={SSH_CIPHER}", f"max_conns={SSHFS_CONNS}",
                         "ServerAliveInterval=5", "ServerAliveCountMax=3", "reconnect"])
        script = ('mkdir -p "$1" && sshfs -p "$2" -o "$3" "$4" "$1" || exit 97\n'
                  'mnt=$1; shift 4; "$@"; rc=$?; fusermount3 -u "$mnt" 2>/dev/null; exit $rc')
        return ["sh", "-c", script, "sshfs-wrap", str(mountpoint), str(export.port), opts,
                f"root@{export.host}:{export.path}", *args]

    def start_mooncake(self, workdir: Path, segment_mb: int = MOONCAKE_SEGMENT_MB, port_offset: int = 0) -> MooncakeStore:
        """Mooncake Store on the store node: ``mooncake_master`` (with its HTTP metadata server) and one
        ``mooncake_client`` holding a ``segment_mb`` memory segment (TCP), both on the store node's lab address
        (ports ``MOONCAKE_PORTS`` + ``port_offset``); the nodes' servers contribute no memory, so what A stores
        is read by B from the store node. :meth:`stop` ends it."""
        tools = {}
        for name in ("mooncake_master", "mooncake_client"):
            found = shutil.which(name) or str(Path(sys.executable).parent / name)
            if not Path(found).exists():
                raise LabError(f"{name} is not installed (pip install 'prefixshare[mooncake]')")
            tools[name] = found
        host, (rpc, http, metrics, holder) = self.ip("s"), (p + port_offset for p in MOONCAKE_PORTS)
        master = self.spawn("s", [tools["mooncake_master"], f"--rpc_address={host}", f"--rpc_port={rpc}",
                         "--enable_http_metadata_server=true", f"--http_metadata_server_host={host}",
                         f"--http_metadata_server_port={http}", f"--metrics_host={host}",
                         f"--metrics_port={metrics}"], log=workdir / "mooncake-master.log")
        self.wait_port("s", rpc, from_node="a")
        self.wait_port("s", http, from_node="a")
        store = MooncakeStore(master=f"{host}:{rpc}", metadata=f"http://{host}:{http}/metadata", procs=[master])
        store.procs.append(self.spawn("s", [tools["mooncake_client"], f"--host={host}", f"--port={holder}",
                         f"--global_segment_size={segment_mb}MB", "--local_buffer_size=16MB",
                         f"--master_server_address={store.master}", f"--metadata_server={store.metadata}",
                         "--protocol=tcp"], log=workdir / "mooncake-client.log"))
        self.wait_port("s", holder, from_node="a")
        time.sleep(0.5)  # the segment is mounted right after the service starts listening
        return store

    def start_s3(self, workdir: Path, port: int = S3_PORT) -> S3Bucket:
        """moto's S3 server on the store node's lab address, with the bucket ``S3_BUCKET`` made (from node A,
        through the lab); :meth:`s3_wrap` runs a command that reaches it by its virtual host."""
        moto = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
        if not Path(moto).exists():
            raise LabError("moto_server is not installed (pip install 'prefixshare[test]')")
        host = self.ip("s")
        proc = self.spawn("s", [moto, "-H", host, "-p", str(port)], log=workdir / "moto.log")
        self.wait_port("s", port, from_node="a")
        hosts = workdir / "hosts-s3"
        hosts.write_text(f"127.0.0.1 localhost\n{host} {S3_HOST} {S3_BUCKET}.{S3_HOST}\n")
        make = ("import boto3\n"
                f"boto3.client('s3', endpoint_url='http://{host}:{port}', region_name='us-east-1', "
                f"aws_access_key_id='lab', aws_secret_access_key='lab').create_bucket(Bucket='{S3_BUCKET}')")
        self.in_ns(self.ns("a"), [sys.executable, "-c", make], timeout=60)
        return S3Bucket(endpoint=f"{S3_BUCKET}.{S3_HOST}:{port}", hosts=hosts, proc=proc)

    @staticmethod
    def s3_wrap(bucket: S3Bucket, args: list[str]) -> list[str]:
        """``args`` run inside a node with the bucket's virtual host resolvable (its hosts file bound over
        /etc/hosts in the command's own mount namespace, as ``ip netns exec`` gives each command one) and the
        stand-in's credentials in the environment (it takes any)."""
        script = 'mount --bind "$1" /etc/hosts || exit 96\nshift; exec env AWS_ACCESS_KEY_ID=lab AWS_SECRET_ACCESS_KEY=lab "$@"'
        return ["sh", "-c", script, "s3-wrap", str(bucket.hosts), *args]

    def stop(self, procs: list[subprocess.Popen[bytes]]) -> None:
        """End processes this lab started (their groups), before the lab goes down."""
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)
            if proc in self.procs:
                self.procs.remove(proc)

    # --- shaping and faults --------------------------------------------------------------------------------
    def shape(self, node: str, rate_mbit: float | None) -> None:
        """Limit ``node``'s link to ``rate_mbit`` Mbit/s in both directions (None: unlimited)."""
        for ns, dev in ((self.ns(node), "eth0"), (self.hub, self._hub_end(node))):
            if rate_mbit is None:
                self.in_ns(ns, ["tc", "qdisc", "del", "dev", dev, "root"], check=False)
            else:
                self.in_ns(ns, ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit:g}mbit",
                                "burst", BURST, "latency", TBF_LATENCY])
        self.links[node].rate_mbit = rate_mbit

    def _nft(self, node: str, rules: list[str]) -> None:
        if not have_nft():
            raise LabError("nft is not installed (Debian: apt-get install nftables; make services does)")
        ns = self.ns(node)
        self.in_ns(ns, ["nft", "delete", "table", "inet", "lab"], check=False)
        if not rules:
            return
        script = ["table inet lab {", " chain out { type filter hook output priority 0; policy accept;",
                  *[f"  {r}" for r in rules if r.startswith("ip daddr")], " }",
                  " chain in { type filter hook input priority 0; policy accept;",
                  *[f"  {r}" for r in rules if r.startswith("ip saddr")], " }", "}"]
        proc = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input="\n".join(script), text=True,
                              capture_output=True, timeout=CMD_TIMEOUT_S)
        if proc.returncode != 0:
            raise LabError(f"nft in {node}: {proc.stderr.strip()[:400]}")

    def _apply_faults(self, node: str) -> None:
        link, store = self.links[node], self.ip("s")
        rules: list[str] = []
        if link.cut:
            rules = [f"ip daddr {store} drop", f"ip saddr {store} drop"]
        elif link.loss_pct:
            rules = [f"ip daddr {store} numgen random mod 100 < {link.loss_pct} drop",
                     f"ip saddr {store} numgen random mod 100 < {link.loss_pct} drop"]
        self._nft(node, rules)

    def cut(self, node: str, cut: bool = True) -> None:
        """Drop every packet between ``node`` and the store node (both ways), or heal it."""
        self.links[node].cut = cut
        self._apply_faults(node)

    def loss(self, node: str, pct: int) -> None:
        """Drop ``pct`` % of the packets between ``node`` and the store node, each way."""
        if not 0 <= pct <= 100:
            raise LabError(f"loss {pct} %: give 0-100")
        self.links[node].loss_pct = pct
        self._apply_faults(node)

    def counters(self, node: str) -> dict[str, int]:
        """Bytes and packets through ``node``'s eth0 (the kernel's counters: what the link really carried)."""
        base = Path("/sys/class/net/eth0/statistics")
        script = ("import pathlib,json;b=pathlib.Path('" + str(base) + "');print(json.dumps({k:int((b/k).read_text()) "
                  "for k in ('rx_bytes','tx_bytes','rx_packets','tx_packets')}))")
        import json

        return json.loads(self.in_ns(self.ns(node), [sys.executable, "-c", script]).stdout)


@contextlib.contextmanager
def lab() -> Iterator[Lab]:
    with Lab() as built:
        yield built
