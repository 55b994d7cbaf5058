"""Preference losses on sequence log-probabilities, with their exact derivatives (float64).

Every loss here is a function of each completion's summed log-probability
logp_s = sum_t log pi(y_t | x, y_<t) over its completion tokens (and of the reference's, a
constant). So its gradient with respect to the trained weights is

    grad L = sum_s (dL/dlogp_s) sum_t grad log pi(y_t | ...)

which is a weighted cross-entropy gradient with per-token weights w_t = -dL/dlogp_s on the
tokens of s (app.engine.training.preference hands them to the ordinary training step). Each
function returns the batch's mean loss, dL/dlogp for every sequence and TRL's metrics.

The formulas follow TRL (trl/trainer/dpo_trainer.py `dpo_loss`, orpo_trainer.py
`odds_ratio_loss`, cpo_trainer.py `cpo_loss` with loss_type "simpo", kto_trainer.py
`kto_loss`), with beta's meaning as there:

* DPO, z = (logp_c - logp_r) - (ref_c - ref_r):
  sigmoid: -(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z) (eps: label smoothing);
  hinge: relu(1 - beta z); ipo: (z - 1 / (2 beta))^2 with length-averaged log-probs (TRL
  averages them for IPO). Rewards beta (logp - ref). Optional SFT term (TRL's rpo_alpha):
  sft_weight x the mean NLL per chosen token of the batch.
* ORPO (no reference), on length-averaged log-probs l: log_odds = (l_c - l_r) -
  (log(1 - e^l_c) - log(1 - e^l_r)); loss = NLL of the chosen tokens (mean per token) -
  lambda x mean log sigmoid(log_odds). Rewards lambda x l.
* SimPO (no reference), on length-averaged log-probs: z = l_c - l_r - gamma / beta; the sigmoid
  loss of beta z with label smoothing; rewards beta x l; optional SFT term as DPO's (CPO's alpha).
* KTO, unpaired: KL = max(0, mean(logp_kl - ref_kl)) over mismatched prompt/completion pairs,
  a constant (no gradient, as TRL detaches it); desirable rows 1 - sigmoid(beta (r - KL)),
  undesirable 1 - sigmoid(beta (KL - r)) with r = logp - ref, weighted by the desirable and
  undesirable weights; the loss is the mean over the rows. A batch without desirable (or
  undesirable) rows has no reward, log-prob or margin for them: None.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DPO_LOSSES = ("sigmoid", "hinge", "ipo")


@dataclass
class LossOutput:
    """The batch's loss, dL/dlogp of each sequence ((B,) chosen and rejected; KTO: `grad`
    (B,) of its rows, rejected None) and TRL-named metrics."""

    loss: float
    d_chosen: np.ndarray
    d_rejected: np.ndarray | None
    metrics: dict


def _f64(*arrays):
    return [np.asarray(a, np.float64) for a in arrays]


def log_sigmoid(x):
    """log(1 / (1 + e^-x)), stable for any x."""
    return -np.logaddexp(0.0, -x)


def sigmoid(x):
    return np.exp(log_sigmoid(x))


def _nll_term(logp_c, n_c):
    """The mean NLL per chosen token of the batch and its derivative per sequence."""
    total = float(n_c.sum())
    return float(-logp_c.sum() / total), np.full(len(logp_c), -1.0 / total)


def _with_sft_term(losses, d_c, d_r, metrics: dict, logp_c, n_c, sft_weight: float):
    """The pairs' mean loss plus sft_weight x the chosen tokens' mean NLL (when set: its
    value is the nll_loss metric), with the derivatives of both."""
    loss = float(losses.mean())
    if sft_weight:
        nll, d_nll = _nll_term(logp_c, n_c)
        loss += sft_weight * nll
        d_c = d_c + sft_weight * d_nll
        metrics["nll_loss"] = nll
    return LossOutput(loss, d_c, d_r, {"loss": loss, **metrics})


def _pair_metrics(rew_c, rew_r, lp_c, lp_r) -> dict:
    return {"rewards/chosen": float(rew_c.mean()), "rewards/rejected": float(rew_r.mean()),
            "rewards/margins": float((rew_c - rew_r).mean()),
            "rewards/accuracies": float((rew_c > rew_r).mean()),
            "logps/chosen": float(lp_c.mean()), "logps/rejected": float(lp_r.mean())}


def _sigmoid_loss(z, beta, smoothing):
    """(losses, dloss/dz) of -(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z)."""
    losses = -(1 - smoothing) * log_sigmoid(beta * z) - smoothing * log_sigmoid(-beta * z)
    grad = -(1 - smoothing) * beta * sigmoid(-beta * z) + smoothing * beta * sigmoid(beta * z)
    return losses, grad


def dpo_loss(logp_c, logp_r, ref_c, ref_r, n_c, n_r, *, beta: float = 0.1,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0,
             sft_weight: float = 0.0) -> LossOutput:
    logp_c, logp_r, ref_c, ref_r, n_c, n_r = _f64(logp_c, logp_r, ref_c, ref_r, n_c, n_r)
    scale_c = scale_r = np.ones_like(n_c)
    if loss_type == "ipo":                          # TRL: IPO on length-averaged log-probs
        scale_c, scale_r = 1.0 / n_c, 1.0 / n_r
    lc, lr, rc, rr = logp_c * scale_c, logp_r * scale_r, ref_c * scale_c, ref_r * scale_r
    z = (lc - lr) - (rc - rr)
    if loss_type == "sigmoid":
        losses, dz = _sigmoid_loss(z, beta, label_smoothing)
    elif loss_type == "hinge":
        losses = np.maximum(0.0, 1.0 - beta * z)
        dz = np.where(1.0 - beta * z > 0, -beta, 0.0)
    elif loss_type == "ipo":
        losses = (z - 1.0 / (2.0 * beta)) ** 2
        dz = 2.0 * (z - 1.0 / (2.0 * beta))
    else:
        raise ValueError(f"unknown DPO loss {loss_type!r}")
    b = len(z)
    return _with_sft_term(losses, dz / b * scale_c, -dz / b * scale_r,
                          _pair_metrics(beta * (lc - rc), beta * (lr - rr), lc, lr),
                          logp_c, n_c, sft_weight)


def orpo_loss(logp_c, logp_r, n_c, n_r, *, orpo_lambda: float = 0.1) -> LossOutput:
    logp_c, logp_r, n_c, n_r = _f64(logp_c, logp_r, n_c, n_r)
    lc, lr = logp_c / n_c, logp_r / n_r
    # log(1 - e^l) = log(-expm1(l)), l < 0
    log_odds = (lc - lr) - (np.log(-np.expm1(lc)) - np.log(-np.expm1(lr)))
    ratio = log_sigmoid(log_odds)
    nll, d_nll = _nll_term(logp_c, n_c)
    loss = float(nll - orpo_lambda * ratio.mean())
    b = len(lc)
    d_ratio = sigmoid(-log_odds)                                       # d log sigmoid(x) / dx
    # d log_odds / d l_c = 1 + e^l / (1 - e^l) = 1 / (1 - e^l_c); / d l_r = -1 / (1 - e^l_r)
    d_c = -orpo_lambda / b * d_ratio / -np.expm1(lc) / n_c + d_nll
    d_r = orpo_lambda / b * d_ratio / -np.expm1(lr) / n_r
    metrics = _pair_metrics(orpo_lambda * lc, orpo_lambda * lr, lc, lr)
    return LossOutput(loss, d_c, d_r, {"loss": loss, **metrics, "nll_loss": nll,
                                       "log_odds_ratio": float(ratio.mean()),
                                       "log_odds_chosen": float(log_odds.mean())})


def simpo_loss(logp_c, logp_r, n_c, n_r, *, beta: float = 2.0, gamma: float = 0.5,
               label_smoothing: float = 0.0, sft_weight: float = 0.0) -> LossOutput:
    logp_c, logp_r, n_c, n_r = _f64(logp_c, logp_r, n_c, n_r)
    lc, lr = logp_c / n_c, logp_r / n_r
    z = (lc - lr) - gamma / beta
    losses, dz = _sigmoid_loss(z, beta, label_smoothing)
    b = len(z)
    return _with_sft_term(losses, dz / b / n_c, -dz / b / n_r,
                          _pair_metrics(beta * lc, beta * lr, lc, lr), logp_c, n_c, sft_weight)


def kto_kl(logp_kl, ref_kl) -> float:
    """TRL's KL estimate: the mean log-ratio of the mismatched pairs, at least 0."""
    logp_kl, ref_kl = _f64(logp_kl, ref_kl)
    return max(0.0, float((logp_kl - ref_kl).mean())) if len(logp_kl) else 0.0


def kto_loss(logp, ref, labels, kl: float, *, beta: float = 0.1, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> LossOutput:
    logp, ref = _f64(logp, ref)
    good = np.asarray(labels, bool)
    r = logp - ref
    z = np.where(good, beta * (r - kl), beta * (kl - r))
    weight = np.where(good, desirable_weight, undesirable_weight)
    losses = weight * (1.0 - sigmoid(z))
    s = sigmoid(z)
    # d(1 - sigmoid(z))/dr = -s (1 - s) dz/dr, dz/dr = beta (desirable) or -beta
    grad = weight * -s * (1 - s) * np.where(good, beta, -beta) / len(r)
    loss = float(losses.mean())
    rewards = beta * r
    mean = lambda x, rows: float(x[rows].mean()) if rows.any() else None   # none: null
    metrics = {"loss": loss, "kl": float(kl),
               "rewards/chosen": mean(rewards, good), "rewards/rejected": mean(rewards, ~good),
               "logps/chosen": mean(logp, good), "logps/rejected": mean(logp, ~good)}
    both = good.any() and (~good).any()
    metrics["rewards/margins"] = (metrics["rewards/chosen"] - metrics["rewards/rejected"]
                                  if both else None)
    # rows classified by their reward's sign, 0 counting as wrong either way as a tie of a
    # pair does (pairs: chosen above rejected, by the caller)
    metrics["rewards/accuracies"] = float(np.where(good, rewards > 0, rewards < 0).mean())
    return LossOutput(loss, grad, None, metrics)
