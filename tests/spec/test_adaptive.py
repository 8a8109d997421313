"""The load-adaptive draft length (spec/adaptive.py) against a synthetic step-time model: speculation at a
memory-bound batch, none at a compute-bound one, trials only of a neighbouring k, backing off while they
keep losing, and a switch when a trial measures better."""
from __future__ import annotations

from tokenmill.core.step_time import StepTimeModel
from tokenmill.spec.adaptive import AdaptiveDraftLength


def _model(intercept: float, per_token: float) -> StepTimeModel:
    return StepTimeModel(prior={"intercept": intercept, "per_decode_row": per_token,
                                "per_prefill_token": per_token, "per_context_read": 0.0}, prior_weight=1e6)


def _accepting(dl: AdaptiveDraftLength, alpha: float, n: int = 400) -> None:
    for i in range(n):                             # one draft token at a time: accepted with probability alpha
        dl.observe_request(1, 1 if (i * alpha) % 1 + alpha >= 1 else 0)


def test_memory_bound_batch_speculates_compute_bound_batch_does_not():
    dl = AdaptiveDraftLength(4)
    _accepting(dl, 0.8)
    assert 0.7 < dl.alpha < 0.9
    memory_bound = _model(intercept=0.030, per_token=0.0002)
    assert dl.choose(memory_bound, [100]) == 4
    compute_bound = _model(intercept=0.001, per_token=0.002)
    assert dl.choose(compute_bound, [100] * 64) == 0


def _simulate(dl: AdaptiveDraftLength, model: StepTimeModel, n: int, steps: int, tokens_for) -> list[int]:
    """Run `steps` pure-decode steps of n requests where each k's step takes 1 ms plus 2 ms per token
    and gives tokens_for(k) tokens per request; the ks chosen."""
    chosen = []
    for _ in range(steps):
        k = dl.choose(model, [100] * n)
        chosen.append(k)
        dl.observe_step(k, n, 0.001 + 0.002 * n * (1 + k), n * tokens_for(k))
    return chosen


def test_losing_trials_back_off_and_stay_next_to_the_best():
    dl = AdaptiveDraftLength(4)
    _accepting(dl, 0.5)
    model = _model(intercept=0.001, per_token=0.002)          # compute-bound at batch 64
    chosen = _simulate(dl, model, 64, 4000, lambda k: 1 + 0.5 * k)
    trials = [k for k in chosen if k != 0]
    assert set(trials) == {2}                                 # k = 4 is not a neighbour of the best (0)
    assert len(trials) <= 12                                  # 16, 32, 64, ... steps apart: not 4000 / 16
    assert chosen[-500:].count(0) >= 499


def test_a_trial_that_measures_better_switches():
    dl = AdaptiveDraftLength(4)
    _accepting(dl, 0.1)                                       # the prediction says: do not speculate
    model = _model(intercept=0.001, per_token=0.002)
    assert dl.choose(model, [100] * 8) == 0
    # ... but the measured steps say drafts nearly always land and cost little: k climbs to 4
    for k in (0, 2, 4):
        for _ in range(3):
            dl.observe_step(k, 8, 0.02 + 0.001 * k, 8 * (1 + k))
    assert dl.choose(model, [100] * 8) == 4
