"""--dynamic_sampling's later rounds draw prompts the update has not drawn yet: neither its first round's (the scripts'
data.prompt_batches, batch update - 1) nor an earlier round's, on one process or several, while the dataset has
others; the same prompts however the run got to the update (a resumed run draws what the uninterrupted one drew)."""

import rloo
from rloo_utils import data, rollouts
from test_dynamic_sampling import G, ScriptedSampler, ScriptedScorer, dataset_of, refill_of

PROMPTS_PER_ROLLOUT = 4  # groups per update, over every process


def never_varied(dataset) -> ScriptedScorer:
    """Every group of every prompt scores 1, 1, 1, 1: each is dropped, and each round draws as many as it drew."""
    return ScriptedScorer({answer: False for answer in dataset["answer"]})


def refill_update(refill, sampler, scorer, dataset, update: int, rank: int = 0, world_size: int = 1) -> list[str]:
    """One update's refill from its first round as the scripts sample it (this process's share of prompt_batches' batch
    update - 1); returns every prompt the update sampled, its first round's then each later round's, once per group."""
    batch = next(data.prompt_batches(dataset, PROMPTS_PER_ROLLOUT, 5, update - 1, rank, world_size))
    first = sampler.sample(*data.repeated(batch, G), None, None)
    rewards, texts = scorer.score(first)
    sampler.asked.clear()
    refill.refill(first, rewards, rewards[:, 0], texts, update, rloo.logs.StageTimer())
    return batch["prompt"] + [prompt for asked, _ in sampler.asked for prompt in asked[::G]]


def test_later_rounds_draw_prompts_the_update_has_not_drawn():
    """12 prompts, 4 a round, every group dropped: the first round and two more sample each prompt once."""
    dataset = dataset_of(12)
    sampler, scorer = ScriptedSampler(), never_varied(dataset)
    seen = refill_update(refill_of(sampler, scorer, dataset, max_rounds=3), sampler, scorer, dataset, update=2)
    assert len(sampler.asked) == 2
    assert sorted(seen) == sorted(dataset["prompt"])


def test_on_two_processes_the_rounds_skip_what_either_process_drew(monkeypatch):
    """Each process samples its share of each round's draw, and skips the other's first-round prompts too."""
    dataset = dataset_of(12)
    monkeypatch.setattr(rollouts, "get_world_size", lambda: 2)
    monkeypatch.setattr(rollouts, "max_over_processes", lambda missing: missing)  # both miss every group
    seen = []
    for rank in (0, 1):
        monkeypatch.setattr(rollouts, "get_rank", lambda rank=rank: rank)
        sampler, scorer = ScriptedSampler(), never_varied(dataset)
        refill = refill_of(sampler, scorer, dataset, max_rounds=3)
        seen += refill_update(refill, sampler, scorer, dataset, update=3, rank=rank, world_size=2)
    assert sorted(seen) == sorted(dataset["prompt"])


def test_an_update_draws_the_same_prompts_after_the_updates_before_it_as_in_a_resumed_run():
    dataset = dataset_of(40)
    sampler, scorer = ScriptedSampler(), never_varied(dataset)
    uninterrupted = refill_of(sampler, scorer, dataset, max_rounds=3)
    drawn = [refill_update(uninterrupted, sampler, scorer, dataset, update) for update in (1, 2, 3)]
    resumed = [refill_update(refill_of(sampler, scorer, dataset, 3), sampler, scorer, dataset, 3) for _ in range(2)]
    assert resumed == [drawn[2]] * 2
    assert all(len(set(prompts)) == 3 * PROMPTS_PER_ROLLOUT for prompts in drawn)


def test_a_dataset_too_small_for_the_rounds_gives_its_undrawn_prompts_first():
    """6 prompts: the first round draws 4, the second the other 2 and then 2 of the first's."""
    dataset = dataset_of(6)
    sampler, scorer = ScriptedSampler(), never_varied(dataset)
    seen = refill_update(refill_of(sampler, scorer, dataset, max_rounds=2), sampler, scorer, dataset, update=1)
    first, second = seen[:4], seen[4:]
    assert len(second) == 4 and sorted(first + second[:2]) == sorted(dataset["prompt"])
    assert set(second[2:]) <= set(first) and len(set(second)) == 4
