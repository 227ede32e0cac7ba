"""The Generator: weight swaps never tear a forward pass; replicas follow published versions; kept completions are
taken once by the replay buffer and evicted past their bound."""

import asyncio
import threading
import time

import pytest
import torch

from actors.engines.hf import HFEngine
from actors.generator import Generator, WeightVersionError
from rl.tiny_model import build_tiny_checkpoint
from actors.replay_buffer import ReplayBufferActor
from rl.types import EpisodeBatch, KeptEpisodes, KeptPart, SamplingParams, TrainBatch
from forge.weights.store import WeightStore
from tests.support import assert_kept_sets_replay
from forge.weights.startup import start_weight_store

pytestmark = [pytest.mark.monarch, pytest.mark.timed]  # Monarch processes; wall-clock bounds (tests/suite.py)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


def _constant_weights(engine: HFEngine, value: float) -> dict[str, torch.Tensor]:
    return {name: torch.full(shape, value, dtype=dtype) for name, (shape, dtype) in engine.parameter_specs().items()}


def test_no_forward_pass_sees_two_versions(checkpoint):
    """Versions whose every parameter equals the version number are staged from another thread while the
    engine generates; each forward pass must see one value everywhere, the one its tokens are tagged with."""
    torch.set_num_threads(1)
    engine = HFEngine(checkpoint, seed=0)
    engine.load_weights(_constant_weights(engine, 0.0), version=0)
    params = list(engine.model.parameters())
    seen: list[tuple[float, float, int]] = []
    original_forward = engine.model.forward

    def checked_forward(*args, **kwargs):
        before = {float(p.flatten()[0]) for p in params} | {float(p.flatten()[-1]) for p in params}
        out = original_forward(*args, **kwargs)
        after = {float(p.flatten()[0]) for p in params} | {float(p.flatten()[-1]) for p in params}
        assert len(before) == 1 and before == after, f"torn forward: {before} -> {after}"
        seen.append((before.pop(), after.pop(), engine.policy_version))
        return out

    engine.model.forward = checked_forward
    stop = threading.Event()

    def publisher():
        version = 0
        while not stop.is_set():
            version += 1
            engine.stage_weights(_constant_weights(engine, float(version)), version)

    thread = threading.Thread(target=publisher)
    thread.start()
    try:
        completions = []
        for _ in range(5):
            out = engine.generate(["12+34="] * 4, SamplingParams(n=2, max_tokens=24, temperature=1.0))
            completions.extend(c for group in out for c in group)
    finally:
        stop.set()
        thread.join()
    assert len({value for value, _, _ in seen}) > 3, "the publisher never got a swap in: the test proved nothing"
    for value, _, version in seen:
        assert value == float(version)  # the engine's version is the one whose weights ran
    for c in completions:
        assert c.policy_versions == sorted(c.policy_versions)  # a sequence only moves forward in versions


async def test_generator_service_follows_published_versions(checkpoint):
    await start_weight_store()
    store = WeightStore("gen-test")
    engine = HFEngine(checkpoint)  # only to know the parameter shapes the generators expect
    base = {name: t.detach().clone() for name, t in engine.model.state_dict().items()}
    await store.publish(base, version=0)
    service = await Generator.options(num_replicas=2, mesh_name="gen").as_service(
        model=str(checkpoint), weight_namespace="gen-test", weight_poll_s=0.02
    )
    try:
        assert await service.policy_version.fanout() == [0, 0]
        out = await service.generate.route("12+34=", SamplingParams(n=3, max_tokens=5))
        assert len(out) == 3 and all(c.policy_versions == [0] * len(c.token_ids) for c in out)
        assert all(len(c.logprobs) == len(c.token_ids) for c in out)

        # Publish version 1 (perturbed weights): every replica swaps it in without being told.
        perturbed = {name: t + 0.01 for name, t in base.items()}
        await store.publish(perturbed, version=1)
        deadline = time.monotonic() + 60
        while await service.policy_version.fanout() != [1, 1]:
            assert time.monotonic() < deadline, "the replicas did not follow version 1 within 60 s"
            await asyncio.sleep(0.05)
        out = await service.generate.route("1+2=", SamplingParams(n=2, max_tokens=4))
        assert all(set(c.policy_versions) == {1} for c in out)

        # Top-p rollouts come back with each token's kept set: the trainer's log-prob function replays it.
        out = await service.generate.route("1+2=", SamplingParams(n=3, max_tokens=6, top_p=0.8))
        engine.load_weights(perturbed, version=1)
        assert_kept_sets_replay(engine.model, out, temperature=1.0, version=1, atol=1e-5)

        # An explicit update to an older version is honoured (e.g. an evaluation of version 0).
        assert await service.update_weights.route(0) == 0

        # A bad prompt fails alone; its batch-mates still succeed.
        good, bad = await asyncio.gather(
            service.generate.route("3+4=", SamplingParams(max_tokens=3)),
            service.generate.route("", SamplingParams(max_tokens=3)),
            return_exceptions=True,
        )
        assert not isinstance(good, BaseException) and len(good) == 1
        assert isinstance(bad, BaseException) and "empty" in str(bad)

        # A seed gives the same completion whoever else asks at the same moment (a gateway client's seed).
        seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7)
        async with service.session():  # one replica: the requests arrive together and would share a batch
            crowd = await asyncio.gather(*(service.generate.route("12+34=", seeded) for _ in range(3)))
            (alone,) = await service.generate.route("12+34=", seeded)
        assert [c.token_ids for (c,) in crowd] == [alone.token_ids] * 3
    finally:
        await service.stop()


async def test_a_request_waits_for_its_minimum_policy_version(checkpoint):
    """The GRPO app's age bound relies on it: a request naming `min_policy_version` gets no token from an
    older policy, even when the replica's background poll has not seen that version yet."""
    await start_weight_store()
    store = WeightStore("gen-min-version")
    engine = HFEngine(checkpoint)
    base = {name: t.detach().clone() for name, t in engine.model.state_dict().items()}
    await store.publish(base, version=0)
    service = await Generator.options(mesh_name="gen-min").as_service(
        model=str(checkpoint), weight_namespace="gen-min-version", weight_poll_s=5.0  # the poll is far too slow
    )
    try:
        for version in (1, 2):
            await store.publish({name: t + 0.01 * version for name, t in base.items()}, version=version)
        out = await service.generate.route("12+34=", SamplingParams(n=4, max_tokens=4), min_policy_version=2)
        assert all(set(c.policy_versions) == {2} for c in out)
        assert await service.policy_version.route() == 2

        with pytest.raises(Exception, match=r"needs policy version >= 7, but the newest published is 2"):
            await service.generate.route("1+2=", SamplingParams(max_tokens=2), min_policy_version=7)
        # The replica still serves after refusing one request.
        out = await service.generate.route("1+2=", SamplingParams(max_tokens=2), min_policy_version=1)
        assert all(set(c.policy_versions) == {2} for c in out)
    finally:
        await service.stop()


class _HostStore(WeightStore):
    """A relayed job's weight store as one host sees it (the real `wait_for_version` over fake keys): the trainer
    has published `published`; this host's relay has `host_copy`, and copies `published` after `copy_after` more
    looks. A fetch of a version this host does not hold fails the test."""

    def __init__(self, published: int, host_copy: int | None, copy_after: int) -> None:
        super().__init__("test-host-store")
        self.relayed = True
        self.published, self.host_copy, self.copy_after = published, host_copy, copy_after
        self.fetched: list[int] = []
        self.looks = 0

    async def published_version(self) -> int:
        return self.published

    async def latest_version(self) -> int | None:
        self.looks += 1
        self.copy_after -= 1
        if self.copy_after < 0:
            self.host_copy = self.published
        return self.host_copy

    async def fetch(self, version: int, into: dict | None = None) -> dict:
        assert self.host_copy is not None and version <= self.host_copy, f"fetched {version} before this host had it"
        self.fetched.append(version)
        return {}


class _StagingEngine:
    policy_version = 0

    def stage_weights(self, weights: dict, version: int) -> None:
        self.staged = version


def _generator_on(store: _HostStore) -> Generator:
    generator = Generator(model="unused", weight_poll_s=0.001)
    generator.store, generator.engine = store, _StagingEngine()
    generator._fetched_version = 0
    return generator


async def test_a_request_learns_of_a_version_only_once_its_host_can_read_it_and_fetches_it_once():
    store = _HostStore(published=3, host_copy=None, copy_after=60)
    generator = _generator_on(store)
    await generator._ensure_version(3)
    assert store.fetched == [3] and generator.engine.staged == 3  # read once, from the host's copy
    assert store.looks == 61  # the notice was looked at until the copy was there; no fetch before it


async def test_a_relay_that_never_copies_fails_the_request_after_the_bound_without_a_fetch():
    store = _HostStore(published=3, host_copy=None, copy_after=10**9)
    generator = _generator_on(store)
    with pytest.raises(WeightVersionError, match="has not reached host"):
        await generator._ensure_version(3, wait_s=0.05)
    assert store.fetched == []


async def test_a_version_nobody_published_fails_the_request_after_a_short_bound(monkeypatch):
    monkeypatch.setattr("forge.weights.store.UNPUBLISHED_WAIT_S", 0.02)
    store = _HostStore(published=2, host_copy=2, copy_after=0)
    store.incoming = _nothing_incoming
    generator = _generator_on(store)
    started = time.monotonic()
    with pytest.raises(WeightVersionError, match="needs policy version >= 3"):
        await generator._ensure_version(3)
    assert time.monotonic() - started < 5 and store.fetched == []


async def _nothing_incoming():
    return None


async def test_kept_completions_are_taken_once_by_the_replay_buffer_and_evicted_past_the_bound(checkpoint):
    """apps.grpo's single-turn path: the generator keeps a rollout's completions and answers with their texts; the
    buffer takes the rows the controller selected, with their ids, rewards and advantages, and holds the same
    episodes the controller used to pack itself. A kept batch is taken once, forgotten when named without rows, and
    evicted past `keep_at_most`; a take that fails costs its groups, not the add."""
    await start_weight_store()
    store = WeightStore("gen-kept")
    engine = HFEngine(checkpoint)
    await store.publish({name: t.detach().clone() for name, t in engine.model.state_dict().items()}, version=0)
    service = await Generator.options(mesh_name="gen-kept").as_service(model=str(checkpoint),
                                                                          weight_namespace="gen-kept")
    buffer = await ReplayBufferActor.options(mesh_name="buffer-kept").as_actor(batch_size=3, max_policy_age=4,
                                                                                 sample_order="oldest")
    params = SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=3)  # seeded: both paths sample the same
    prompts = ["12+34=", "5+6="]
    try:
        kept, replica = await service.generate_kept.route_replica(prompts, params, keep_at_most=3)
        assert kept.samples == [2, 2] and len(kept.texts) == 4
        old = await service.generate_batch.route(prompts, params)  # the old path: the tensors come back
        assert list(old.texts) == kept.texts

        # Rows 1 and 2 (prompt 0's second completion, prompt 1's first) are trained; a second batch none of whose
        # groups is trained is named without rows.
        dropped, _ = await service.generate_kept.route_replica(prompts[:1], params, keep_at_most=3)
        assert await buffer.reserve.call_one(0, 3, 2) == 3
        added = await buffer.add.call_one(KeptEpisodes([
            KeptPart(replica, kept.key, [1, 2], [10, 20], [1, 2], [1.0, 0.0], [0.5, -0.5]),
            KeptPart(replica, dropped.key, [], [], [], [], [])]), reserved=4)
        assert (added.held, added.lost_episodes, added.lost_groups) == (2, 0, 0)
        for key in (kept.key, dropped.key):  # both forgotten on the replica
            with pytest.raises(Exception, match=rf"key={key} is not kept on this replica: already taken, or evicted"):
                await replica.take_kept.call_one(key, [0])

        # Past keep_at_most the oldest kept batch is evicted: the buffer's take of it fails, its group is lost (and
        # its room released), the add goes on.
        evicted, _ = await service.generate_kept.route_replica(prompts[:1], params, keep_at_most=2)
        newer = [await service.generate_kept.route_replica(prompts[:1], params, keep_at_most=2) for _ in range(2)]
        added = await buffer.add.call_one(KeptEpisodes([KeptPart(replica, evicted.key, [0], [30], [3], [1.0],
                                                                 [1.0])]), reserved=2)
        assert (added.held, added.lost_episodes, added.lost_groups) == (2, 1, 1)
        assert await replica.take_kept.call_one(newer[0][0].key, []) is None  # named without rows: forgotten
        with pytest.raises(Exception, match=r"key=999 is not kept on this replica: never kept"):
            await replica.take_kept.call_one(999, [0])
        with pytest.raises(Exception, match=r"rows=\[7\] out of range: batch \d+ has 2 completions"):
            await replica.take_kept.call_one(newer[1][0].key, [7])
        with pytest.raises(Exception, match=r"keep_at_most=0: must be an int >= 1"):
            await service.generate_kept.route(prompts, params, keep_at_most=0)

        # What the buffer holds is what the controller packed on the old path.
        expected = EpisodeBatch.from_completions(old, episode_ids=[0, 10, 20, 0], group_ids=[0, 1, 2, 0],
                                                 rewards=[0.0, 1.0, 0.0, 0.0],
                                                 advantages=[0.0, 0.5, -0.5, 0.0]).select([1, 2])
        await buffer.add.call_one(expected.select([0]), reserved=0)  # a third episode: the batch fills
        handed = await buffer.next_batch.call_one(0, 0)
        batch = await buffer.batch.call_one(0)
        assert handed.episodes == 3 and handed.stats["added"] == 3
        want = TrainBatch.from_episodes(EpisodeBatch.cat([expected, expected.select([0])]), 0)
        for name in ("input_ids", "response_mask", "behaviour_logprobs", "policy_versions", "advantages", "rewards"):
            assert torch.equal(getattr(batch, name), getattr(want, name)), name
    finally:
        await service.stop()
