#!/usr/bin/env python3
"""An emulated cluster on one machine: N "hosts", each a Linux network
namespace with its own hostname, linked by veth pairs to one bridge (the
"switch"), so that MPI ranks on different hosts talk over real TCP through
the kernel's network stack instead of shared memory. Needs root (or
CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2; ``tc tbf`` shapes a host's link
(e.g. to Gigabit Ethernet's 1 Gbit/s). Traffic stays inside the namespaces
and the bridge this script creates.

    python scripts/netns_cluster.py up -n 3                 # hosts h1..h3 at 10.231.0.1..3
    DIR=/run/ggpipe-netns/ggpipe
    $DIR/mpiexec -f $DIR/hosts -n 3 ggpipe generate -m smollm2-135m -p "Hello" -n 32
    python scripts/netns_cluster.py shape 2 1gbit           # host 2's link: 1 Gbit/s each way (tc tbf)
    python scripts/netns_cluster.py shape 2 none            # unshaped again
    python scripts/netns_cluster.py status                  # hosts, shaping, bytes through each link
    python scripts/netns_cluster.py down

``up`` writes, in its directory (default /run/ggpipe-netns/NAME):

- ``hosts``: MPICH's hostfile (``10.231.0.1:1`` ...; ``-n`` greater than the
  host count wraps round-robin, one slot per host); ``hosts.openmpi`` the same
  for Open MPI (``10.231.0.1 slots=1``);
- ``ssh``: the launcher's remote shell: ``ssh [-x] HOST COMMAND`` runs
  COMMAND in HOST's namespace, with the host's own hostname (a UTS
  namespace), as ``ssh`` would on a real node;
- ``mpiexec``: the MPI launcher of this Python environment, told to reach
  the hosts through ``ssh`` (Hydra: ``-launcher ssh -launcher-exec``, Open
  MPI: ``plm_ssh_agent``) and to listen on the bridge's address (run on a
  host, ``ssh HOST $DIR/mpiexec ...`` as a supervisor on the head node is,
  on that host's); it limits
  the MPI library to TCP between hosts (UCX ``UCX_TLS=tcp,self`` on the hosts'
  ``eth0``, libfabric ``FI_PROVIDER=tcp``, Open MPI ``btl tcp,self,sm``):
  the namespaces share one kernel, and UCX would otherwise reach a process on
  another "host" through shared memory. Ranks on the same host still use
  shared memory, as on a real node.
- ``cluster.json``: what was created, so ``down`` removes exactly that and
  nothing it did not create.

Exit status 0; 2 with one ``netns_cluster: error: ...`` line when the cluster
cannot be built (not root, no namespaces, a name or subnet already in use);
``--json`` prints what ``up`` made as JSON (the tests use it).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

try:
    from ggpipe.cluster.plan import detect_flavor
except ImportError:
    print(f"netns_cluster: error: ggpipe is not importable by {sys.executable}: run this script with the Python "
          f"of the environment ggpipe is installed in (sudo \"$(command -v python)\" {sys.argv[0]} ...)", file=sys.stderr)
    sys.exit(2)

STATE_ROOT = Path("/run/ggpipe-netns")
IFNAMSIZ = 15  # Linux interface names: 15 characters at most


class ClusterError(Exception):
    pass


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)}: {(p.stderr or p.stdout).strip() or f'exit {p.returncode}'}")
    return p


def names(name: str, n: int) -> dict:
    """Interface and namespace names of cluster ``name`` with ``n`` hosts."""
    if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", name):
        raise ClusterError(f"bad name {name!r}: 1-8 lower-case letters and digits, starting with a letter")
    ns = [f"{name}-h{i}" for i in range(1, n + 1)]
    veth = [f"{name}-v{i}" for i in range(1, n + 1)]
    if any(len(v) > IFNAMSIZ for v in veth):
        raise ClusterError(f"too many hosts for interface names of {IFNAMSIZ} characters")
    return {"bridge": f"{name}-br", "namespaces": ns, "veths": veth}


def state_dir(name: str, directory: str | None) -> Path:
    return Path(directory) if directory else STATE_ROOT / name


def load(name: str, directory: str | None = None) -> dict | None:
    f = state_dir(name, directory) / "cluster.json"
    return json.loads(f.read_text()) if f.exists() else None


def existing_namespaces() -> set[str]:
    p = sh("ip", "netns", "list", check=False)
    return {ln.split()[0] for ln in p.stdout.splitlines() if ln.strip()}


def link_exists(dev: str) -> bool:
    return sh("ip", "link", "show", "dev", dev, check=False).returncode == 0


def check_permitted() -> None:
    """Raise ClusterError saying why namespaces cannot be made here."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        raise ClusterError("network namespaces need Linux")
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            raise ClusterError(f"'{tool}' not found (Debian: apt-get install iproute2 util-linux)")
    if os.geteuid() != 0:
        raise ClusterError("network namespaces and veth pairs need root (or CAP_NET_ADMIN and CAP_SYS_ADMIN)")


def subnet_in_use(net: ipaddress.IPv4Network) -> str | None:
    for ln in sh("ip", "-4", "route", "show").stdout.splitlines():
        dst = ln.split()[0]
        if dst == "default":
            continue
        try:
            if ipaddress.ip_network(dst, strict=False).overlaps(net):
                return ln.strip()
        except ValueError:
            continue
    return None


SSH = """#!/bin/sh
# ggpipe emulated cluster {name}: `ssh [-x] HOST COMMAND...` runs COMMAND in
# HOST's network namespace with the host's hostname. Written by
# scripts/netns_cluster.py; removed by its `down`.
while [ $# -gt 0 ]; do
  case "$1" in -x|-T|-n|-q) shift ;; -o|-p|-l) shift 2 ;; *) break ;; esac
done
host=$1; shift
case "$host" in
{cases}
  *) echo "ssh ({name}): no host $host in this emulated cluster" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$1" && shift && exec sh -c "$*"' sh "$ns" "$@"
"""

MPIEXEC = """#!/bin/sh
# ggpipe emulated cluster {name}: this environment's MPI launcher, reaching the
# hosts through {dir}/ssh and keeping MPI traffic between hosts on TCP.
# Written by scripts/netns_cluster.py; removed by its `down`.
export UCX_TLS=tcp,self UCX_NET_DEVICES=eth0 FI_PROVIDER=tcp
{launch}
"""


def up(name: str, n: int, subnet: str, directory: str | None, mpiexec: str) -> dict:
    """Create the bridge, ``n`` namespaces with a veth each, the hostfiles
    and wrappers; return the cluster's description (cluster.json)."""
    check_permitted()
    if not 1 <= n <= 64:
        raise ClusterError("-n must be 1 to 64 hosts")
    if load(name, directory) is not None:
        raise ClusterError(f"cluster {name!r} is already up ({state_dir(name, directory)}); "
                           f"`down --name {name}` first")
    nm = names(name, n)
    taken = sorted(existing_namespaces() & set(nm["namespaces"]))
    taken += [d for d in [nm["bridge"], *nm["veths"]] if link_exists(d)]
    if taken:
        raise ClusterError(f"not created by this script and in the way: {', '.join(taken)} (pick another --name)")
    net = ipaddress.ip_network(subnet)
    if net.num_addresses < n + 3:
        raise ClusterError(f"subnet {subnet} has no room for {n} hosts")
    used = subnet_in_use(net)
    if used:
        raise ClusterError(f"subnet {subnet} overlaps a route of this machine ({used}); pick another --subnet")
    hosts_ip = [str(net.network_address + i) for i in range(1, n + 1)]
    bridge_ip = str(net.broadcast_address - 1)
    mpiexec = shutil.which(mpiexec) or mpiexec
    flavor = detect_flavor(mpiexec)  # ggpipe plan's detection, from `mpiexec --version`
    if flavor == "unknown":
        raise ClusterError(f"{mpiexec}: neither MPICH's Hydra nor Open MPI (see its --version)")
    d = state_dir(name, directory).resolve()
    # the launch prefix of a job across the hosts, one rank per host: Hydra fills each host's one slot
    # in turn; Open MPI is told (a default mapping policy of oversubscribe would put every rank on host 1)
    launch = ([str(d / "mpiexec"), "-f", str(d / "hosts")] if flavor == "mpich"
              else [str(d / "mpiexec"), "--hostfile", str(d / "hosts.openmpi"), "--map-by", "node"])
    desc = {"name": name, "dir": str(d), "subnet": str(net), "bridge": nm["bridge"], "bridge_ip": bridge_ip,
            "hosts": [{"host": i + 1, "ip": ip, "namespace": ns, "veth": v, "shaped": None}
                      for i, (ip, ns, v) in enumerate(zip(hosts_ip, nm["namespaces"], nm["veths"]))],
            "mpiexec": mpiexec, "flavor": flavor, "launch": launch}
    d.mkdir(parents=True, exist_ok=True)
    (d / "cluster.json").write_text(json.dumps(desc, indent=1))  # first: `down` can undo a half-built cluster
    try:
        sh("ip", "link", "add", nm["bridge"], "type", "bridge")
        sh("ip", "addr", "add", f"{bridge_ip}/{net.prefixlen}", "dev", nm["bridge"])
        sh("ip", "link", "set", nm["bridge"], "up")
        for h in desc["hosts"]:
            ns, v = h["namespace"], h["veth"]
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", v, "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "link", "set", v, "master", nm["bridge"], "up")
            sh("ip", "-n", ns, "addr", "add", f"{h['ip']}/{net.prefixlen}", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
    except ClusterError:
        down(name, directory)
        raise
    write_files(desc)
    return desc


def write_files(desc: dict) -> None:
    d = Path(desc["dir"])
    ips = [h["ip"] for h in desc["hosts"]]
    (d / "hosts").write_text("".join(f"{ip}:1\n" for ip in ips))
    (d / "hosts.openmpi").write_text("".join(f"{ip} slots=1\n" for ip in ips))
    cases = "\n".join(f"  {h['ip']}|{h['namespace']}) ns={h['namespace']} ;;" for h in desc["hosts"])
    ssh = d / "ssh"
    ssh.write_text(SSH.format(name=desc["name"], cases=cases))
    ssh.chmod(0o755)
    q = shlex.quote
    if desc["flavor"] == "mpich":
        # Hydra listens on this machine's address on the bridge, or on a host's own when it runs on that
        # host (``ssh HOST .../mpiexec``: a supervisor on the head node)
        here = " ".join(h["ip"] for h in desc["hosts"])
        launch = (f"here={desc['bridge_ip']}\n"
                  f"for a in {here}; do ip -o -4 addr show | grep -q \" inet $a/\" && here=$a; done\n"
                  f"exec {q(desc['mpiexec'])} -localhost \"$here\" -launcher ssh "
                  f"-launcher-exec {q(str(ssh))} \"$@\"")
    else:  # Open MPI 5 (prterun): its daemons start through the same ssh, listen and talk on the bridge's subnet
        launch = (f"exec {q(desc['mpiexec'])} --prtemca plm_ssh_agent {q(str(ssh))} "
                  f"--prtemca oob_tcp_if_include {desc['subnet']} --mca oob_tcp_if_include {desc['subnet']} "
                  f"--mca pml ob1 --mca btl tcp,self,sm --mca btl_tcp_if_include {desc['subnet']} \"$@\"")
    w = d / "mpiexec"
    w.write_text(MPIEXEC.format(name=desc["name"], dir=d, launch=launch))
    w.chmod(0o755)


def down(name: str, directory: str | None = None) -> list[str]:
    """Remove what ``up`` made (from cluster.json): namespaces, veths, the
    bridge, the directory's files. Returns what was removed."""
    desc = load(name, directory)
    if desc is None:
        raise ClusterError(f"no cluster {name!r} ({state_dir(name, directory)}/cluster.json not found)")
    gone = []
    namespaces = existing_namespaces()
    for h in desc["hosts"]:
        if h["namespace"] in namespaces:
            kill_namespace_processes(h["namespace"])
            sh("ip", "netns", "del", h["namespace"], check=False)  # its eth0 goes with it, and the veth's root end
            gone.append(h["namespace"])
        if link_exists(h["veth"]):
            sh("ip", "link", "del", h["veth"], check=False)
    if link_exists(desc["bridge"]):
        sh("ip", "link", "del", desc["bridge"], check=False)
        gone.append(desc["bridge"])
    d = Path(desc["dir"])
    for f in ("hosts", "hosts.openmpi", "ssh", "mpiexec", "cluster.json"):
        (d / f).unlink(missing_ok=True)
    try:
        d.rmdir()
    except OSError:
        pass  # not empty: files this script did not write stay
    return gone


def kill_namespace_processes(ns: str) -> None:
    """End the processes still running in namespace ``ns`` (a job the
    cluster's own launcher started there; they are the namespace's only
    members)."""
    for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError):
            pass


def host_of(desc: dict, host: str) -> dict:
    for h in desc["hosts"]:
        if host in (str(h["host"]), h["ip"], h["namespace"]):
            return h
    raise ClusterError(f"no host {host!r} in cluster {desc['name']!r} (hosts 1-{len(desc['hosts'])})")


def shape(desc: dict, host: str, rate: str, burst: str = "16kb") -> dict:
    """Shape host ``host``'s link to ``rate`` each way with ``tc tbf``
    (egress of its eth0, and of the bridge's end of its veth), or remove the
    shaping (``rate`` "none"). ``burst``: bytes that may leave at once above
    the rate; 16 KB is about 11 Ethernet frames (131 us at 1 Gbit/s), so a
    196 KB logits row takes its 1.6 ms on the wire. (A burst of 256 KB let
    that row through in 0.8 ms; tbf splits the veth's 64 KB offload segments
    that exceed the burst.)"""
    h = host_of(desc, host)
    ends = [("ip", "-n", h["namespace"]), ("ip",)]
    devs = ["eth0", h["veth"]]
    for pre, dev in zip(ends, devs):
        tc = ("tc", *pre[1:]) if len(pre) > 1 else ("tc",)
        sh(*tc, "qdisc", "del", "dev", dev, "root", check=False)
        if rate != "none":
            sh(*tc, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", burst, "latency", "50ms")
    h["shaped"] = None if rate == "none" else rate
    (Path(desc["dir"]) / "cluster.json").write_text(json.dumps(desc, indent=1))
    return h


def counters(desc: dict) -> dict:
    """Bytes sent and received by each host's eth0: {host: (tx, rx)}."""
    out = {}
    for h in desc["hosts"]:
        p = sh("ip", "-n", h["namespace"], "-j", "-s", "link", "show", "dev", "eth0")
        st = json.loads(p.stdout)[0]["stats64"]
        out[h["host"]] = (st["tx"]["bytes"], st["rx"]["bytes"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for c in ("up", "down", "status", "shape"):
        s = sub.add_parser(c)
        s.add_argument("--name", default="ggpipe", help="cluster name: namespaces NAME-h1.., bridge NAME-br")
        s.add_argument("--dir", default=None, help="where the hostfiles and wrappers go (default /run/ggpipe-netns/NAME)")
        s.add_argument("--json", action="store_true", help="print the cluster's description as JSON")
        if c == "up":
            s.add_argument("-n", "--hosts", type=int, default=3)
            s.add_argument("--subnet", default="10.231.0.0/24")
            s.add_argument("--mpiexec", default=str(Path(sys.executable).with_name("mpiexec")),
                           help="the MPI launcher the wrapper runs (default: this Python's)")
        if c == "shape":
            s.add_argument("host", help="host number, address or namespace")
            s.add_argument("rate", help="tc rate each way, e.g. 1gbit or 100mbit; 'none' removes the shaping")
    a = ap.parse_args()
    try:
        if a.cmd == "up":
            desc = up(a.name, a.hosts, a.subnet, a.dir, a.mpiexec)
        elif a.cmd == "down":
            print("removed:", " ".join(down(a.name, a.dir)))
            return 0
        else:
            desc = load(a.name, a.dir)
            if desc is None:
                raise ClusterError(f"no cluster {a.name!r} is up")
            if a.cmd == "shape":
                shape(desc, a.host, a.rate)
            desc["bytes"] = {h: {"tx": tx, "rx": rx} for h, (tx, rx) in counters(desc).items()}
    except ClusterError as e:
        print(f"netns_cluster: error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(desc))
        return 0
    for h in desc["hosts"]:
        b = desc.get("bytes", {}).get(h["host"])
        extra = f"  sent {b['tx']:,} B, received {b['rx']:,} B" if b else ""
        print(f"host {h['host']}: {h['ip']:<15} namespace {h['namespace']:<12} link {h['shaped'] or 'unshaped'}{extra}")
    if a.cmd == "up":
        print(f"\nrun a job across it:\n  {shlex.join(desc['launch'])} -n {len(desc['hosts'])} "
              f"ggpipe generate -m smollm2-135m -p \"Hello\" -n 32\nremove it:\n  "
              f"python {sys.argv[0]} down --name {desc['name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
