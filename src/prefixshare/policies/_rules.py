"""Admission rules: tiny callables that decide whether a prefix is stored in the shared KV store.

Each rule maps an :class:`AdmissionRequest` to a :class:`Decision` (truthy when admitted, with a short
machine-friendly ``reason``). Rules compose like tenacity's strategies::

    rule = MinTokens(256) & (Pinned("manual-*") | Frequency(2, "1h")) & ~TenantAllow("guest")

Composites evaluate their children left to right and short-circuit: ``a & b`` does not call ``b``
when ``a`` denies, ``a | b`` does not call ``b`` when ``a`` admits. A stateful rule (``Frequency``)
therefore only sees the requests that reach it; put cheap stateless rules first.

Every rule has a config form (:meth:`Rule.to_config`) parsed back by :func:`rule_from_config`; two
rules are equal when their parameters are equal, whatever runtime state they hold.
"""

from __future__ import annotations

import abc
import fnmatch
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar, cast, get_args

from prefixshare.errors import _MISSING, FieldProblem, PolicyError
from prefixshare._units import _exact_duration, _exact_size, parse_duration, parse_size

if TYPE_CHECKING:  # structlog is imported lazily, on first log call, to keep this module fast to import
    import structlog

T = TypeVar("T")
Per = Literal["total", "document", "tenant"]
_PER_VALUES: tuple[str, ...] = get_args(Per)


def _logger() -> structlog.stdlib.BoundLogger:
    """The module logger, built on use (rare events only) so that a later ``configure()`` applies."""
    from prefixshare._log import get_logger

    return get_logger(__name__)


# --------------------------------------------------------------------------------------------------
# Requests and decisions
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    """What a rule knows about one candidate prefix.

    ``kv_bytes`` is the estimated size of the prefix's KV cache; ``now`` the decision time in unix
    seconds (pass it explicitly for reproducible decisions); ``created_at`` when the cached prefix
    was first stored (``None`` if it is not stored yet), used by :class:`TTL`.
    """

    prompt_tokens: int
    document_id: str | None = None
    tenant: str | None = None
    prefix_digest: str | None = None
    kv_bytes: int = 0
    now: float = field(default_factory=time.time)
    created_at: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.prompt_tokens, bool) or not isinstance(self.prompt_tokens, int) or self.prompt_tokens < 0:
            raise ValueError(f"AdmissionRequest.prompt_tokens must be an int >= 0, got {self.prompt_tokens!r}")
        if isinstance(self.kv_bytes, bool) or not isinstance(self.kv_bytes, int) or self.kv_bytes < 0:
            raise ValueError(f"AdmissionRequest.kv_bytes must be an int >= 0, got {self.kv_bytes!r}")


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome of a rule: ``bool(decision)`` is ``admit``.

    ``reason`` is short and stable (``"min_tokens: 120 < 256"``), fit for logs and metrics labels
    once the numbers are stripped; ``rule`` is the config name of the rule that decided (the deciding
    child for a short-circuited composite, the composite itself when every child contributed).
    """

    admit: bool
    reason: str
    rule: str = ""

    def __bool__(self) -> bool:
        return self.admit


def _num(x: float) -> str:
    """Compact number for reasons: ``3600`` not ``3600.0``, at most 3 decimals."""
    if float(x).is_integer():
        return str(int(x))
    return f"{x:.3f}".rstrip("0").rstrip(".")


# --------------------------------------------------------------------------------------------------
# Validation: shared by keyword construction (loc "MinTokens(n)") and config parsing (exact path)
# --------------------------------------------------------------------------------------------------


class _Problems:
    """Collects every :class:`FieldProblem` of a parse so that one error lists them all."""

    def __init__(self) -> None:
        self.items: list[FieldProblem] = []

    def add(self, loc: str, value: object, message: str, fix: str = "") -> None:
        self.items.append(FieldProblem(loc=loc, value=value, message=message, fix=fix))

    def raise_if_any(self) -> None:
        if self.items:
            raise PolicyError(self.items)


def _strict(check: Callable[[Any, str, _Problems], T | None], value: Any, loc: str) -> T:
    """Run one validator for keyword construction: raise :class:`PolicyError` on any problem."""
    problems = _Problems()
    result = check(value, loc, problems)
    problems.raise_if_any()
    return cast(T, result)


def _positive_int(what: str, example: str) -> Callable[[Any, str, _Problems], int | None]:
    fix = f"expected a positive integer {what}, e.g. {example}"

    def check(value: Any, loc: str, problems: _Problems) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.add(loc, value, f"is not an integer (got {type(value).__name__})", fix)
            return None
        if value < 1:
            problems.add(loc, value, "is not positive", fix)
            return None
        return value

    return check


_tokens = _positive_int("number of tokens", "256")
_sightings = _positive_int("number of sightings", "2")
_max_keys = _positive_int("number of tracked keys", "100000")

_DURATION_FIX = "expected a positive duration: seconds (e.g. 3600) or a string like '30s', '15m', '1h', '7d'"
_SIZE_FIX = "expected a positive size: bytes or a string like '50GB' (powers of 1000) or '512MiB' (powers of 1024)"


def _duration(value: Any, loc: str, problems: _Problems) -> float | None:
    try:
        seconds = parse_duration(value)
    except ValueError:
        problems.add(loc, value, "is not a duration", _DURATION_FIX)
        return None
    if seconds <= 0:
        problems.add(loc, value, "is not positive", _DURATION_FIX)
        return None
    return seconds


def _size(value: Any, loc: str, problems: _Problems) -> int | None:
    try:
        size = parse_size(value)
    except ValueError:
        problems.add(loc, value, "is not a size", _SIZE_FIX)
        return None
    if size <= 0:
        problems.add(loc, value, "is not positive", _SIZE_FIX)
        return None
    return size


def _per(value: Any, loc: str, problems: _Problems) -> str | None:
    if value not in _PER_VALUES:
        problems.add(loc, value, "is not a budget scope", f"expected one of {', '.join(_PER_VALUES)}, e.g. per: tenant")
        return None
    return cast(str, value)


def _names(what: str, example: str) -> Callable[[Any, str, _Problems], tuple[str, ...] | None]:
    """A non-empty list of non-empty strings (a lone string counts as a list of one)."""
    fix = f"expected a non-empty list of {what}, e.g. {example}"

    def check(value: Any, loc: str, problems: _Problems) -> tuple[str, ...] | None:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            problems.add(loc, value, f"is not a list of {what}", fix)
            return None
        if not value:
            problems.add(loc, value, "is empty", fix)
            return None
        ok = True
        for i, item in enumerate(value):
            if not isinstance(item, str) or not item:
                problems.add(f"{loc}[{i}]", item, "is not a non-empty string", fix)
                ok = False
        return tuple(value) if ok else None

    return check


_doc_globs = _names("document id globs", "['manual-*', 'codebase']")
_tenant_names = _names("tenant names", "[acme, globex]")


def _suggest(name: str, known: Iterable[str]) -> str:
    """``"did you mean 'x'? "`` for the closest known name (ignoring case, dashes, camelCase), or ``""``."""
    import difflib  # only needed on errors

    known = list(known)

    def norm(s: str) -> str:
        return s.lower().replace("-", "_").replace(" ", "_")

    by_norm = {norm(k): k for k in known}
    close = difflib.get_close_matches(norm(name), list(by_norm), n=1, cutoff=0.6)
    if not close:  # "minTokens" -> "min_tokens": also compare with underscores removed
        flat = {k.replace("_", ""): k for k in by_norm}
        hit = difflib.get_close_matches(norm(name).replace("_", ""), list(flat), n=1, cutoff=0.6)
        close = [flat[hit[0]]] if hit else []
    return f"did you mean {by_norm[close[0]]!r}? " if close else ""


def _options(
    value: Any, loc: str, problems: _Problems, *, required: tuple[str, ...], optional: tuple[str, ...], example: str
) -> dict[str, Any] | None:
    """Check that ``value`` is a mapping of the allowed option names; return it (``None`` if not a mapping).

    Unknown and missing options are recorded as problems; the known options present are returned so
    that the caller can validate them too and report every problem at once.
    """
    allowed = required + optional
    if not isinstance(value, Mapping):
        problems.add(
            loc, value, "is not a mapping of options", f"expected a mapping with {', '.join(allowed)}, e.g. {example}"
        )
        return None
    for key in value:
        if key not in allowed:
            hint = _suggest(key, allowed) if isinstance(key, str) else ""
            problems.add(f"{loc}.{key}", value[key], "is not a known option", f"{hint}options: {', '.join(allowed)}")
    for key in required:
        if key not in value:
            problems.add(f"{loc}.{key}", _MISSING, "is required", f"e.g. {example}")
    return {key: value[key] for key in allowed if key in value}


# --------------------------------------------------------------------------------------------------
# Base class and composites
# --------------------------------------------------------------------------------------------------


class Rule(abc.ABC):
    """An admission rule: ``rule(request) -> Decision``; compose with ``&``, ``|`` and ``~``.

    Subclasses set :attr:`name` (the config key), implement :meth:`__call__`, :meth:`to_config` and
    :meth:`_params` (the constructor parameters: the basis of ``==``, ``hash`` and ``repr``).
    """

    #: The rule's name in config files, also reported as :attr:`Decision.rule`.
    name: ClassVar[str]
    #: A config example shown in error messages.
    example: ClassVar[str]

    @abc.abstractmethod
    def __call__(self, req: AdmissionRequest) -> Decision:
        """Decide on ``req``."""

    @abc.abstractmethod
    def to_config(self) -> Any:
        """The YAML/JSON-able form of this rule; :func:`rule_from_config` parses it back to an equal rule."""

    @abc.abstractmethod
    def _params(self) -> tuple[Any, ...]:
        """The parameters that define this rule (never its runtime state)."""

    def __and__(self, other: object) -> Rule:
        return AllOf(self, other) if isinstance(other, Rule) else NotImplemented

    def __or__(self, other: object) -> Rule:
        return AnyOf(self, other) if isinstance(other, Rule) else NotImplemented

    def __invert__(self) -> Rule:
        return Not(self)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Rule):
            return NotImplemented
        return type(self) is type(other) and self._params() == other._params()

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._params()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(repr, self._params()))})"


class _Combination(Rule):
    """Shared code of :class:`AllOf` and :class:`AnyOf`: an ordered, flattened tuple of rules."""

    _symbol: ClassVar[str]

    def __init__(self, *rules: Rule) -> None:
        if not rules:
            raise PolicyError(
                [FieldProblem(f"{type(self).__name__}()", _MISSING, "needs at least one rule", f"e.g. {self.example}")]
            )
        flat: list[Rule] = []
        for i, rule in enumerate(rules):
            if not isinstance(rule, Rule):
                raise PolicyError(
                    [
                        FieldProblem(
                            f"{type(self).__name__}()[{i}]",
                            rule,
                            "is not a Rule",
                            "pass Rule instances such as MinTokens(256)",
                        )
                    ]
                )
            # Flatten nested same-kind combinations: (a & b) & c is AllOf(a, b, c).
            flat.extend(rule.rules if type(rule) is type(self) else (rule,))
        self.rules: tuple[Rule, ...] = tuple(flat)

    def _params(self) -> tuple[Any, ...]:
        return self.rules

    def to_config(self) -> dict[str, Any]:
        return {self.name: [rule.to_config() for rule in self.rules]}

    def __repr__(self) -> str:
        if len(self.rules) == 1:
            return f"{type(self).__name__}({self.rules[0]!r})"
        return f" {self._symbol} ".join(f"({r!r})" if isinstance(r, _Combination) else repr(r) for r in self.rules)

    @classmethod
    def _from_config(cls, value: Any, loc: str, problems: _Problems) -> Rule | None:
        fix = f"expected a non-empty list of rules, e.g. {cls.example}"
        if not isinstance(value, (list, tuple)):
            problems.add(loc, value, "is not a list of rules", fix)
            return None
        if not value:
            problems.add(loc, value, "is empty", fix)
            return None
        children = [_parse(item, f"{loc}[{i}]", problems) for i, item in enumerate(value)]
        if any(child is None for child in children):
            return None
        return cls(*cast(list[Rule], children))


class AllOf(_Combination):
    """``a & b & ...``: admits when every rule admits.

    Denied: the first denying rule's decision (later rules are not called). Admitted: the reasons of
    all rules joined with ``"; "``, ``rule == "all"``.
    """

    name = "all"
    example = "all: [{min_tokens: 256}, {ttl: 7d}]"
    _symbol = "&"

    def __call__(self, req: AdmissionRequest) -> Decision:
        reasons = []
        for rule in self.rules:
            decision = rule(req)
            if not decision.admit:
                return decision
            reasons.append(decision.reason)
        return Decision(True, "; ".join(reasons), self.name)


class AnyOf(_Combination):
    """``a | b | ...``: admits when at least one rule admits.

    Admitted: the first admitting rule's decision (later rules are not called). Denied: the reasons
    of all rules joined with ``"; "``, ``rule == "any"``.
    """

    name = "any"
    example = "any: [{pinned: ['manual-*']}, {frequency: {n: 2, window: 1h}}]"
    _symbol = "|"

    def __call__(self, req: AdmissionRequest) -> Decision:
        reasons = []
        for rule in self.rules:
            decision = rule(req)
            if decision.admit:
                return decision
            reasons.append(decision.reason)
        return Decision(False, "; ".join(reasons), self.name)


class Not(Rule):
    """``~a``: admits when ``a`` denies; reason ``"not(<a's reason>)"``. ``~Not(a)`` is ``a`` itself."""

    name = "not"
    example = "not: {tenant_allow: [guest]}"

    def __init__(self, rule: Rule) -> None:
        if not isinstance(rule, Rule):
            raise PolicyError(
                [FieldProblem("Not(rule)", rule, "is not a Rule", "pass a Rule instance such as TenantAllow('guest')")]
            )
        self.rule = rule

    def __call__(self, req: AdmissionRequest) -> Decision:
        inner = self.rule(req)
        return Decision(not inner.admit, f"not({inner.reason})", self.name)

    def __invert__(self) -> Rule:
        return self.rule

    def _params(self) -> tuple[Any, ...]:
        return (self.rule,)

    def to_config(self) -> dict[str, Any]:
        return {self.name: self.rule.to_config()}

    def __repr__(self) -> str:
        inner = repr(self.rule)
        return f"~({inner})" if isinstance(self.rule, _Combination) and len(self.rule.rules) > 1 else f"~{inner}"

    @classmethod
    def _from_config(cls, value: Any, loc: str, problems: _Problems) -> Rule | None:
        child = _parse(value, loc, problems)
        return None if child is None else cls(child)


# --------------------------------------------------------------------------------------------------
# Stateless rules
# --------------------------------------------------------------------------------------------------


class _NoArgs(Rule):
    """Shared code of :class:`Always` and :class:`Never`: config form is the bare name."""

    def _params(self) -> tuple[Any, ...]:
        return ()

    def to_config(self) -> str:
        return self.name

    @classmethod
    def _from_config(cls, value: Any, loc: str, problems: _Problems) -> Rule | None:
        if value is None or value is True or value == {}:
            return cls()
        problems.add(loc, value, "takes no value", f"write just '{cls.name}' (or {cls.name}: true)")
        return None


class Always(_NoArgs):
    """Admits everything (reason ``"always"``): the identity of ``&``."""

    name = "always"
    example = "always"

    def __call__(self, req: AdmissionRequest) -> Decision:
        return Decision(True, "always", self.name)


class Never(_NoArgs):
    """Denies everything (reason ``"never"``): the identity of ``|``."""

    name = "never"
    example = "never"

    def __call__(self, req: AdmissionRequest) -> Decision:
        return Decision(False, "never", self.name)


class MinTokens(Rule):
    """Admits prompts of at least ``n`` tokens: short prefixes are cheaper to recompute than to fetch."""

    name = "min_tokens"
    example = "min_tokens: 256"

    def __init__(self, n: int) -> None:
        self.n: int = _strict(_tokens, n, "MinTokens(n)")

    def __call__(self, req: AdmissionRequest) -> Decision:
        if req.prompt_tokens >= self.n:
            return Decision(True, f"min_tokens: {req.prompt_tokens} >= {self.n}", self.name)
        return Decision(False, f"min_tokens: {req.prompt_tokens} < {self.n}", self.name)

    def _params(self) -> tuple[Any, ...]:
        return (self.n,)

    def to_config(self) -> dict[str, Any]:
        return {self.name: self.n}

    @classmethod
    def _from_config(cls, value: Any, loc: str, problems: _Problems) -> Rule | None:
        n = _tokens(value, loc, problems)
        return None if n is None else cls(n)


class Pinned(Rule):
    """Admits requests whose ``document_id`` matches one of the globs (``fnmatch``, case-sensitive).

    Reasons: ``"pinned: doc 'manual-*'"`` (the matching glob), ``"not pinned"``, or
    ``"not pinned: no document_id"``.
    """

    name = "pinned"
    example = "pinned: ['manual-*', 'codebase']"

    def __init__(self, *doc_globs: str) -> None:
        self.doc_globs: tuple[str, ...] = _strict(_doc_globs, doc_globs, "Pinned(doc_globs)")

    def __call__(self, req: AdmissionRequest) -> Decision:
        if req.document_id is None:
            return Decision(False, "not pinned: no document_id", self.name)
        for glob in self.doc_globs:
            if fnmatch.fnmatchcase(req.document_id, glob):
                return Decision(True, f"pinned: doc {glob!r}", self.name)
        return Decision(False, "not pinned", self.name)

    def _params(self) -> tuple[Any, ...]:
        return self.doc_globs

    def to_config(self) -> dict[str, Any]:
        return {self.name: list(self.doc_globs)}

    @classmethod
    def _from_config(cls, value: Any, loc: str, problems: _Problems) -> Rule | None:
        globs = _doc_globs(value, loc, problems)
        return None if globs is None else cls(*globs)


class TenantAllow(Rule):
    """Admits requests from the listed tenants; combine with ``~`` to deny a list instead."""

    name = "tenant_allow"
    example = "tenant_allow: [acme, globex]"

    def __init__(self, *tenants: str) -> None:
        self.tenants: tuple[str, ...] = _strict(_tenant_names, tenants, "TenantAllow(tenants)")

    def __call__(self, req: AdmissionRequest) -> Decision:
        if req.tenant is None:
            return Decision(False, "tenant_allow: no tenant", self.name)
        if req.tenant in self.tenants:
            return Decision(True, f"tenant_allow: {req.tenant!r}", self.name)
        return Decision(False, f"tenant_allow: {req.tenant!r} not allowed", self.name)

    def _params(self) -> tuple[Any, ...]:
        return self.tenants

    def to_config(self) -> dict[str, Any]:
        return {self.name: list(self.tenants)}

    @classmethod
    def _from_config(cls, value: Any, loc: str, problems: _Problems) -> Rule | None:
        tenants = _tenant_names(value, loc, problems)
        return None if tenants is None else cls(*tenants)


class TTL(Rule):
    """Denies a cached prefix older than ``seconds`` (``now - created_at > seconds``).

    Admits when ``created_at`` is ``None`` (not stored yet). ``seconds`` also accepts ``"7d"``.
    """

    name = "ttl"
    example = "ttl: 7d"

    def __init__(self, seconds: float | str) -> None:
        self.seconds: float = _strict(_duration, seconds, "TTL(seconds)")

    def __call__(self, req: AdmissionRequest) -> Decision:
        if req.created_at is None:
            return Decision(True, "ttl: no created_at", self.name)
        age = req.now - req.created_at
        if age > self.seconds:
            return Decision(False, f"ttl: expired {_num(age - self.seconds)}s ago", self.name)
        return Decision(True, f"ttl: age {_num(age)}s <= {_num(self.seconds)}s", self.name)

    def _params(self) -> tuple[Any, ...]:
        return (self.seconds,)

    def to_config(self) -> dict[str, Any]:
        return {self.name: _exact_duration(self.seconds)}

    @classmethod
    def _from_config(cls, value: Any, loc: str, problems: _Problems) -> Rule | None:
        seconds = _duration(value, loc, problems)
        return None if seconds is None else cls(seconds)


# --------------------------------------------------------------------------------------------------
# Stateful rules (thread-safe)
# --------------------------------------------------------------------------------------------------


class Frequency(Rule):
    """Admits a prefix once it has been seen ``n`` times within the last ``window_s`` seconds.

    Every call is a sighting: it is recorded at ``req.now`` under ``req.prefix_digest`` (or
    ``req.document_id`` when there is no digest; a request with neither is denied, it cannot be
    counted). Sightings at ``t >= now - window_s`` count.

    Memory is bounded: each key keeps at most its ``n`` latest timestamps, and at most ``max_keys``
    keys are tracked; past that, the least recently seen key is forgotten (LRU). Forgetting only
    delays admission (that prefix must be seen ``n`` times again), it never admits wrongly. Budget
    roughly ``max_keys * (n * 8 + ~200)`` bytes. Safe to call from several threads.
    """

    name = "frequency"
    example = "frequency: {n: 2, window: 1h}"
    DEFAULT_MAX_KEYS: ClassVar[int] = 100_000

    def __init__(self, n: int, window_s: float | str, *, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        self.n: int = _strict(_sightings, n, "Frequency(n)")
        self.window_s: float = _strict(_duration, window_s, "Frequency(window_s)")
        self.max_keys: int = _strict(_max_keys, max_keys, "Frequency(max_keys)")
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, deque[float]] = OrderedDict()
        self._warned_full = False

    @staticmethod
    def _key(req: AdmissionRequest) -> str | None:
        return req.prefix_digest if req.prefix_digest is not None else req.document_id

    def _count(self, stamps: deque[float], now: float) -> int:
        cutoff = now - self.window_s
        return sum(1 for t in stamps if t >= cutoff)

    def __call__(self, req: AdmissionRequest) -> Decision:
        key = self._key(req)
        if key is None:
            return Decision(False, "frequency: no prefix_digest or document_id", self.name)
        evicted = False
        with self._lock:
            stamps = self._seen.get(key)
            if stamps is None:
                stamps = self._seen[key] = deque(maxlen=self.n)
                if len(self._seen) > self.max_keys:
                    self._seen.popitem(last=False)
                    evicted = not self._warned_full
                    self._warned_full = True
            else:
                self._seen.move_to_end(key)
            stamps.append(req.now)
            seen = self._count(stamps, req.now)
        if evicted:
            _logger().info("frequency.table_full", max_keys=self.max_keys, action="evicting least recently seen keys")
        window = _num(self.window_s)
        if seen >= self.n:
            return Decision(True, f"frequency: seen {seen} >= {self.n} in {window}s", self.name)
        return Decision(False, f"frequency: seen {seen} < {self.n} in {window}s", self.name)

    def count(self, req: AdmissionRequest) -> int:
        """Sightings of ``req``'s key within the window at ``req.now`` (capped at ``n``); records nothing."""
        key = self._key(req)
        with self._lock:
            stamps = self._seen.get(key) if key is not None else None
            return 0 if stamps is None else self._count(stamps, req.now)

    @property
    def tracked_keys(self) -> int:
        """How many keys the table holds now (at most ``max_keys``)."""
        with self._lock:
            return len(self._seen)

    def reset(self) -> None:
        """Forget every sighting."""
        with self._lock:
            self._seen.clear()

    def _params(self) -> tuple[Any, ...]:
        return (self.n, self.window_s, self.max_keys)

    def __repr__(self) -> str:
        extra = "" if self.max_keys == self.DEFAULT_MAX_KEYS else f", max_keys={self.max_keys}"
        return f"Frequency(n={self.n}, window_s={self.window_s!r}{extra})"

    def to_config(self) -> dict[str, Any]:
        options: dict[str, Any] = {"n": self.n, "window": _exact_duration(self.window_s)}
        if self.max_keys != self.DEFAULT_MAX_KEYS:
            options["max_keys"] = self.max_keys
        return {self.name: options}

    @classmethod
    def _from_config(cls, value: Any, loc: str, problems: _Problems) -> Rule | None:
        before = len(problems.items)
        options = _options(value, loc, problems, required=("n", "window"), optional=("max_keys",), example=cls.example)
        if options is None:
            return None
        n = _sightings(options["n"], f"{loc}.n", problems) if "n" in options else None
        window = _duration(options["window"], f"{loc}.window", problems) if "window" in options else None
        max_keys = _max_keys(options.get("max_keys", cls.DEFAULT_MAX_KEYS), f"{loc}.max_keys", problems)
        if len(problems.items) > before or n is None or window is None or max_keys is None:
            return None
        return cls(n, window, max_keys=max_keys)


class ByteBudget(Rule):
    """Admits a prefix while the bytes stored so far plus ``req.kv_bytes`` stay within ``max_bytes``.

    ``per`` picks the bucket that is budgeted: ``"total"`` (one bucket), ``"document"`` (one per
    ``document_id``) or ``"tenant"`` (one per ``tenant``); requests without that field share a bucket.
    ``max_bytes`` also accepts ``"50GB"`` or ``"512MiB"``.

    Calling the rule only *checks*. A decision is not a write: a composite may deny the prefix after
    this rule admitted it, the engine may skip or fail the store, and the eviction of a prefix is
    only known later. So the caller records what was actually stored with :meth:`commit` and what
    left the store with :meth:`release`. A ``prefix_digest`` is counted once: committing it again is a
    no-op, and a check for an already committed digest admits (it needs no new bytes).

    Thread-safe; the check and the commit are separate steps, so concurrent writers may overshoot
    the budget by at most the prefixes in flight between their check and their commit.
    """

    name = "byte_budget"
    example = "byte_budget: {max: 50GB, per: tenant}"

    def __init__(self, max_bytes: int | str, per: Per = "total") -> None:
        self.max_bytes: int = _strict(_size, max_bytes, "ByteBudget(max_bytes)")
        self.per: Per = cast(Per, _strict(_per, per, "ByteBudget(per)"))
        self._lock = threading.Lock()
        self._used: dict[str | None, int] = {}
        self._committed: dict[str, tuple[str | None, int]] = {}  # prefix_digest -> (bucket, bytes)

    def _bucket(self, req: AdmissionRequest) -> str | None:
        if self.per == "tenant":
            return req.tenant
        if self.per == "document":
            return req.document_id
        return None

    def _scope(self, bucket: str | None) -> str:
        if self.per == "total":
            return "total"
        return f"{self.per} {bucket!r}" if bucket is not None else f"{self.per} <none>"

    def __call__(self, req: AdmissionRequest) -> Decision:
        bucket = self._bucket(req)
        with self._lock:
            if req.prefix_digest is not None and req.prefix_digest in self._committed:
                return Decision(True, "byte_budget: already counted", self.name)
            used = self._used.get(bucket, 0)
        total = used + req.kv_bytes
        scope = self._scope(bucket)
        if total > self.max_bytes:
            return Decision(False, f"byte_budget: {scope} {used}+{req.kv_bytes} > {self.max_bytes} bytes", self.name)
        return Decision(True, f"byte_budget: {scope} {used}+{req.kv_bytes} <= {self.max_bytes} bytes", self.name)

    def commit(self, req: AdmissionRequest) -> bool:
        """Record that ``req``'s prefix (``req.kv_bytes``) was stored.

        Returns ``False`` (and records nothing) when ``req.prefix_digest`` was already committed.
        Commits are recorded even past the budget: they describe what the store holds.
        """
        bucket = self._bucket(req)
        with self._lock:
            if req.prefix_digest is not None:
                if req.prefix_digest in self._committed:
                    return False
                self._committed[req.prefix_digest] = (bucket, req.kv_bytes)
            used = self._used[bucket] = self._used.get(bucket, 0) + req.kv_bytes
        if used > self.max_bytes:
            _logger().warning("byte_budget.over", scope=self._scope(bucket), used_bytes=used, max_bytes=self.max_bytes)
        return True

    def release(self, req_or_digest: AdmissionRequest | str) -> int:
        """Record that a prefix left the store; return the bytes released.

        Pass the ``prefix_digest`` given to :meth:`commit` (its recorded bytes and bucket are used),
        or a request: by its digest when that was committed, else ``req.kv_bytes`` from its bucket.
        A bucket never goes below zero; an unknown digest releases nothing.
        """
        with self._lock:
            digest = req_or_digest if isinstance(req_or_digest, str) else req_or_digest.prefix_digest
            if digest is not None and digest in self._committed:
                bucket, size = self._committed.pop(digest)
            elif isinstance(req_or_digest, AdmissionRequest):
                bucket, size = self._bucket(req_or_digest), req_or_digest.kv_bytes
            else:
                bucket, size = None, 0
            used = self._used.get(bucket, 0)
            size = min(size, used)
            if used - size:
                self._used[bucket] = used - size
            else:
                self._used.pop(bucket, None)
        if size == 0 and isinstance(req_or_digest, str):
            _logger().debug("byte_budget.release_unknown", digest=req_or_digest)
        return size

    def used(self, req: AdmissionRequest | None = None) -> int:
        """Bytes committed in ``req``'s bucket, or in all buckets together when ``req`` is None."""
        with self._lock:
            if req is None:
                return sum(self._used.values())
            return self._used.get(self._bucket(req), 0)

    def usage(self) -> dict[str | None, int]:
        """A snapshot: bytes committed per bucket (key ``None`` for ``per="total"`` or a missing field)."""
        with self._lock:
            return dict(self._used)

    def reset(self) -> None:
        """Forget every commit."""
        with self._lock:
            self._used.clear()
            self._committed.clear()

    def _params(self) -> tuple[Any, ...]:
        return (self.max_bytes, self.per)

    def __repr__(self) -> str:
        return f"ByteBudget(max_bytes={self.max_bytes}, per={self.per!r})"

    def to_config(self) -> dict[str, Any]:
        return {self.name: {"max": _exact_size(self.max_bytes), "per": self.per}}

    @classmethod
    def _from_config(cls, value: Any, loc: str, problems: _Problems) -> Rule | None:
        if not isinstance(value, Mapping):  # shorthand: byte_budget: 50GB (per total)
            max_bytes = _size(value, loc, problems)
            return None if max_bytes is None else cls(max_bytes)
        before = len(problems.items)
        options = _options(value, loc, problems, required=("max",), optional=("per",), example=cls.example)
        if options is None:
            return None
        max_bytes = _size(options["max"], f"{loc}.max", problems) if "max" in options else None
        per = _per(options.get("per", "total"), f"{loc}.per", problems)
        if len(problems.items) > before or max_bytes is None or per is None:
            return None
        return cls(max_bytes, cast(Per, per))


# --------------------------------------------------------------------------------------------------
# Config parsing
# --------------------------------------------------------------------------------------------------

_RULES: dict[str, type[Any]] = {
    cls.name: cls
    for cls in (AllOf, AnyOf, Not, MinTokens, Pinned, Frequency, TTL, ByteBudget, TenantAllow, Always, Never)
}
_KNOWN = ", ".join(sorted(_RULES))


def _parse(obj: Any, loc: str, problems: _Problems) -> Rule | None:
    """Parse one rule at ``loc``, recording problems instead of raising."""
    if isinstance(obj, Rule):
        return obj
    if isinstance(obj, str):
        cls = _RULES.get(obj)
        if cls is None:
            problems.add(loc, obj, "is not a known rule", f"{_suggest(obj, _RULES)}known rules: {_KNOWN}")
            return None
        if not issubclass(cls, _NoArgs):
            problems.add(loc, obj, "needs a value", f"write it as a mapping, e.g. {cls.example}")
            return None
        return cast(Rule, cls())
    if isinstance(obj, (list, tuple)):
        problems.add(
            loc, obj, "is a list, not a rule", "wrap the list in all: (every rule must admit) or any: (one suffices)"
        )
        return None
    if not isinstance(obj, Mapping):
        problems.add(
            loc,
            obj,
            "is not a rule",
            f"expected a mapping with one rule name, e.g. {{min_tokens: 256}}; known rules: {_KNOWN}",
        )
        return None
    if len(obj) != 1:
        fix = (
            "write one rule per mapping and combine several with all: or any:, e.g. all: [{min_tokens: 256}, {ttl: 7d}]"
            if obj
            else f"expected a mapping with one rule name, e.g. {{min_tokens: 256}}; known rules: {_KNOWN}"
        )
        problems.add(loc, obj, f"has {len(obj)} rule names, expected exactly 1", fix)
        return None
    ((name, value),) = obj.items()
    cls = _RULES.get(name) if isinstance(name, str) else None
    if cls is None:
        hint = _suggest(name, _RULES) if isinstance(name, str) else ""
        problems.add(loc, name, "is not a known rule", f"{hint}known rules: {_KNOWN}")
        return None
    return cast(Rule | None, cls._from_config(value, f"{loc}.{name}", problems))


def rule_from_config(obj: Any, loc: str = "admission") -> Rule:
    """Parse the config form of a rule (as loaded from YAML/JSON); a :class:`Rule` is returned as is.

    Grammar: a rule is a mapping with exactly one rule name, or a bare ``always`` / ``never``::

        all: [<rule>, ...]        # every rule admits (short-circuits on the first denial)
        any: [<rule>, ...]        # one rule admits (short-circuits on the first admission)
        not: <rule>
        min_tokens: 256
        pinned: ["manual-*", codebase]          # fnmatch globs on document_id
        tenant_allow: [acme, globex]
        ttl: 7d                                 # seconds or 30s / 15m / 1h / 7d
        frequency: {n: 2, window: 1h, max_keys: 100000}   # max_keys optional
        byte_budget: {max: 50GB, per: tenant}   # per: total (default) | document | tenant
        byte_budget: 512MiB                     # shorthand, per total

    Raises :class:`~prefixshare.errors.PolicyError` listing every problem, each located by its exact
    path below ``loc`` (``admission.all[1].any[0].pinned``) with the expected form.
    """
    problems = _Problems()
    rule = _parse(obj, loc, problems)
    problems.raise_if_any()
    assert rule is not None
    return rule
