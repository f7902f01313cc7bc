"""Log-probs under the sampler's truncation: the distribution a top-k / top-p sampler actually drew from.

    kept = encode_kept(mask)            # [B, V] bool (True: the sampler kept the token) -> [B, W] int32
    logp = truncated_logprobs(logits, targets, kept, temperature=1.0)   # [..., V], [...], [..., W] -> [...]
    mask = kept_mask(kept, V)           # [..., W] -> [..., V] bool

A top-k / top-p sampler draws token y at step t from the renormalized distribution over its kept set K_t:

    z = logits / temperature        log pi^trunc(y) = z_y - logsumexp_{v in K_t} z_v

which differs from the full log_softmax(z)[y] by -log(kept mass) per token. K_t is the sampler's set
(pi_old's at sampling time), replayed on every later pass of any weights (pi_theta, pi_old, pi_ref): never
re-thresholded on those passes' own logits (DeepSeek-V3.2's "keep sampling mask"). Worked numbers: logits
[2, 1, 0, -1], top_k=2 keeps {0, 1}; token 1 has log pi^trunc = 1 - log(e^2 + e^1) = -1.3133, the full
log_softmax gives -1.4402: they differ by log(kept mass) = log(0.8808) = -0.1269.

The kept sets' form, per token a row of W int ids padded with -1 (W: the widest row of the batch):
- ids >= 0: the kept ids (a row that keeps at most half the vocabulary);
- ids <= -2: -2 - id are the DROPPED ids (a row that keeps more than half): so a row never lists more than
  V / 2 ids;
- a row of -1 only: no record, the full distribution (padding, or a step taken without truncation).
The target token always counts as kept, so a log-prob is never -inf.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: a row of a kept-sets tensor that records nothing: the full distribution
NO_RECORD = -1


def encode_kept(mask: Tensor) -> Tensor:
    """The kept sets of a [B, V] bool mask (True = kept) as [B, W] int32 ids (the module's form): kept ids,
    or -2 - the dropped ids where more than half the vocabulary is kept; -1 pads. W <= V / 2 + 1."""
    V = mask.shape[-1]
    complement = mask.sum(-1) * 2 > V  # [B]
    listed = mask ^ complement[:, None]  # [B, V]: the ids each row stores
    width = max(1, int(listed.sum(-1).max()))
    # a stable descending sort puts each row's stored ids first, in increasing id order
    flags, ids = torch.sort(listed.to(torch.int8), dim=-1, descending=True, stable=True)
    flags, ids = flags[:, :width].bool(), ids[:, :width]
    ids = torch.where(complement[:, None], -2 - ids, ids)
    return torch.where(flags, ids, NO_RECORD).to(torch.int32)


def kept_mask(kept: Tensor, vocab_size: int) -> Tensor:
    """[..., W] kept sets (encode_kept's form) -> [..., V] bool, True where the token is in the set; a row
    with no record keeps every token."""
    ids = kept.long()
    listed, dropped = ids >= 0, ids <= -2
    # unlisted entries write to an extra column V, cut off after
    where = torch.where(listed, ids, torch.where(dropped, -2 - ids, vocab_size))
    hit = torch.zeros(*ids.shape[:-1], vocab_size + 1, dtype=torch.bool, device=ids.device)
    hit = hit.scatter_(-1, where, True)[..., :vocab_size]
    complement = dropped.any(-1, keepdim=True)
    none = ~(listed | dropped).any(-1, keepdim=True)
    return (hit ^ complement) | none


def truncated_logprobs(
    logits: Tensor, targets: Tensor, kept: Tensor | None, *, temperature: float = 1.0
) -> Tensor:
    """log pi^trunc(target) = z_target - logsumexp over the kept set of z, z = logits / temperature:
    logits [..., V], targets [...], kept [..., W] (encode_kept's form; None: the full distribution) ->
    [...] float32, differentiable in logits (zero gradient outside the kept set)."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    if kept is not None:
        z = keep_only(z, kept, targets)
    return z.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(z, dim=-1)


def keep_only(z: Tensor, kept: Tensor, targets: Tensor) -> Tensor:
    """z [..., V] with -inf outside each position's kept set (kept [..., W]) and its target [...]."""
    mask = kept_mask(kept.to(z.device), z.shape[-1])
    mask.scatter_(-1, targets[..., None], True)  # the target always counts
    return z.masked_fill(~mask, float("-inf"))
