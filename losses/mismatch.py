"""How far the trainer's policy is from the policy that sampled the tokens, per version lag.

Every training step reports, over the response tokens of its batch and separately for each version lag
(lag = the trainer's policy version when it trains minus the version that generated the token; 0 is on-policy),
pi_train against pi_behaviour (the generator's recorded log-probs). pi_train is pi_old, the trainer before the
batch's first optimizer step, whenever the trainer has it: with one minibatch (the training forward is pi_old) or
with a rollout correction on (it scores pi_old once per batch). Without a correction and with several minibatches
no extra forward pass is spent: a minibatch's pi_train is its own forward, just before its optimizer step.

  abs_logp_diff  mean |log pi_train - log pi_behaviour|
  kl_k3          mean of rho - 1 - log rho, rho = pi_train / pi_behaviour: Schulman's k3 estimator of
                 KL(pi_behaviour || pi_train) from tokens sampled by pi_behaviour (unbiased, >= 0)
  chi2           mean of (rho - 1)^2: the unbiased estimator of the chi-squared divergence
                 chi2(pi_train || pi_behaviour) = E_behaviour[(rho - 1)^2], the variance of the IS weight
  out_of_band    fraction of tokens with rho outside the token band (`token_mask_band`, else
                 losses.rules.MONITOR_BAND, IcePop's [0.5, 5])
  masked         fraction of tokens the rollout correction gives weight 0 (token or sequence masks)
  tis_truncated  fraction of tokens whose weight `tis_cap` truncated (rho > tis_cap)
  token_share    the lag's share of the batch's response tokens
"""

from __future__ import annotations

import torch

from losses.rules import MONITOR_BAND
from rl.types import TrainBatch
from losses.terms import Band, correction_weight, in_band

MISMATCH_METRICS = ("abs_logp_diff", "kl_k3", "chi2", "out_of_band", "masked", "tis_truncated", "token_share")


def version_lags(batch: TrainBatch, policy_version: int) -> torch.Tensor:
    """policy_version - batch.policy_versions on the response, -1 elsewhere: [B, T-1] long, on the CPU.
    `batch` is on the CPU (the trainer's copy before it moves to the device), so nothing waits for the device."""
    on = batch.response_mask > 0
    lags = torch.where(on, policy_version - batch.policy_versions, -1)
    if (lags[on] < 0).any():
        ahead = int(batch.policy_versions[on].max())
        raise ValueError(f"batch.policy_versions: a token from version {ahead}, ahead of the trainer's policy version "
                         f"{policy_version}; a generator cannot be ahead of the weights it was given")
    return lags


@torch.no_grad()
def mismatch_metrics(
    train_logprobs: torch.Tensor,
    batch: TrainBatch,
    lags: torch.Tensor,
    *,
    tis_cap: float | None = None,
    token_mask_band: Band = None,
    seq_mask_band: Band = None,
) -> dict[str, float]:
    """`mismatch/lag{k}/{metric}` for every lag k present in the batch and `mismatch/all/{metric}`, fetched with
    one device sync. `train_logprobs` [B, T-1] is pi_train (pi_old: the trainer before this batch's update);
    `lags` is `version_lags(...)` of the batch."""
    on = batch.response_mask > 0
    num_lags = int(lags.max()) + 1  # on the CPU; 0 when the batch has no response token
    log_rho = torch.where(on, train_logprobs - batch.behaviour_logprobs, 0).double()
    rho = log_rho.exp()
    weight = correction_weight(train_logprobs, batch, tis_cap=tis_cap, token_mask_band=token_mask_band,
                               seq_mask_band=seq_mask_band)
    per_token = torch.stack([
        log_rho.abs(),
        rho - 1 - log_rho,
        (rho - 1) ** 2,
        ~in_band(rho, token_mask_band or MONITOR_BAND),
        weight == 0,
        rho > tis_cap if tis_cap is not None else torch.zeros_like(on),
        torch.ones_like(on),
    ], dim=-1).double()  # [B, T-1, metrics]
    # Sums per lag in one scatter (off the response into a last, discarded row), then the all-lags row.
    index = torch.where(lags < 0, num_lags, lags).to(on.device).flatten()
    sums = per_token.new_zeros(num_lags + 1, per_token.shape[-1]).index_add_(0, index, per_token.flatten(0, 1))
    sums[num_lags] = sums[:num_lags].sum(0)
    tokens = sums[:, -1:]
    means = torch.cat([sums[:, :-1] / tokens.clamp(min=1), tokens / tokens[num_lags].clamp(min=1)], dim=1).tolist()
    metrics = {}
    for lag, row in enumerate(means):
        if lag < num_lags and row[-1] == 0:
            continue  # no token of this lag in the batch
        prefix = "mismatch/all" if lag == num_lags else f"mismatch/lag{lag}"
        metrics.update({f"{prefix}/{name}": value for name, value in zip(MISMATCH_METRICS, row)})
    return metrics
