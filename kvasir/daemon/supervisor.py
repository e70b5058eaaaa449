"""The instances' children and their restart-window state machines, apart from the
launcher's process plumbing (which it reaches through ``Plumbing``), so it is tested on
its own with stand-in processes and a clock.

Each instance (kvasir/config/fleet.py) is "up" while it serves. A failure of one of its
children (it exited or went silent, its host went missing) takes it "down": its
requests are told, its children are killed, and a restart waits out its policy's
back-off (kvasir/daemon/supervision.py); then "starting" (new children loading) until
every child is ready and the bridge routes to it again, back to "up". The other
instances serve on. Too many failures of one instance within the window and it is
"failed": nothing is routed to it again. An instance with a worker on a standby host
(kvasir/config/cluster.py) or a drained one (``kvasir hosts drain``) is "parked" while
that host's ``kvasird join`` is not there (or is the one it was drained under): no
children, nothing routed; once the host joins it is "joining" (loading) and then up,
without a restart of the others. The daemon gives up (``failed`` returns False
and the launcher stops everything) when every instance of a pool has failed, or on a
failure while it drains. A disaggregated plan's instances are one failure domain (a
request's life spans a prefill and a decode instance), and the bridge's death fails
every instance.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from kvasir.config.sections import Pool
from kvasir.daemon.children import BRIDGE, Child, ChildId, ending
from kvasir.daemon.instances import EVERY, Failure, Instance, InstanceState, OpenError, Plumbing
from kvasir.daemon.remote import RemoteProcess
from kvasir.daemon.supervision import Heartbeats
from kvasir.logs import Logger
from kvasir.wire.control import EdgeHandles, Heartbeat, Ready

__all__ = ["EVERY", "Failure", "Instance", "OpenError", "RingSupervisor"]


@dataclass
class RingSupervisor:
    instances: list[Instance]
    heartbeats: Heartbeats
    plumbing: Plumbing
    ready_s: float  # how long new children may take to be ready
    log: Logger
    bridge: Child | None = None
    new_bridge: bool = False  # spawned and not yet serving: opening it waits for its endpoint
    last_failure: str = ""
    domains: dict[str, tuple[str, ...]] = field(default_factory=dict)  # instance -> what fails with it

    @property
    def stages(self) -> list[Child]:
        """Every instance's children (each instance's stages, then its shards)."""
        return [child for instance in self.instances for child in instance.children]

    @property
    def children(self) -> list[Child]:
        return self.stages + ([self.bridge] if self.bridge is not None else [])

    @property
    def ready(self) -> bool:
        return all(child.ready for child in self.children)

    @property
    def serving(self) -> bool:
        """Some instance serves (and the bridge is there)."""
        return self.bridge is not None and any(i.state == "up" for i in self.instances)

    @property
    def settled(self) -> bool:
        """No instance is down, starting, moving or joining, nor parked with its hosts back."""
        return all(i.state in ("up", "failed") or (i.state == "parked" and not self._back(i)) for i in self.instances)

    def _back(self, instance: Instance) -> bool:
        """A parked instance's hosts are all there (it may join)."""
        hosts = self.plumbing.hosts
        return hosts is None or hosts.available(instance.hosts)

    @property
    def restarts(self) -> int:
        return sum(i.restarts for i in self.instances)

    def instance(self, name: str) -> Instance:
        return next(i for i in self.instances if i.name == name)

    def spawn_missing(self) -> None:
        """Start the children of every instance that has none, and a bridge if there is none."""
        for instance in self.instances:
            if not instance.children and instance.state not in ("failed", "parked"):
                instance.children = self.plumbing.spawn_children(instance.ids)
        if self.bridge is None:
            [self.bridge] = self.plumbing.spawn_children([BRIDGE])
            self.new_bridge = True

    def open(self, deadline: float) -> None:
        """Start-up: every child is ready, the bridge serves every instance (raises OpenError)."""
        self.plumbing.open(EVERY, 0, self.new_bridge, deadline)
        self.new_bridge = False
        for instance in self.instances:
            if instance.state != "parked":
                instance.state = "up"

    # -- what the children say --------------------------------------------------------
    def note(self, messages: Iterable[Ready | Heartbeat | EdgeHandles], now: float) -> list[EdgeHandles]:
        """Readiness and heartbeats, matched to the current children by id and pid; the
        CUDA IPC halves from current stages, to be passed on (a replaced child's are dropped)."""
        halves = []
        for message in messages:
            role = "stage" if isinstance(message, EdgeHandles) else message.role
            child = self._current(ChildId(role, message.index if role != "bridge" else 0), message.pid)
            if child is None:
                continue  # from a child that has already been replaced
            if isinstance(message, EdgeHandles):
                halves.append(message)
            elif isinstance(message, Ready):
                child.ready = True
                self.heartbeats.watch(child.name, now)
            else:
                self.heartbeats.beat(child.name, now)
        return halves

    def _current(self, wanted: ChildId, pid: int) -> Child | None:
        child = next((c for c in self.children if c.id == wanted and c.process.pid == pid), None)
        if child is None:  # a follower's worker may say it is ready before its follower says it started
            child = next((c for c in self.children if c.id == wanted and c.process.pid is None), None)
            if child is not None and isinstance(child.process, RemoteProcess):
                child.process.pid = pid
            else:
                child = None
        return child

    # -- failures -----------------------------------------------------------------------
    def lost(self, now: float) -> str | None:
        """A host gone silent, or a child that exited: what to report (during start-up)."""
        failure = self._lost(now)
        return failure.reason if failure is not None else None

    def _lost(self, now: float) -> Failure | None:
        hosts = self.plumbing.hosts
        missing = hosts.missing(now) if hosts is not None else None  # its workers are marked lost
        dead = next((child for child in self.children if child.process.poll() is not None), None)
        if dead is None:
            return None
        if missing is not None:  # before its workers' silence: the host is what failed
            lost = [c for c in self.stages if c.process.poll() is not None]
            return self._of(missing, {c.id.instance for c in lost})
        how = ending(dead.process.returncode or 0)  # set: the child is dead
        why = getattr(dead.process, "reason", "")  # a follower's worker: what its follower or the link said
        return self._of(
            f"{dead.name} (pid {dead.process.pid}) {how}" + (f": {why}" if why else ""), {dead.id.instance}, dead
        )

    def _of(self, reason: str, names: set[str], child: Child | None = None) -> Failure:
        """The instances a failure takes down: the named ones and their domains; every
        one when the bridge is what failed."""
        if child is not None and child.id.role == "bridge":
            return Failure(reason, tuple(i.name for i in self.instances))
        down = {other for name in names for other in self.domains.get(name, (name,))}
        return Failure(reason, tuple(i.name for i in self.instances if i.name in down))

    def failure(self, now: float) -> Failure | None:
        """What has gone wrong with a child, if anything: it exited, or it went silent (then killed)."""
        lost = self._lost(now)
        if lost is not None:
            return lost
        silent = self.heartbeats.silent(now)
        if silent is None:
            return None
        name, quiet_s = silent
        child = next(c for c in self.children if c.name == name)
        if isinstance(child.process, RemoteProcess) and self.plumbing.hosts is not None:
            gone = self.plumbing.hosts.silent_host(child.process.host, now)
            if gone is not None:  # its follower has gone quiet too: the host is what failed
                return self._lost(now) or self._of(gone, {child.id.instance}, child)
        self.kill([child])
        return self._of(
            f"{name} (pid {child.process.pid}) hung: no heartbeat for {quiet_s:.1f} s; killed it",
            {child.id.instance},
            child,
        )

    def failed(self, failure: Failure, now: float, serving: bool) -> bool:
        """Children failed: tell the requests of the instances it took down, kill their
        children, and schedule each one's restart after its back-off. False: give up (the
        daemon is not serving, or every instance of a pool has failed for good); the
        launcher then stops everything."""
        self.log.error("child failed", reason=failure.reason, instances=list(failure.instances))
        self.last_failure = failure.reason
        bridge = self.bridge
        bridge_dead = bridge is None or bridge.process.poll() is not None
        if bridge_dead:
            self.kill([bridge] if bridge is not None else [])
            self.bridge = None
            self.plumbing.bridge_gone()
        for name in failure.instances:
            if self.instance(name).state != "parked":
                self._down(self.instance(name), failure.reason, now, serving and not bridge_dead)
        if not serving:
            return False
        gave_up = self._pool_gone()
        if gave_up is not None:
            self.log.error("giving up", pool=gave_up or "(colocated)", reason="every instance failed past its restarts")
            return False
        return True

    def _down(self, instance: Instance, reason: str, now: float, tell: bool) -> None:
        self.kill(instance.children)
        instance.children = []
        instance.last_failure = reason
        if tell:
            self.plumbing.ring_down(instance.name, reason)
        delay = instance.policy.failed(now)
        if delay is None:
            instance.state = "failed"
            self.log.error(
                "instance failed for good",
                instance=instance.name,
                restarts=instance.restarts,
                max_restarts=instance.policy.max_restarts,
                window_s=instance.policy.window_s,
            )
            return
        instance.state = "down"
        instance.respawn_at = now + delay
        self.plumbing.status(f"restarting {instance.name} in {delay:g} s after: {reason}")
        self.log.info("restarting", instance=instance.name, delay_s=delay)

    def move(self, name: str, pool: Pool, now: float) -> None:
        """The bridge says a moving instance holds no request: its children regroup in
        ``pool`` (the same processes; state "moving" until each stage is ready again and
        the bridge serves it there; one that is not in time fails the instance, which then
        restarts in ``pool``). An instance that is not up (a failure overtook the move) is
        left to its restart."""
        instance = next((i for i in self.instances if i.name == name), None)
        if instance is None or instance.state != "up":
            self.log.warning("move dropped: the instance is not serving", instance=name, pool=pool)
            return
        instance.pool = pool
        instance.ids = [replace(child, pool=pool) for child in instance.ids]
        for child in instance.children:
            child.ready = child.id.role != "stage"  # a shard changes nothing but its stats' pool
        self.plumbing.regroup(instance.children, pool)
        instance.state = "moving"
        instance.deadline = now + self.ready_s
        self.log.info("moving", instance=name, pool=pool)
        self.plumbing.status(f"moving {name} to the {pool} pool")

    def park(self, name: str) -> None:
        """The bridge says an instance on a host being drained holds no request: stop its
        children; it stays parked until its host joins again (an instance that is not up
        is left to its restart, which parks it while the host is away)."""
        instance = next((i for i in self.instances if i.name == name), None)
        if instance is None or instance.state != "up":
            self.log.warning("park dropped: the instance is not serving", instance=name)
            return
        self.kill(instance.children)
        instance.children = []
        self._parked(instance, "its host is drained")

    def _parked(self, instance: Instance, why: str) -> None:
        instance.state = "parked"
        self.log.info("parked", instance=instance.name, hosts=sorted(instance.hosts), why=why)
        self.plumbing.parked(instance.name)
        self.plumbing.status(f"{instance.name} parked: {why}")

    def _pool_gone(self) -> str | None:
        """A pool all of whose instances have failed for good (its name), if any."""
        pools = {i.pool for i in self.instances}
        return next((p for p in pools if all(i.state == "failed" for i in self.instances if i.pool == p)), None)

    def step(self, now: float) -> bool:
        """Move each restart on: spawn once the back-off is over (and every host is there),
        serve once every new child is ready. False: it failed and the daemon gives up."""
        for instance in self.instances:
            if not self._step(instance, now):
                return False
        return True

    def _step(self, instance: Instance, now: float) -> bool:
        hosts = self.plumbing.hosts
        if instance.state == "down" and now >= instance.respawn_at:
            if hosts is not None and hosts.parks(instance.hosts):
                self._parked(instance, f"waiting for hosts {', '.join(sorted(instance.hosts))} to join")
                return True
            if hosts is not None and hosts.absent:
                return True  # an instance needs its hosts: wait for their kvasird join
            self._spawn(instance, "starting", now)
        elif instance.state == "parked" and self._back(instance):
            self.log.info("joining", instance=instance.name, hosts=sorted(instance.hosts))
            self._spawn(instance, "joining", now)
        elif instance.state in ("starting", "moving", "joining") and instance.ready and self._bridge_ready:
            return self._opened(instance, now)
        elif instance.state in ("starting", "moving", "joining") and now > instance.deadline:
            late = [c for c in self.children if not c.ready]
            self.kill(late)
            reason = f"not ready after {self.ready_s:.0f} s: {', '.join(c.name for c in late)}"
            bridge_late = any(c.id == BRIDGE for c in late)
            return self.failed(self._of(reason, {instance.name}, self.bridge if bridge_late else None), now, True)
        return True

    @property
    def _bridge_ready(self) -> bool:
        return self.bridge is not None and self.bridge.ready

    def _spawn(self, instance: Instance, state: InstanceState, now: float) -> None:
        instance.state = state
        self.spawn_missing()
        instance.deadline = now + self.ready_s

    def _opened(self, instance: Instance, now: float) -> bool:
        """Its new children are ready: the bridge serves it (a restart counts as one)."""
        was = instance.state
        try:
            self.plumbing.open(
                instance.name, instance.restarts + (was == "starting"), self.new_bridge, instance.deadline
            )
        except OpenError as exc:
            return self.failed(Failure(str(exc), (instance.name,)), now, serving=True)
        self.new_bridge = False
        instance.state = "up"
        if was == "starting":
            instance.restarts += 1
            self.log.info("serving again", instance=instance.name, restarts=instance.restarts)
            self.plumbing.status(f"{instance.name} serving again; restarted {instance.restarts} times")
        elif was == "moving":
            instance.moves += 1
            self.log.info("serving in its new pool", instance=instance.name, pool=instance.pool)
            self.plumbing.status(f"{instance.name} serving in the {instance.pool} pool")
        else:
            self.log.info("joined", instance=instance.name, hosts=sorted(instance.hosts))
            self.plumbing.status(f"{instance.name} serving: its hosts joined")
        return True

    def kill(self, children: list[Child]) -> None:
        self.plumbing.kill(children)
        for child in children:
            self.heartbeats.forget(child.name)
