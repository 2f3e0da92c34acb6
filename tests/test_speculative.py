"""Draft/verify decoding: lossless against plain greedy and, sampled, against the target's
distribution; tau bookkeeping, n-gram drafting."""

import pytest
import torch

from conftest import VOCAB, make_drafter, tiny_qwen3, tiny_qwen3_5
from flashdraft.drafter import DFlashDrafter
from flashdraft.objective import block_input_ids, block_labels_and_weights, dflash_loss, sample_anchors
from flashdraft.speculative import _draft_and_verify, greedy_generate, ngram_draft, ngram_generate, speculative_generate
from flashdraft.target import TargetModel


def _prompts(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _confident_target() -> TargetModel:
    model = tiny_qwen3(num_layers=4, hidden=64, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # peaked outputs: a learnable, repetitive greedy continuation
    return TargetModel(model, [1, 2])


def _train(target, drafter, steps=60):
    """Fit the drafter to the target's own greedy continuations (a few dozen steps)."""
    prompts = torch.randint(0, VOCAB - 1, (16, 4), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ids = target.model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=28,
                                    do_sample=False)
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :4] = 0
    lengths = torch.full((16,), ids.shape[1])
    features = target.features(ids)
    opt = torch.optim.AdamW(drafter.parameters(), lr=5e-3)
    drafter.train()
    for step in range(steps):
        anchors, valid = sample_anchors(loss_mask, lengths, 12, seed=step)
        labels, weights = block_labels_and_weights(ids, loss_mask, lengths, anchors, valid, drafter.block_size, 4.0)
        block_ids = block_input_ids(ids, anchors, drafter.block_size, drafter.mask_token_id)
        hidden = drafter(features, target.embed(block_ids), anchors, valid)
        loss = dflash_loss(hidden, target.lm_head.weight, labels, weights).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return drafter.eval()


def test_speculative_output_equals_greedy_for_random_and_trained_drafters():
    target = _confident_target()
    random_drafter = make_drafter(target, num_layers=1, block_size=6)
    trained = _train(target, make_drafter(target, num_layers=1, block_size=6))
    taus = {}
    for name, drafter in (("random", random_drafter), ("trained", trained)):
        steps = []
        for prompt in _prompts():
            ref = greedy_generate(target, prompt, 40)
            spec = speculative_generate(target, drafter, prompt, 40)
            assert spec.tokens == ref.tokens, name
            assert sum(a + 1 for a in spec.accepted) == len(spec.tokens) - 1  # every token from one step
            steps.append(spec.tau)
        taus[name] = sum(steps) / len(steps)
    assert taus["trained"] > taus["random"]


def test_decoding_a_hybrid_target_is_lossless_through_every_rewind_path():
    """A Qwen3.5-style target (linear-attention layers with recurrent state): every step whose
    drafts are partly rejected restores the recurrent states and re-runs the kept tokens
    (target.rewind_cache). Both the DFlash drafter and the n-gram drafter must reproduce plain
    greedy decoding, over steps with none, some and all drafts accepted."""
    model = tiny_qwen3_5(seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # peaked outputs: repetitive continuations n-gram drafts can hit
    target = TargetModel(model, [1, 2])
    drafter = make_drafter(target, num_layers=1, block_size=4)
    accepted = []
    for prompt in _prompts(3, seed=4):
        ref = greedy_generate(target, prompt, 24)
        for gen in (speculative_generate(target, drafter, prompt, 24), ngram_generate(target, prompt, 24, 4)):
            assert gen.tokens == ref.tokens
            accepted += gen.accepted
    assert {0, 3} <= set(accepted) and set(accepted) & {1, 2}, accepted


def test_eos_stops_both_decoders_at_the_same_place():
    target = _confident_target()
    drafter = make_drafter(target, num_layers=1, block_size=4)
    prompt = _prompts(1, seed=4)[0]
    free = greedy_generate(target, prompt, 30).tokens
    eos = free[7]
    ref = greedy_generate(target, prompt, 30, eos_ids=[eos])
    assert ref.tokens == free[: free.index(eos) + 1]
    assert speculative_generate(target, drafter, prompt, 30, eos_ids=[eos]).tokens == ref.tokens
    assert ngram_generate(target, prompt, 30, 4, eos_ids=[eos]).tokens == ref.tokens


def test_tau_counts_only_the_tokens_that_are_output():
    """A perfect drafter (drafts = the target's own greedy continuation) accepts every draft, but
    the step that crosses max_new_tokens or eos adds only the tokens up to the cut: tau counts
    those (as the reference loop does), so every output token after the first comes from exactly
    one verification and none that was thrown away is counted."""
    target = _confident_target()
    prompt = _prompts(1, seed=4)[0]
    free = greedy_generate(target, prompt, 40).tokens
    bs = 6

    def oracle(x, tokens, generator):
        done = len(tokens) - len(prompt)
        return free[done:done + bs - 1], None

    for max_new, eos in ((8, []), (40, [free[8]])):
        gen = _draft_and_verify(target, prompt, max_new, eos, oracle)
        expected = free[:max_new] if not eos else free[: free.index(eos[0]) + 1]
        assert gen.tokens == expected
        assert sum(a + 1 for a in gen.accepted) == len(gen.tokens) - 1, gen.accepted
        assert gen.accepted[:-1] == [bs - 1] * (len(gen.accepted) - 1) and gen.accepted[-1] < bs - 1


def test_ngram_baseline_is_lossless_and_copies_the_last_occurrence():
    assert ngram_draft([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3) == [7, 8, 1]
    assert ngram_draft([5, 6, 7], 2) == []
    target = _confident_target()
    for prompt in _prompts():
        assert ngram_generate(target, prompt, 40, 6).tokens == greedy_generate(target, prompt, 40).tokens


def test_evaluate_tau_reuses_given_greedy_references_and_still_checks_them():
    from flashdraft.evaluate import evaluate_tau

    target = _confident_target()
    prompts = _prompts(3)
    greedy = [greedy_generate(target, p, 24) for p in prompts]
    fresh = evaluate_tau(target, None, prompts, max_new_tokens=24, baseline="ngram", block_size=4)
    shared = evaluate_tau(target, None, prompts, max_new_tokens=24, baseline="ngram", block_size=4, references=greedy)
    assert shared["lossless"] and fresh["lossless"] and shared["tau"] == fresh["tau"]
    assert shared["greedy_seconds"] == sum(g.seconds for g in greedy)
    wrong = [type(g)(g.tokens[:-1] + [(g.tokens[-1] + 1) % VOCAB], seconds=g.seconds) for g in greedy]
    assert not evaluate_tau(target, None, prompts, max_new_tokens=24, baseline="ngram", block_size=4,
                            references=wrong)["lossless"]


# ---- sampled verification (temperature > 0) ------------------------------------------------
def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of Pearson's chi-square test of ``counts`` against ``probs`` (cells expected below
    ``min_expected`` pooled into one)."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = probs * counts.sum()
    assert counts[expected == 0].sum() == 0, "a draw the target cannot make"
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def test_target_probs_apply_temperature_top_k_and_top_p():
    from flashdraft.speculative import Sampling

    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 3.0])
    plain = Sampling(temperature=2.0).target_probs(logits)
    torch.testing.assert_close(plain, torch.softmax(logits / 2, -1))
    top2 = Sampling(temperature=1.0, top_k=2).target_probs(logits)
    assert (top2 > 0).tolist() == [True, False, False, False, True]
    torch.testing.assert_close(top2.sum(), torch.tensor(1.0))
    full = torch.softmax(logits, -1)  # sorted: 0.636 (4), 0.234 (0), 0.086 (1), ...
    nucleus = Sampling(temperature=1.0, top_p=0.8).target_probs(logits)  # 0.636 < 0.8: needs the second
    assert (nucleus > 0).tolist() == [True, False, False, False, True]
    torch.testing.assert_close(nucleus[[0, 4]], full[[0, 4]] / full[[0, 4]].sum())
    assert (Sampling(temperature=1.0, top_p=0.5).target_probs(logits) > 0).sum() == 1
    for bad in (dict(temperature=-1.0), dict(temperature=float("inf")), dict(top_p=0.0), dict(top_k=-2)):
        with pytest.raises(ValueError):
            Sampling(**bad)


def test_rejection_sampling_draws_exactly_the_target_distribution():
    """One verify step, many times: the committed token is distributed as p whatever q drew
    the draft (a q unlike p, a one-hot q), and a verifier that keeps every draft is not."""
    from flashdraft.speculative import Sampling, _verify

    sampling = Sampling(temperature=1.0, top_k=4, seed=0)
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[1.5, 0.2, -0.3, 0.9, -2.0, 0.0], [0.0] * 6])  # row 0 verifies d1
    p = sampling.target_probs(logits[0])
    q = torch.softmax(torch.tensor([-1.0, 1.0, 1.2, -0.5, 0.8, 0.3]), -1).unsqueeze(0)  # mass where p has none
    trials = 8_000
    for proposal in ("q", "one-hot"):
        counts = torch.zeros(6)
        for _ in range(trials):
            if proposal == "q":
                d = int(torch.multinomial(q[0], 1, generator=g))
                accepted, own = _verify(logits, [d], q, sampling, g)
            else:
                d = 3
                accepted, own = _verify(logits, [d], None, sampling, g)
            counts[d if accepted else own] += 1
        assert _chi_square_p(counts, p) > 1e-3, (proposal, counts / trials, p)
    keep_all = torch.bincount(torch.multinomial(q[0], trials, replacement=True, generator=g), minlength=6)
    assert _chi_square_p(keep_all.float(), q[0]) > 1e-3  # the control test accepts q as q ...
    with pytest.raises(AssertionError, match="cannot make"):  # ... and rejects it as p
        _chi_square_p(keep_all.float(), p)


@pytest.mark.parametrize("family", ["dflash", "dflash2"])
def test_sampled_speculative_decoding_keeps_the_targets_distribution(family):
    """The whole loop at temperature 1 with top-k: the first three tokens over many seeds follow
    the tiny target's exact distribution (computed by enumerating every continuation). DFlash2:
    the drafts come from the selector's sampled walk over 3 candidates of 12, whose q (zero off
    the candidates) the rejection sampling divides by."""
    from flashdraft.drafter.dflash2 import DFlash2Modules
    from flashdraft.speculative import Sampling
    from flashdraft.toy import tiny_causal_lm

    vocab, prompt = 12, [3, 7, 1]
    model = tiny_causal_lm(vocab, arch="qwen3", num_layers=2, hidden=32, seed=5, max_position_embeddings=64)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # distributions far from uniform
    target = TargetModel(model, [0, 1])
    drafter = DFlashDrafter.for_target(target, num_layers=1, block_size=3, mask_token_id=vocab - 1,
                                       dflash2=DFlash2Modules(2, 8, 4, 3) if family == "dflash2" else None)
    drafter.reset_parameters(std=0.3, generator=torch.Generator().manual_seed(1))
    if family == "dflash2":
        with torch.no_grad():  # a selector that re-ranks (fresh, it would only follow the head)
            drafter.candidate_selector.successor_codebook.normal_(0, 2.0, generator=torch.Generator().manual_seed(2))
    drafter.eval()
    base = Sampling(temperature=1.0, top_k=6)
    with torch.no_grad():  # exact P(t1, t2) and P(t3) by enumeration
        first = base.target_probs(model(torch.tensor([prompt])).logits[0, -1])
        pairs = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        logits = model(pairs).logits
        second = base.target_probs(logits[:vocab * vocab:vocab, -2])  # [t1, t2 | t1]
        joint = first.unsqueeze(1) * second
        third = (joint.flatten().unsqueeze(1) * base.target_probs(logits[:, -1])).sum(0)
    trials, pair_counts, third_counts, accepted = 600, torch.zeros(vocab, vocab), torch.zeros(vocab), 0
    for seed in range(trials):
        sampling = Sampling(temperature=1.0, top_k=6, seed=seed)
        gen = speculative_generate(target, drafter, prompt, 3, sampling=sampling)
        t1, t2, t3 = gen.tokens
        pair_counts[t1, t2] += 1
        third_counts[t3] += 1
        accepted += sum(gen.accepted)
    assert accepted > trials // 4  # drafts were kept: the rejection path and the kept path both ran
    assert _chi_square_p(pair_counts, joint) > 1e-3
    assert _chi_square_p(third_counts, third) > 1e-3
