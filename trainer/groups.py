"""The group buffer: trajectories in, complete GRPO groups out, with every drop counted.

Pure bookkeeping (no NATS): the collector feeds it trajectories with an opaque message handle
and acks what it is told to. Rules (docs/design.md "The GRPO trainer"):

- ``is_train = false`` trajectories are skipped (acked at once) and counted.
- Dedup by job id: a redelivery of a buffered or in-training job replaces the stored handle
  (the newest delivery is the live one); a job already trained (or consumed by a trained
  group) is a duplicate, acked at once.
- Members are buffered by ``group_id``. A group is released when all ``group_size`` members
  arrived, or after ``group_timeout_s`` from its first member if it has >= ``min_members`` ok
  members; otherwise it is dropped then. Members arriving after their group closed are late.
- ``error`` / ``timeout`` members and refused ones (top_p < 1, top_k > 0, greedy) stay in the
  group's membership but out of its statistics.
- Every generated token has its own version (``LLMCall.weight_spans``: an engine updated in place
  mid-call generated one call with two), read as a version of the trajectory's run with
  ``run_version``: the base weights (``"default"``) are version 0, the run's own identity
  ``<run>@<v>:<checksum>`` is v, and anything else (another run's weights, a bare number or a
  server's own string: no trainer of this run wrote it) is not this run's policy. Such a member is
  ``foreign_weights``: out of statistics and training like a refused one, with a warning naming
  the identity (the first, then every 100th).
- At ``select`` time: groups with fewer than ``min_members`` ok members are dropped; flat groups
  (all rewards equal) are dropped if asked; each token's staleness is the current version minus
  its own version, a member's that of its oldest token. Advantages are computed over every
  trainable member first, so a too-stale member's reward stays in its group's baseline whatever
  the policy. A member whose oldest token is beyond ``max_staleness`` is dropped (``drop``:
  no sample), or kept with its too-stale tokens trained with truncated importance weights
  (``tis``) or masked out of the loss (``mask``: its fresher tokens still train; a member with
  no fresh token is statistics only). The oldest complete groups go first, so slow rollouts are
  trained before they go stale rather than starved.
- Overlong responses (a policy call that ended ``finish_reason: length``: it hit
  ``max_new_tokens``) are kept as they are (``keep``), filtered out of statistics and training
  like a refused member (``filter``), or given a set reward (``reward``); both counted.
- Cross-sampled calls (``LLMCall.policy`` false) report another model's weight version: only the
  policy's own calls count for staleness (and for refusal and foreign weights). A member whose
  calls are all cross-sampled (``cross_only``) has no policy token to train: its reward stays in
  the group's statistics (it is a sample of the same mixed behaviour as its siblings, so leaving
  it out would bias the baseline) but it becomes no sample.

A dropped group is acked at once (dropped on purpose); a used group is acked by the trainer
once a checkpoint covers its step, all members together, so a replay after a crash rebuilds
the very same group.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import structlog

from agentarium.schemas import Trajectory, run_version

from .batch import Sample, advantages, refusal
from .config import OVERLONG, STALE_POLICIES

if TYPE_CHECKING:
    from .config import TrainerConfig

# What ``add`` did with a trajectory; the first three mean "ack it now".
VALIDATION, DUPLICATE, LATE = "validation", "duplicate", "late"
BUFFERED, REDELIVERED = "buffered", "redelivered"
ACK_NOW = frozenset({VALIDATION, DUPLICATE, LATE})

log = structlog.get_logger("agentarium.trainer")

_CLOSED_MEMORY = 200_000  # group ids remembered as closed (late members are recognised)


@dataclass(frozen=True, kw_only=True)
class Selection:
    """What ``select`` takes for a step: the rules above at the trainer's current ``version``.

    One value passed from the loop through the collectors to the buffer, so the rules are named
    once and not handed along keyword by keyword."""

    version: int
    max_staleness: int
    # drop: no sample; tis: too-stale tokens importance-weighted; mask: too-stale tokens masked
    stale_policy: str = "drop"
    filter_flat: bool = False
    std_norm: bool = True
    eps: float = 1e-6

    def __post_init__(self) -> None:
        assert self.stale_policy in STALE_POLICIES, self.stale_policy

    @property
    def fresh_from(self) -> int:
        """The oldest version whose tokens are not too stale."""
        return self.version - self.max_staleness

    @classmethod
    def of(cls, config: TrainerConfig, *, version: int) -> Selection:
        return cls(
            version=version,
            max_staleness=config.max_staleness,
            stale_policy=config.stale_policy,
            filter_flat=config.filter_flat_groups,
            std_norm=config.std_norm,
            eps=config.adv_eps,
        )


@dataclass(eq=False)
class Member:
    trajectory: Trajectory
    handle: Any
    version: int | None  # oldest version of the run among the policy's calls; None without one
    refused: str | None = None
    cross_only: bool = False  # every call cross-sampled: statistics only, no sample
    tokens: dict[int, int] = field(default_factory=dict)  # version -> policy tokens it generated

    @property
    def job_id(self) -> str:
        return self.trajectory.job_id

    @property
    def trainable(self) -> bool:
        return self.trajectory.ok and self.refused is None


@dataclass(eq=False)
class Group:
    group_id: str
    group_size: int
    first_arrival: float
    task: str = ""  # the agent whose trajectories these are (one buffer per agent)
    members: dict[str, Member] = field(default_factory=dict)
    timed_out: bool = False
    # Set by select():
    samples: list[Sample] = field(default_factory=list)
    # every ok member evaluated, by its oldest token; and every token, by its own version
    staleness: list[int] = field(default_factory=list)
    token_staleness: Counter[int] = field(default_factory=Counter)  # staleness -> tokens
    stale_dropped: int = 0
    stale_masked: int = 0

    @property
    def ok(self) -> list[Member]:
        return [m for m in self.members.values() if m.trainable]

    @property
    def complete(self) -> bool:
        return len(self.members) >= self.group_size

    @property
    def handles(self) -> list[Any]:
        return [m.handle for m in self.members.values()]

    @property
    def trained_job_ids(self) -> list[str]:
        return [s.trajectory.job_id for s in self.samples]

    @property
    def other_job_ids(self) -> list[str]:
        """Members consumed with the group but not trained (failed, refused, stale)."""
        trained = set(self.trained_job_ids)
        return [j for j in self.members if j not in trained]

    @property
    def oldest_version(self) -> int:
        versions = [m.version for m in self.members.values() if m.version is not None]
        return min(versions, default=0)


@dataclass
class BufferCounters:
    received: int = 0
    validation_skipped: int = 0
    duplicates: int = 0
    redelivered: int = 0
    late: int = 0
    invalid: int = 0
    failed_members: int = 0  # status error/timeout: out of statistics
    refused: int = 0  # unreproducible sampling
    foreign_weights: int = 0  # sampled by weights that are not this run's: out of statistics
    cross_only: int = 0  # every call cross-sampled: in statistics, never trained
    groups_complete: int = 0
    groups_timed_out: int = 0  # released short after the timeout
    dropped_incomplete: int = 0  # groups: timed out with too few ok members
    dropped_small: int = 0  # groups: complete but fewer than min ok members
    dropped_flat: int = 0  # groups: all rewards equal
    dropped_stale: int = 0  # trajectories (drop policy)
    dropped_stale_groups: int = 0  # groups: no member with a token to train (all too stale)
    tis_weighted: int = 0  # trajectories with too-stale tokens importance-weighted (tis)
    stale_masked: int = 0  # trajectories with too-stale tokens masked, their reward kept (mask)
    groups_used: int = 0
    ok_received: int = 0  # ok trajectories taken in (late ones too; not duplicates)
    reward_received: float = 0.0  # the sum of their rewards
    overlong_filtered: int = 0  # trajectories: cut at max_new_tokens, out of training
    overlong_rewarded: int = 0  # trajectories: cut at max_new_tokens, given the set reward

    @property
    def dropped_at_select(self) -> int:
        """Groups the step's selection dropped (what dynamic sampling replaces)."""
        return self.dropped_small + self.dropped_flat + self.dropped_stale_groups

    @property
    def dropped_groups(self) -> int:
        """Groups dropped for any reason (too few ok members, flat, every member stale)."""
        return (
            self.dropped_incomplete
            + self.dropped_small
            + self.dropped_flat
            + self.dropped_stale_groups
        )

    @classmethod
    def total(cls, parts: Iterable[BufferCounters]) -> BufferCounters:
        """Field by field sums (a multi-agent trainer's buffers together)."""
        out = cls()
        for part in parts:
            for name, value in vars(part).items():
                setattr(out, name, getattr(out, name) + value)
        return out


class GroupBuffer:
    def __init__(
        self,
        *,
        group_timeout_s: float,
        min_members: int = 2,
        seen: Iterable[str] = (),
        task: str = "",
        run: str = "",
        vocab_size: int | None = None,
        overlong: str = "keep",
        overlong_reward: float = 0.0,
    ) -> None:
        assert min_members >= 2, "a group needs at least two ok members for an advantage"
        assert overlong in OVERLONG, overlong
        self.task = task
        self.run = run  # versions are read as this run's ("": each trajectory's own run)
        self.overlong = overlong
        self.overlong_reward = overlong_reward
        self.vocab_size = vocab_size  # token ids at or above it are refused (rows.refusal)
        self.group_timeout_s = group_timeout_s
        self.min_members = min_members
        self.counters = BufferCounters()
        # trained or consumed: duplicates from now on. A set is shared, not copied: the buffers
        # of a multi-agent trainer hold one (job ids are unique across agents, being the
        # TASKS stream's dedup key), not one copy of a resumed run's ids each.
        self._seen: set[str] = seen if isinstance(seen, set) else set(seen)
        self._live: dict[str, Member] = {}  # buffered, ready or in training (unacked)
        self._open: dict[str, Group] = {}
        self._ready: list[Group] = []
        self._closed: OrderedDict[str, None] = OrderedDict()

    def __repr__(self) -> str:
        c = self.counters
        return (
            f"<GroupBuffer open={len(self._open)} ready={len(self._ready)} live={len(self._live)} "
            f"used={c.groups_used} stale={c.dropped_stale} flat={c.dropped_flat}>"
        )

    @property
    def ready_count(self) -> int:
        return len(self._ready)

    @property
    def open_count(self) -> int:
        return len(self._open)

    def live_handles(self) -> list[Any]:
        """Every handle not yet acked (buffered, ready, or used by a step awaiting a checkpoint)."""
        return [m.handle for m in self._live.values()]

    def add(self, trajectory: Trajectory, handle: Any, now: float) -> str:
        """Take one delivered trajectory; the result says whether to ack it now (ACK_NOW)."""
        c = self.counters
        c.received += 1
        job_id = trajectory.job_id
        if not trajectory.is_train:
            c.validation_skipped += 1
            return VALIDATION
        if job_id in self._live:
            self._live[job_id].handle = handle
            c.redelivered += 1
            return REDELIVERED
        if job_id in self._seen:
            c.duplicates += 1
            return DUPLICATE
        own = [call for call in trajectory.calls if call.policy]
        member, foreign = self._member(trajectory, handle, own)
        if trajectory.ok and foreign is None:  # the policy's reward, whatever becomes of it
            c.ok_received += 1
            c.reward_received += float(trajectory.reward or 0.0)
        if trajectory.group_id in self._closed:
            c.late += 1
            return LATE
        member.cross_only = bool(trajectory.calls) and not own
        if trajectory.ok and foreign is not None:
            self._foreign(member, foreign)
        elif trajectory.ok:
            member.refused = refusal(trajectory, self.vocab_size)
            c.refused += member.refused is not None
            if member.refused is None and any(call.finish_reason == "length" for call in own):
                self._overlong(member)
        else:
            c.failed_members += 1
        group = self._open.get(trajectory.group_id)
        if group is None:
            group = Group(trajectory.group_id, max(trajectory.group_size, 1), now, self.task)
            self._open[group.group_id] = group
        group.members[job_id] = member
        self._live[job_id] = member
        if group.complete:
            c.groups_complete += 1
            self._release(group)
        return BUFFERED

    def _member(self, trajectory: Trajectory, handle: Any, own: list) -> tuple[Member, str | None]:
        """The member, its tokens counted by version (each span of each policy call), and the
        first version that is not this run's (None when every one is)."""
        run = self.run or trajectory.run
        numbers: dict[str, int | None] = {}
        tokens: Counter[int] = Counter()
        foreign = None
        for call in own:
            for version, start, end in call.version_spans():
                if version not in numbers:
                    numbers[version] = run_version(version, run)
                number = numbers[version]
                if number is None:
                    foreign = version if foreign is None else foreign
                elif end > start:
                    tokens[number] += end - start
        known = [n for n in numbers.values() if n is not None]
        member = Member(trajectory, handle, min(known) if known else None, tokens=dict(tokens))
        return member, foreign

    def _foreign(self, member: Member, identity: str) -> None:
        """Sampled (in part) by weights that are not this run's: not this run's policy, so out
        of statistics and training, and said loudly (the first, then every 100th)."""
        run = self.run or member.trajectory.run
        member.refused = f"sampled by weights {identity!r}, not run {run}'s"
        self.counters.foreign_weights += 1
        if self.counters.foreign_weights % 100 == 1:
            log.warning(
                "trajectory sampled by weights of another run: not trained",
                job_id=member.job_id,
                weight_version=identity,
                run=run,
                foreign_weights=self.counters.foreign_weights,
                hint="the engine served weights this run did not publish: another run's syncer "
                "updated it, or it was never synced for this run (agentarium broker status)",
            )

    def _overlong(self, member: Member) -> None:
        if self.overlong == "filter":
            member.refused = "overlong"  # out of statistics and training, not a bad record
            self.counters.overlong_filtered += 1
        elif self.overlong == "reward":
            member.trajectory = replace(member.trajectory, reward=self.overlong_reward)
            self.counters.overlong_rewarded += 1

    def expire(self, now: float) -> list[Group]:
        """Release or drop groups open longer than the timeout; returns the dropped ones."""
        dropped = []
        for group in list(self._open.values()):
            if now - group.first_arrival < self.group_timeout_s:
                continue
            group.timed_out = True
            if len(group.ok) >= self.min_members:
                self.counters.groups_timed_out += 1
                self._release(group)
            else:
                self.counters.dropped_incomplete += 1
                self._close(group)
                dropped.append(group)
        return dropped

    def select(self, n: int, selection: Selection) -> tuple[list[Group], list[Group]]:
        """Up to n groups for the next step, oldest first, and the groups dropped on the way."""
        c = self.counters
        chosen: list[Group] = []
        dropped: list[Group] = []
        self._ready.sort(key=lambda g: (g.oldest_version, g.first_arrival))
        for group in list(self._ready):
            if len(chosen) == n:
                break
            self._ready.remove(group)
            ok = group.ok
            rewards: list[float] = []
            for m in ok:  # trainable members only, so status ok
                assert m.trajectory.reward is not None, (
                    "status ok implies a reward (Trajectory.__post_init__)"
                )
                rewards.append(float(m.trajectory.reward))
            if len(ok) < self.min_members:
                c.dropped_small += 1
                dropped.append(group)
                if group.group_size < self.min_members and c.dropped_small % 100 == 1:
                    # a producer asked for groups nothing can be learnt from: say so, not
                    # only in the exit counters (the first, then every 100th)
                    log.warning(
                        "groups too small to train on are dropped",
                        group_id=group.group_id,
                        group_size=group.group_size,
                        needs=self.min_members,
                        dropped_small=c.dropped_small,
                        hint="publish each task group_size >= 2 times (produce --group-size)",
                    )
                continue
            if selection.filter_flat and max(rewards) - min(rewards) <= 1e-12:
                c.dropped_flat += 1
                dropped.append(group)
                continue
            # every trainable member's reward, too-stale ones included: the baseline
            advs = advantages(rewards, std_norm=selection.std_norm, eps=selection.eps)
            self._clear(group)
            for member, adv in zip(ok, advs, strict=True):
                if member.cross_only:
                    c.cross_only += 1
                    continue
                sample = self._sample(group, member, adv, selection)
                if sample is not None:
                    group.samples.append(sample)
            c.dropped_stale += group.stale_dropped
            c.stale_masked += group.stale_masked
            if group.samples:
                c.tis_weighted += sum(s.tis for s in group.samples)
                c.groups_used += 1
                chosen.append(group)
            else:
                c.dropped_stale_groups += 1
                dropped.append(group)
        return chosen, dropped

    @staticmethod
    def _sample(
        group: Group, member: Member, advantage: float, selection: Selection
    ) -> Sample | None:
        """The member's sample under the stale policy (None: it trains no token), its
        staleness recorded in the group: its oldest token's, and each token's own."""
        if member.version is None:
            stale = 0
        else:
            stale = selection.version - member.version
        group.staleness.append(stale)
        for version, count in member.tokens.items():
            group.token_staleness[selection.version - version] += count
        if stale <= selection.max_staleness:
            return Sample(member.trajectory, advantage, stale)
        fresh_from = selection.fresh_from
        if selection.stale_policy == "drop":
            group.stale_dropped += 1
            return None
        if selection.stale_policy == "mask":
            group.stale_masked += 1
            if all(version < fresh_from for version in member.tokens):
                return None  # no fresh token: its reward counts in the baseline, nothing trains
            return Sample(member.trajectory, advantage, stale, masked=True, fresh_from=fresh_from)
        return Sample(member.trajectory, advantage, stale, tis=True, fresh_from=fresh_from)

    @staticmethod
    def _clear(group: Group) -> None:
        group.samples, group.staleness, group.token_staleness = [], [], Counter()
        group.stale_dropped = group.stale_masked = 0

    def requeue(self, groups: Iterable[Group]) -> None:
        """Put selected groups back (a take that timed out or was stopped), undoing counts."""
        c = self.counters
        for group in groups:
            c.dropped_stale -= group.stale_dropped
            c.stale_masked -= group.stale_masked
            c.cross_only -= sum(m.cross_only for m in group.ok)
            c.tis_weighted -= sum(s.tis for s in group.samples)
            c.groups_used -= 1
            self._clear(group)
            self._ready.append(group)

    def done(self, groups: Iterable[Group]) -> None:
        """The groups' messages are acked: forget their handles, remember their job ids."""
        for group in groups:
            for job_id in group.members:
                self._live.pop(job_id, None)
                self._seen.add(job_id)

    def staleness_histogram(self, groups: Iterable[Group]) -> dict[int, int]:
        """Versions behind -> trajectories (each by its oldest token)."""
        return dict(sorted(Counter(s for g in groups for s in g.staleness).items()))

    def _release(self, group: Group) -> None:
        self._ready.append(group)
        self._close(group)

    def _close(self, group: Group) -> None:
        self._open.pop(group.group_id, None)
        self._closed[group.group_id] = None
        while len(self._closed) > _CLOSED_MEMORY:
            self._closed.popitem(last=False)
