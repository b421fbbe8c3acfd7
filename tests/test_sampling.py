"""Sampling filters against brute force and transformers' logits processors; seeds."""

from __future__ import annotations

import torch

from powerinfer.engine.sample import Sampler, SamplingParams, apply_repetition_penalty, filtered_probs


def test_greedy_is_argmax():
    logits = torch.randn(50)
    assert Sampler(SamplingParams(temperature=0))(logits) == int(logits.argmax())


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    logits = torch.randn(1000)
    a = Sampler(SamplingParams(temperature=1.0, top_p=1.0, seed=7))
    b = Sampler(SamplingParams(temperature=1.0, top_p=1.0, seed=7))
    c = Sampler(SamplingParams(temperature=1.0, top_p=1.0, seed=8))
    seq_a = [a(logits) for _ in range(30)]
    assert seq_a == [b(logits) for _ in range(30)]
    assert seq_a != [c(logits) for _ in range(30)]


def test_top_k_top_p_min_p_match_transformers_warpers():
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(200) * 3
    for k, p, m in [(10, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.1), (20, 0.9, 0.05)]:
        ref = logits[None].clone()
        if k:
            ref = TopKLogitsWarper(k)(None, ref)
        if p < 1:
            ref = TopPLogitsWarper(p)(None, ref)
        if m:
            ref = MinPLogitsWarper(m)(None, ref)
        expected = torch.softmax(ref[0], -1)
        got = filtered_probs(logits, k, p, m)
        # same support; min-p in transformers renormalises after top-p, which keeps the same ratios
        assert torch.equal(got > 0, expected > 0), (k, p, m)
        torch.testing.assert_close(got, expected / expected.sum())


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(100)
    seen = torch.tensor([3, 5, 5, 90])
    expected = RepetitionPenaltyLogitsProcessor(1.3)(seen[None], logits[None].clone())[0]
    torch.testing.assert_close(apply_repetition_penalty(logits, seen, 1.3), expected)


def test_sampled_tokens_stay_in_the_filtered_set():
    logits = torch.randn(500)
    allowed = set(torch.topk(logits, 5).indices.tolist())
    sampler = Sampler(SamplingParams(temperature=2.0, top_k=5, top_p=1.0, seed=0))
    assert {sampler(logits) for _ in range(200)} <= allowed


def test_nucleus_on_a_large_vocabulary_matches_transformers():
    """Peaky and flat 50k-token distributions: the partial sort (a cut-off lowered until the
    nucleus ends inside it) keeps what sorting every token keeps."""
    from transformers.generation.logits_process import TopPLogitsWarper

    g = torch.Generator().manual_seed(3)
    for scale in (12.0, 3.0, 0.3):  # a few tokens, hundreds, most of the vocabulary
        logits = torch.randn(50_000, generator=g) * scale
        for p in (0.5, 0.95):
            expected = torch.softmax(TopPLogitsWarper(p)(None, logits[None].clone())[0], -1)
            got = filtered_probs(logits, 0, p, 0.0)
            assert torch.equal(got > 0, expected > 0), (scale, p)
            torch.testing.assert_close(got, expected / expected.sum())


def test_draws_follow_the_probabilities():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05])
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=1.0, seed=1))
    n = 20_000
    counts = torch.bincount(torch.tensor([sampler(probs.log()) for _ in range(n)]), minlength=5).float() / n
    assert counts[1] == 0
    torch.testing.assert_close(counts, probs, atol=0.015, rtol=0)
