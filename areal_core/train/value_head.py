"""The critic for PPO with GAE (`algo.adv_estimator: gae`): a value head on its own transformer body.

    critic = Critic.from_pretrained(store.url(LAYOUT.init_model), cfg)        # body of the SFT model
    old_v = critic.token_values(ids, attn, grad=False)                    # V before the update
    adv, returns, _ = compute_advantages(cfg.algo, ..., old_values=old_v)
    v = critic.token_values(ids[rows], attn[rows])                        # with gradient
    loss, _ = compute_loss(cfg.algo, ..., values=v, old_values=old_v[rows], returns=returns[rows])
    loss.backward(); critic.step()                                        # own AdamW, own clip

Layout. The critic is the transformer body of the initial (SFT) checkpoint (a separate copy, so
that value regression never moves the published policy) plus a linear head h ↦ w·h + b,
initialised to 0 (V ≡ 0 at the start, so the first advantages are A_t = (γλ)^(T−1−t)·r).
Values are aligned with `token_logprobs`: for a sequence x_0 … x_{T−1},

    values[:, t] = V(x_<t) = w · h_{t−1} + b   for t ≥ 1,   0 at t = 0 and on padding,

the value of the state in which the policy emits x_t (hidden state h_{t−1} of the last token read).

Persistence. The critic's weights and optimizer state go into the trainer checkpoint
(`trainer/checkpoints/step-N/critic.safetensors`, `critic_optimizer.pt`, written before the
checkpoint's COMMITTED marker) and come back on resume; they are never published under
weights/v{N}, since rollout workers only need the policy.
"""

from __future__ import annotations

import io
import math
import pickle
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from areal_core.layout import LAYOUT
from areal_core.store import Store
from areal_core.train.packing import micro_batches_by_tokens, pack, unpack

CRITIC_FILE = "critic.safetensors"
CRITIC_OPTIMIZER_FILE = "critic_optimizer.pt"


class ValueHead(torch.nn.Module):
    """Linear map from the last hidden state to a scalar value, zero-initialised."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.proj.weight)
        torch.nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> values [...] (float32)."""
        return self.proj(hidden.float()).squeeze(-1)


class ValueModel(torch.nn.Module):
    """A transformer body (e.g. `Qwen2Model`, no LM head) followed by a `ValueHead`."""

    def __init__(self, body: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.body = body
        self.head = ValueHead(hidden_size)

    @classmethod
    def from_causal_lm(cls, lm: torch.nn.Module) -> ValueModel:
        """Wrap the body of a causal LM (its `base_model`); the LM head is dropped."""
        return cls(lm.base_model, lm.config.hidden_size)

    def position_values(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-position values [B, L]: entry p is V after reading tokens ≤ p."""
        out = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        return self.head(out.last_hidden_state)

    def token_values(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        packing: bool = False,
        pad_id: int = 0,
        token_budget: int = 0,
    ) -> torch.Tensor:
        """values[:, t] = V(x_<t) for t ≥ 1, 0 at t = 0 and on padding; [N, T] like `token_logprobs`.

        With `packing`, sequences are concatenated without padding (per-sequence position ids,
        block-diagonal attention; see `areal_core.train.packing`), in micro-batches of ≤
        `token_budget` tokens (0: one pass); the result is the same up to float tolerance.
        """
        if not packing:
            v = self.position_values(input_ids, attention_mask)
            v = torch.nn.functional.pad(v[:, :-1], (1, 0))
            return v * attention_mask.to(v.dtype)
        n, t = input_ids.shape
        dev = input_ids.device
        out = torch.zeros(n, t, device=dev)
        lengths = attention_mask.long().sum(1)
        for rows in micro_batches_by_tokens(lengths, token_budget):
            idx = torch.tensor(rows, device=dev)
            sub_t = int(lengths[idx].max())
            packed = pack(input_ids[idx, :sub_t].cpu(), attention_mask[idx, :sub_t].cpu(), 0, pad_id)
            v = self.position_values(packed.input_ids.to(dev), None, packed.position_ids.to(dev))
            # shift: the value at packed position p is read from p − 1; sequence starts are dropped by unpack
            v = torch.nn.functional.pad(v[:, :-1], (1, 0))
            sub = torch.nn.functional.pad(unpack(v, packed), (0, t - sub_t))
            out = out.index_put((idx,), sub.to(dev))
        return out


class Critic:
    """A `ValueModel` with its optimizer and gradient clipping: what the trainer holds for GAE."""

    def __init__(self, model: ValueModel, lr: float, weight_decay: float = 0.0, grad_clip: float = 0.0):
        self.model = model.train()
        self.grad_clip = grad_clip
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99))

    @classmethod
    def from_pretrained(cls, path: str, cfg: Any) -> Critic:
        """Critic on the body of the checkpoint at `path` (`cfg`: the RunConfig; lr = algo.critic.lr
        or train.lr)."""
        from areal_core.models import load_pretrained
        from areal_core.train.loss.critic import CriticSettings

        lm, _ = load_pretrained(path, cfg.device)
        lr = CriticSettings.of(cfg.algo).lr or cfg.train.lr
        return cls(ValueModel.from_causal_lm(lm), lr, cfg.train.weight_decay, cfg.train.grad_clip)

    def token_values(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, grad: bool = True, **kw: Any
    ) -> torch.Tensor:
        """`ValueModel.token_values`; without `grad`, a no-grad pass (the pre-update values)."""
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            return self.model.token_values(input_ids, attention_mask, **kw)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> float:
        """Clip the critic's gradient (train.grad_clip), take an AdamW step; returns the grad norm.
        A NaN/inf norm skips the step, as the policy's does, so that it never reaches the critic's
        weights or AdamW's moments (the caller counts it from the returned norm)."""
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip or float("inf")))
        if math.isfinite(norm):
            self.optimizer.step()
        return norm

    def save(self, store: Store, step: int) -> None:
        """Write the critic into trainer/checkpoints/step-{step}/ (call before its COMMITTED)."""
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()}
        store.write_bytes(LAYOUT.checkpoint_file(step, CRITIC_FILE), st_save(tensors))
        buf = io.BytesIO()
        torch.save(self.optimizer.state_dict(), buf)
        store.write_bytes(LAYOUT.checkpoint_file(step, CRITIC_OPTIMIZER_FILE), buf.getvalue())

    def restore(self, store: Store, step: int) -> None:
        """Load the critic saved with checkpoint step-{step}; raises FileNotFoundError if absent."""
        critic = LAYOUT.checkpoint_file(step, CRITIC_FILE)
        if not store.exists(critic):
            raise FileNotFoundError(
                f"checkpoint {LAYOUT.checkpoint_dir(step)} has no critic ({CRITIC_FILE}); cannot resume PPO with GAE"
            )
        dev = next(self.model.parameters()).device
        self.model.load_state_dict({k: v.to(dev) for k, v in st_load(store.read_bytes(critic)).items()})
        rel = LAYOUT.checkpoint_file(step, CRITIC_OPTIMIZER_FILE)
        try:  # weights_only: a pickle planted in the store must not run code (the state is tensors and numbers)
            blob = torch.load(io.BytesIO(store.read_bytes(rel)), weights_only=True)
        except pickle.UnpicklingError as exc:
            raise ValueError(f"{store.url(rel)} is not a weights-only optimizer state; refused: {exc}"[:500]) from None
        self.optimizer.load_state_dict(blob)
