"""Rollout corrections (losses.terms.correction_weight) and mismatch metrics (losses.mismatch) against float64
references written token by token."""

import math

import pytest
import torch

from losses import LOSSES
from losses.grpo import grpo
from losses.mismatch import MISMATCH_METRICS, mismatch_metrics, version_lags
from losses.terms import correction_weight

NAMES = sorted(LOSSES)


def rho(case, i, t):
    """pi_old / pi_behaviour of token t of sequence i."""
    return math.exp(case.old[i][t] - case.behaviour[i][t])


def geometric_mean(case, i):
    tokens = case.tokens(i)
    return math.exp(sum(math.log(rho(case, i, t)) for t in tokens) / len(tokens))


def reference_weight(case, i, t, *, tis_cap=None, token_band=None, seq_band=None):
    """w_t by its definition: (min(rho, C) or 1) x 1[rho in token band] x 1[geometric mean in sequence band]."""
    r = rho(case, i, t)
    weight = 1.0 if tis_cap is None else min(r, tis_cap)
    if token_band is not None and not token_band[0] <= r <= token_band[1]:
        return 0.0
    if seq_band is not None and not seq_band[0] <= geometric_mean(case, i) <= seq_band[1]:
        return 0.0
    return weight


# The case's rho per response token: row 0 [2.0, 0.6, 1.0], row 1 [1.2, 3.0, 0.8], row 2 [1.1, 0.5, 2.5, 1.0, 0.9];
# geometric means 1.063, 1.442, 1.056.
CORRECTIONS = [
    ("TIS", {"tis_cap": 2.0}),
    ("MIS", {"tis_cap": 2.0, "token_mask_band": (0.0, 2.0)}),
    ("IcePop", {"tis_cap": 2.5, "token_mask_band": (0.55, 2.5)}),
    ("rejection only", {"token_mask_band": [0.7, 2.2]}),
    ("geometric mean", {"seq_mask_band": (0.95, 1.1)}),
    ("IcePop + geometric mean", {"tis_cap": 2.5, "token_mask_band": (0.55, 2.5), "seq_mask_band": (0.0, 1.06)}),
]


@pytest.mark.parametrize("correction", [c for _, c in CORRECTIONS], ids=[n for n, _ in CORRECTIONS])
def test_correction_weight_matches_its_definition(case, correction):
    fields = {"tis_cap": None, "token_mask_band": None, "seq_mask_band": None, **correction}
    weight = correction_weight(case.old_tensor(), case.batch(), **fields)
    band = {"token_band": fields["token_mask_band"], "seq_band": fields["seq_mask_band"]}
    for i in range(3):
        for t in range(5):
            expected = reference_weight(case, i, t, tis_cap=fields["tis_cap"], **band) if t in case.tokens(i) else 1.0
            assert weight[i, t].item() == pytest.approx(expected, rel=1e-12, abs=0), (i, t)
    assert (weight == 0).any() or correction == {"tis_cap": 2.0}  # each mask drops something in this case


def test_icepop_keeps_rho_inside_the_band_and_drops_both_sides(case):
    weight = correction_weight(case.old_tensor(), case.batch(), tis_cap=2.5, token_mask_band=(0.55, 2.5),
                               seq_mask_band=None)
    # rho 3.0 (above beta) and 0.5 (below alpha) are dropped; 2.5 (= beta) is kept at full value.
    assert weight[1, 2] == 0 and weight[2, 1] == 0
    assert weight[2, 2].item() == pytest.approx(2.5) and weight[0, 2].item() == pytest.approx(2.0)


def test_geometric_mean_mask_drops_whole_sequences(case):
    weight = correction_weight(case.old_tensor(), case.batch(), tis_cap=None, token_mask_band=None,
                               seq_mask_band=(0.95, 1.1))
    on = case.batch().response_mask > 0
    assert torch.all(weight[1][on[1]] == 0)  # geometric mean 1.442
    assert torch.all(weight[0][on[0]] == 1) and torch.all(weight[2][on[2]] == 1)  # 1.063, 1.056


def hand_grpo_corrected(case, *, eps, **correction):
    """GRPO with a rollout correction, token by token in float64: the loss and d loss / d logprobs."""
    rows = len(case.mask)
    loss, grad = 0.0, [[0.0] * len(m) for m in case.mask]
    anchor = case.old if correction.get("tis_cap") is not None else case.behaviour
    for i in range(rows):
        tokens, a = case.tokens(i), case.advantages[i]
        for t in tokens:
            w = reference_weight(case, i, t, tis_cap=correction.get("tis_cap"),
                                 token_band=correction.get("token_mask_band"), seq_band=correction.get("seq_mask_band"))
            r = math.exp(case.logprobs[i][t] - anchor[i][t])
            unclipped, clipped = r * a, min(max(r, 1 - eps), 1 + eps) * a
            loss += -w * min(unclipped, clipped) / len(tokens) / rows  # a masked token stays in the 1/|o_i|
            grad[i][t] = (0.0 if clipped < unclipped else -w * r * a) / len(tokens) / rows
    return loss, grad


@pytest.mark.parametrize("correction", [c for _, c in CORRECTIONS], ids=[n for n, _ in CORRECTIONS])
def test_grpo_with_a_rollout_correction_matches_float64_reference(case, correction):
    logprobs = case.logprobs_leaf()
    out = grpo(logprobs, case.batch(), old_logprobs=case.old_tensor(), clip_eps=0.2, **correction)
    out.loss.backward()
    loss, grad = hand_grpo_corrected(case, eps=0.2, **correction)
    assert out.loss.item() == pytest.approx(loss, rel=1e-12)
    torch.testing.assert_close(logprobs.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    weights = [reference_weight(case, i, t, tis_cap=correction.get("tis_cap"),
                                token_band=correction.get("token_mask_band"), seq_band=correction.get("seq_mask_band"))
               for i in range(3) for t in case.tokens(i)]
    assert out.metrics["masked_fraction"] == pytest.approx(sum(w == 0 for w in weights) / len(weights))
    assert out.metrics["is_weight_mean"] == pytest.approx(sum(weights) / len(weights), rel=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_every_loss_gives_masked_tokens_no_gradient(case, name):
    # The band keeps only rho in [0.95, 1.05]: row 0 token 4, row 2 token 3 (rho = 1.0).
    logprobs = case.logprobs_leaf()
    band = {"token_mask_band": (0.95, 1.05)}
    out = LOSSES[name](logprobs, case.batch(), old_logprobs=case.old_tensor(), **band)
    out.loss.backward()
    kept = torch.zeros(3, 5, dtype=torch.bool)
    kept[0, 4] = kept[2, 3] = True
    if name == "gspo":  # its ratio s_i is the sequence's: a kept token's term reaches every token of its sequence
        kept = kept.any(-1, keepdim=True) & (case.batch().response_mask > 0)
    assert torch.all(logprobs.grad[~kept] == 0)
    assert logprobs.grad[kept].abs().sum() > 0
    assert out.metrics["masked_fraction"] == pytest.approx(9 / 11)


# ---------------------------------------------------------------------------------------------------
# Mismatch metrics by version lag


def reference_mismatch(case, versions, policy_version, *, tis_cap=None, token_band=None, seq_band=None):
    """Every metric of losses.mismatch, per lag and over all tokens, from its definition in float64."""
    tokens_by_lag = {}
    for i in range(3):
        for t in case.tokens(i):
            tokens_by_lag.setdefault(policy_version - versions[i][t], []).append((i, t))
    total = sum(len(v) for v in tokens_by_lag.values())
    band = token_band or (0.5, 5.0)

    def metrics(tokens):
        rhos = [rho(case, i, t) for i, t in tokens]
        weights = [reference_weight(case, i, t, tis_cap=tis_cap, token_band=token_band, seq_band=seq_band)
                   for i, t in tokens]
        n = len(tokens)
        return {
            "abs_logp_diff": sum(abs(math.log(r)) for r in rhos) / n,
            "kl_k3": sum(r - 1 - math.log(r) for r in rhos) / n,
            "chi2": sum((r - 1) ** 2 for r in rhos) / n,
            "out_of_band": sum(not band[0] <= r <= band[1] for r in rhos) / n,
            "masked": sum(w == 0 for w in weights) / n,
            "tis_truncated": sum(tis_cap is not None and r > tis_cap for r in rhos) / n,
            "token_share": n / total,
        }

    expected = {f"mismatch/lag{lag}/{k}": v for lag, toks in tokens_by_lag.items() for k, v in metrics(toks).items()}
    all_tokens = [tok for toks in tokens_by_lag.values() for tok in toks]
    expected.update({f"mismatch/all/{k}": v for k, v in metrics(all_tokens).items()})
    return expected


# Versions per token (-1 off the response): lags 0, 1 and 3 at policy version 5; no token of lag 2.
VERSIONS = [[-1, -1, 5, 4, 4], [-1, 5, 5, 2, -1], [4, 4, 4, 2, 5]]


@pytest.mark.parametrize("correction", [{}, {"tis_cap": 2.0}, {"tis_cap": 2.5, "token_mask_band": (0.55, 2.5),
                                                                "seq_mask_band": (0.0, 1.4)}])
def test_mismatch_metrics_by_lag_match_float64_reference(case, correction):
    batch = case.batch()
    batch.policy_versions = torch.tensor(VERSIONS)
    metrics = mismatch_metrics(case.old_tensor(), batch, version_lags(batch, 5), **correction)
    expected = reference_mismatch(case, VERSIONS, 5, tis_cap=correction.get("tis_cap"),
                                  token_band=correction.get("token_mask_band"), seq_band=correction.get("seq_mask_band"))
    assert metrics.keys() == expected.keys()
    assert {k.split("/")[1] for k in metrics} == {"lag0", "lag1", "lag3", "all"}
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    assert metrics["mismatch/all/token_share"] == 1.0
    assert sorted(k.split("/")[2] for k in metrics if k.startswith("mismatch/all/")) == sorted(MISMATCH_METRICS)


def test_mismatch_is_zero_on_policy(case):
    batch = case.batch()
    metrics = mismatch_metrics(batch.behaviour_logprobs.clone(), batch, version_lags(batch, 0), tis_cap=2.0)
    for name in ("abs_logp_diff", "kl_k3", "chi2", "out_of_band", "masked", "tis_truncated"):
        assert metrics[f"mismatch/lag0/{name}"] == 0.0
    assert set(k.split("/")[1] for k in metrics) == {"lag0", "all"}


def test_a_token_newer_than_the_trainer_is_an_error(case):
    batch = case.batch()
    batch.policy_versions = torch.tensor(VERSIONS)
    with pytest.raises(ValueError, match="a token from version 5, ahead of the trainer's policy version 4"):
        version_lags(batch, 4)
