"""Link shapes that change during a run: the ``link_shape`` injector on a namespace-host bed.

A link is one host of a bed (`adaptipe.netbed`). Several ``link_shape`` injections may be
active on it at once; the newest gives the link its shape, and with none active the link
has the shape it had before the scenario first changed it. So an injection with a
duration is an excursion: when it ends, the link takes the shape of the newest one still
active, or its shape from before. One without a duration is a step: it holds until a
later step on the same link replaces it (the runner ends it then, reason ``replaced``,
without touching the link) or the runner stops, so a ladder of steps shows on the time
line as one span per step and the bed is left as it was found.

Shapes are put in place with `adaptipe.netbed.shape` (``tc ... change``: nothing queued is
dropped), which records them in the bed's state file. Every bed a scenario names is
looked up when the runner is built, so a bed that is not up, a host it does not have, or
a delay on a kernel without netem fails before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from adaptipe import netbed
from adaptipe.errors import AdaptipeError, NetbedError
from adaptipe.inject.scenario import Injection, LinkReshape, Scenario
from adaptipe.netbed import Bed, LinkShape
from adaptipe.netbed.system import namespaces

__all__ = ["LinkKey", "LinkLayer", "LinkShaper"]


@dataclass(frozen=True, slots=True)
class LinkKey:
    """One host's link on one bed (a bed is its prefix and the folder of its state file)."""

    prefix: str
    state_dir: str | None
    host: int

    @classmethod
    def of(cls, spec: LinkReshape) -> LinkKey:
        return cls(spec.bed, spec.state_dir, spec.host)

    def describe(self) -> str:
        return f"bed {self.prefix} host {self.host}"


@dataclass(slots=True)
class _Link:
    original: LinkShape | None = None  # before the first change; None until then
    applied: LinkShape | None = None  # what this shaper last put in place
    active: list[LinkLayer] = field(default_factory=list)  # oldest first


class LinkLayer:
    """One ``link_shape`` injection, as the runner's `Injector` (no processes)."""

    def __init__(self, shaper: LinkShaper, key: int, injection: Injection) -> None:
        assert isinstance(injection.spec, LinkReshape)
        self.key, self.injection, self._shaper = key, injection, shaper
        self.link = LinkKey.of(injection.spec)
        self.shape = injection.spec.shape
        self.step = injection.duration_s is None and injection.iterations is None
        self.restored: LinkShape | None = None  # what stop() put back, if it changed the link

    @property
    def pids(self) -> tuple[int, ...]:
        return ()

    def start(self) -> None:
        self._shaper.push(self)

    def wait_ready(self, timeout_s: float) -> None:
        return None

    def stop(self) -> None:
        self.restored = self._shaper.pop(self)


class LinkShaper:
    """The links a scenario reshapes; the runner calls it under its lock, one at a time."""

    def __init__(self, scenario: Scenario) -> None:
        self._links: dict[LinkKey, _Link] = {}
        beds: dict[tuple[str, str | None], Bed] = {}
        for inj in scenario.injections:
            if isinstance(inj.spec, LinkReshape):
                _check(scenario.source, inj, inj.spec, beds)

    def layer(self, key: int, injection: Injection) -> LinkLayer:
        return LinkLayer(self, key, injection)

    def replaced_by(self, layer: LinkLayer) -> list[int]:
        """The runner keys of the steps that ``layer``, a step just started, replaces."""
        if not layer.step:
            return []
        link = self._links.get(layer.link)
        active = link.active if link is not None else []
        return [other.key for other in active if other.step and other is not layer]

    def push(self, layer: LinkLayer) -> None:
        """Give the link ``layer``'s shape; nothing is recorded if ``tc`` fails."""
        link = self._links.setdefault(layer.link, _Link())
        if link.original is None:
            link.original = _bed(layer.link).host(layer.link.host).shape
            link.applied = link.original
        self._put(layer.link, link, layer.shape)
        link.active.append(layer)

    def pop(self, layer: LinkLayer) -> LinkShape | None:
        """Take ``layer`` off its link; the shape put back, or None if none changed."""
        link = self._links.get(layer.link)
        if link is None or layer not in link.active:
            return None  # it never started
        link.active.remove(layer)
        assert link.original is not None
        want = link.active[-1].shape if link.active else link.original
        if want == link.applied:
            return None
        self._put(layer.link, link, want)
        return want

    def _put(self, key: LinkKey, link: _Link, shape: LinkShape) -> None:
        if shape != link.applied:
            # Read the bed again: another process may have changed its other links.
            netbed.shape(_bed(key), key.host, shape, state_dir=key.state_dir)
            link.applied = shape


def _bed(key: LinkKey) -> Bed:
    return netbed.load(key.prefix, state_dir=key.state_dir)


def _check(
    source: str, inj: Injection, spec: LinkReshape, beds: dict[tuple[str, str | None], Bed]
) -> None:
    """Refuse, naming the file and entry, a link_shape this machine or its bed cannot do."""
    where = f"{source}: {inj.origin} (link_shape on bed {spec.bed} host {spec.host})"
    reason = netbed.available(netem=spec.shape.needs_netem)
    if reason is not None:
        base = netbed.available()
        needs = "needs a bed, which this machine cannot build" if base else "cannot shape here"
        raise NetbedError(f"{where} {needs}: {reason}")
    try:
        bed = beds.get((spec.bed, spec.state_dir))
        if bed is None:
            bed = beds.setdefault((spec.bed, spec.state_dir), _bed(LinkKey.of(spec)))
        host = bed.host(spec.host)
    except AdaptipeError as exc:
        raise type(exc)(f"{where}: {exc}") from None
    missing = [ns for ns in (bed.switch, host.namespace) if ns not in namespaces()]
    if missing:
        raise NetbedError(
            f"{where}: the bed is not running (it has a state file, but no namespace "
            f"{', '.join(missing)}); start it with `adaptipe hosts up --prefix {bed.prefix}`"
        )
