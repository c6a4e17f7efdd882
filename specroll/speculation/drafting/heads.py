"""Horizon heads: light draft heads on the policy's final hidden state.

Head k (k = 1..H) predicts token t+k+1 from h_t (the policy's own LM head predicts t+1).
Every head ends in the policy's LM head, shared and frozen, never copied: a head is only a
residual block in hidden space.

- `medusa`: `s_k = h + SiLU(A_k h + b_k)` (Medusa-1); the draft of depth k ignores the path.
- `path`  : `s_k = s_{k-1} + SiLU(A_k [s_{k-1}; e(x_{t+k})] + b_k)`, `s_0 = h` (Hydra-style):
  the draft of depth k reads the tokens on its tree path, so children follow the sampled token.

`num_layers` > 1 adds residual layers `s <- s + SiLU(W s + c)` after that block in every head
(Hydra++'s deeper heads): one block is a single nonlinearity over [state; token], which
stopped improving with more data (see docs/design.md, head depth).

All weights start at zero, so an untrained head drafts the policy's next-token distribution,
and layers added to trained heads leave their drafts unchanged until trained.

Draft vocabulary: heads may carry the ids of the tokens they draft among (the policy's most
frequent output tokens, found by head pretraining). Each drafting LM-head product then reads
only those rows (on SmolLM2 1024 of 49152 rows by default). Exactness does not depend on
it: drafts are only proposals that verification accepts or rejects.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from specroll.models.prepacked_linear import (
    PackedWeight,
    PrepackedLinear,
    packed_linear,
    set_prepacked,
    uses_packed_weight,
)

HEAD_TYPES = ("medusa", "path")
FORMAT_VERSION = 3  # 2: optional draft vocabulary; 3: residual layers per head


def model_fingerprint(model_config) -> str:
    """What heads must agree with: architecture and vocabulary of the policy."""
    c = model_config
    return f"{c.model_type}-L{c.num_layers}-D{c.hidden_size}-V{c.vocab_size}"


def draft_policy_top(logits: torch.Tensor, row: torch.Tensor, node: torch.Tensor, draft_vocab: torch.Tensor | None,
                     k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The policy at R tree nodes as heads with a draft vocabulary see it: restricted to that
    vocabulary (all tokens when None) and renormalised, the distribution they are trained to draft
    and their drafts are judged against. Reads only the vocabulary's columns of logits [B, N, V]
    (logits or log-probs) at (row [R], node [R]).

    Returns its top-k log-probs and token ids [R, k], and the log-normaliser [R, 1]: logits at
    other ids of the vocabulary minus it are their log-probs. A node where top-k or top-p left no
    mass on the vocabulary is -inf throughout (its normaliser too).
    """
    if draft_vocab is None:
        restricted = logits[row, node].float()
    else:
        restricted = logits[row[:, None], node[:, None], draft_vocab].float()
    log_normaliser = restricted.logsumexp(-1, keepdim=True)
    top_logp, top = (restricted - log_normaliser).nan_to_num(nan=-math.inf).topk(min(k, restricted.shape[-1]), dim=-1)
    return top_logp, (top if draft_vocab is None else draft_vocab[top]), log_normaliser


@dataclass
class HeadsMeta:
    head_type: str
    num_heads: int
    hidden_size: int
    base_model: str  # model_fingerprint of the policy the heads were trained on
    base_model_name: str = ""  # informational: alias / path of that policy
    version: int = 0  # bumped by every published head update
    format_version: int = FORMAT_VERSION
    num_layers: int = 1  # the first block plus residual hidden-to-hidden layers


class HorizonHeads(nn.Module):
    def __init__(self, head_type: str, num_heads: int, hidden_size: int, num_layers: int = 1) -> None:
        super().__init__()
        if head_type not in HEAD_TYPES:
            raise ValueError(f"head_type must be one of {HEAD_TYPES}, got {head_type!r}")
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.head_type, self.num_heads, self.hidden_size = head_type, num_heads, hidden_size
        self.num_layers = num_layers
        in_features = hidden_size if head_type == "medusa" else 2 * hidden_size
        self.blocks = nn.ModuleList(PrepackedLinear(in_features, hidden_size) for _ in range(num_heads))
        # Per head, the residual layers after its block (empty lists for one-layer heads,
        # so their state dicts are those of format 2).
        self.layers = nn.ModuleList(nn.ModuleList(PrepackedLinear(hidden_size, hidden_size) for _ in range(num_layers - 1))
                                    for _ in range(num_heads))
        for linear in self.linears():
            nn.init.zeros_(linear.weight)
            nn.init.zeros_(linear.bias)
        self.register_buffer("draft_vocab", None)  # [V'] token ids, or None: the whole vocabulary
        self.version = 0
        self.base_model_name = ""
        self.base_model = ""
        self.prepacked = False
        self._packed_draft_lm_head = PackedWeight()

    def linears(self) -> list[PrepackedLinear]:
        return [*self.blocks, *(layer for head in self.layers for layer in head)]

    def deepened(self, num_layers: int) -> "HorizonHeads":
        """These heads with zero-initialised residual layers added up to `num_layers`: they
        draft exactly as these do until trained (a warm start for deeper heads)."""
        if num_layers < self.num_layers:
            raise ValueError(f"heads have {self.num_layers} layers; cannot deepen them to {num_layers}")
        p = self.blocks[0].weight
        deeper = HorizonHeads(self.head_type, self.num_heads, self.hidden_size, num_layers).to(device=p.device, dtype=p.dtype)
        deeper.load_state_dict(self.state_dict(), strict=False)
        deeper.version, deeper.base_model, deeper.base_model_name = self.version, self.base_model, self.base_model_name
        return deeper

    def use_prepacked_linears(self, enabled: bool = True) -> "HorizonHeads":
        """CPU drafting multiplies by prepacked weights (see `models.prepacked_linear`)."""
        self.prepacked = enabled
        set_prepacked(self, enabled)
        return self

    def set_draft_vocab(self, token_ids: torch.Tensor | None) -> None:
        """Draft among `token_ids` only (None: the whole vocabulary)."""
        if token_ids is not None:
            token_ids = token_ids.to(device=self.blocks[0].weight.device, dtype=torch.long).flatten()
        self.draft_vocab = token_ids

    def draft_lm_head(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """The LM-head rows drafting multiplies with: those of the draft vocabulary, or all."""
        if self.draft_vocab is None:
            return lm_head_weight
        return lm_head_weight.index_select(0, self.draft_vocab)

    def draft_logits(self, states: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary. Prepacked on CPU: a packed copy of the rows,
        rebuilt whenever the policy's LM head (or the draft vocabulary) changes."""
        # A compiled step multiplies by the rows themselves: inductor cannot take the packed copy.
        if self.prepacked and uses_packed_weight(states) and not torch.compiler.is_compiling():
            sources = (lm_head_weight,) if self.draft_vocab is None else (lm_head_weight, self.draft_vocab)
            packed = self._packed_draft_lm_head.get(sources, lambda: self.draft_lm_head(lm_head_weight))
            if packed is not None:
                return packed_linear(states, packed)
        return F.linear(states, self.draft_lm_head(lm_head_weight))

    @property
    def form(self) -> str:
        """What drafting's code depends on besides the weights' values: type, depth, layers, vocabulary,
        the weights' dtype and device, packed weights."""
        vocab = 0 if self.draft_vocab is None else self.draft_vocab.numel()
        weight = next(self.parameters())
        structure = f"{self.head_type}-{self.num_heads}x{self.num_layers}-{vocab}"
        return f"{structure} {weight.dtype} {weight.device} prepacked={self.prepacked}"

    def draft_vocab_size(self, lm_head_weight: torch.Tensor) -> int:
        return lm_head_weight.shape[0] if self.draft_vocab is None else self.draft_vocab.numel()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As nn.Module's, but the draft vocabulary (present or not, any size) is taken as given."""
        state = dict(state_dict)
        self.set_draft_vocab(state.pop("draft_vocab", None))  # resized (or dropped) first, so the copy fits
        if self.draft_vocab is not None:
            state["draft_vocab"] = self.draft_vocab
        return super().load_state_dict(state, strict=strict, assign=assign)

    def step(self, k: int, state: torch.Tensor, hidden: torch.Tensor, token_emb: torch.Tensor | None) -> torch.Tensor:
        """Hidden-space state of head k (0-based) from its parent's state (path) or h (medusa)."""
        block = self.blocks[k]
        if self.head_type == "medusa":
            state = hidden + F.silu(block(hidden))
        else:
            state = state + F.silu(block(torch.cat((state, token_emb), dim=-1)))
        for layer in self.layers[k]:
            state = state + F.silu(layer(state))
        return state

    def all_states(self, hidden: torch.Tensor, path_emb: torch.Tensor | None) -> torch.Tensor:
        """States of all heads along known paths (training): hidden [..., D], path_emb [..., H, D]."""
        states, state = [], hidden
        for k in range(self.num_heads):
            state = self.step(k, state, hidden, None if path_emb is None else path_emb[..., k, :])
            states.append(state)
        return torch.stack(states, dim=-2)

    # -- persistence ----------------------------------------------------------------------
    def meta(self) -> HeadsMeta:
        return HeadsMeta(self.head_type, self.num_heads, self.hidden_size, self.base_model,
                         self.base_model_name, self.version, num_layers=self.num_layers)

    def save(self, path: str | Path, dtype: torch.dtype = torch.float32) -> None:
        """Write weights in `dtype` (bfloat16 halves the file; `load` casts to the policy's dtype)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        state = {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
                 for k, v in self.state_dict().items()}
        save_file(state, str(tmp), metadata={"specroll_heads": json.dumps(asdict(self.meta()))})
        tmp.replace(path)

    @classmethod
    def for_model(cls, model, head_type: str = "path", num_heads: int = 4, num_layers: int = 1) -> "HorizonHeads":
        heads = cls(head_type, num_heads, model.config.hidden_size, num_layers)
        heads.base_model = model_fingerprint(model.config)
        heads.base_model_name = model.config.name
        p = next(model.parameters())
        return heads.to(device=p.device, dtype=p.dtype)

    @classmethod
    def from_state(cls, meta: dict, state: dict[str, torch.Tensor]) -> "HorizonHeads":
        """Heads rebuilt from `asdict(heads.meta())` and their state dict (as actors pass them)."""
        m = HeadsMeta(**meta)
        heads = cls(m.head_type, m.num_heads, m.hidden_size, m.num_layers)
        heads.load_state_dict(state)
        heads.version, heads.base_model, heads.base_model_name = m.version, m.base_model, m.base_model_name
        return heads

    @classmethod
    def load(cls, path: str | Path, model) -> "HorizonHeads":
        """Load heads saved for `model`; heads made for another architecture are refused."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"heads file not found: {path}")
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                raw = (f.metadata() or {}).get("specroll_heads")
            state = load_file(str(path))
        except Exception as exc:
            raise ValueError(f"corrupt heads file {path}: {exc}") from exc
        if raw is None:
            raise ValueError(f"{path} has no SpecRoll heads metadata")
        meta = HeadsMeta(**json.loads(raw))
        if meta.format_version > FORMAT_VERSION:
            raise ValueError(f"{path} has heads format {meta.format_version}; this SpecRoll reads <= {FORMAT_VERSION}")
        expected = model_fingerprint(model.config)
        if meta.base_model != expected:
            raise ValueError(
                f"heads in {path} were made for model {meta.base_model} ({meta.base_model_name}), "
                f"not for this policy {expected} ({model.config.name})"
            )
        heads = cls(meta.head_type, meta.num_heads, meta.hidden_size, meta.num_layers)
        heads.load_state_dict(state)
        heads.version, heads.base_model, heads.base_model_name = meta.version, meta.base_model, meta.base_model_name
        p = next(model.parameters())
        return heads.to(device=p.device, dtype=p.dtype)


SHIPPED_HEADS = {"smollm2-135m-instruct": "smollm2-135m-instruct.heads.safetensors"}


HEADS_SUFFIX = ".heads.safetensors"  # a model directory's heads lie beside it: DIR.heads.safetensors


def heads_beside(model_dir: str | Path) -> Path:
    """Where the heads of model directory `model_dir` lie: `DIR.heads.safetensors` beside it."""
    path = Path(model_dir).expanduser()
    return path.with_name(path.name + HEADS_SUFFIX)


def shipped_heads(model_name: str) -> Path:
    """Path of the trained heads for `model_name`: for a model directory, the file beside it
    (`heads_beside`); for an alias, the heads that ship with SpecRoll."""
    if Path(model_name).expanduser().is_dir() and heads_beside(model_name).is_file():
        return heads_beside(model_name)
    if model_name not in SHIPPED_HEADS:
        raise ValueError(f"no shipped heads for {model_name!r}; shipped: {sorted(SHIPPED_HEADS)}")
    path = Path(__file__).resolve().parents[2] / "assets" / "heads" / SHIPPED_HEADS[model_name]
    if not path.is_file():
        raise FileNotFoundError(f"shipped heads for {model_name!r} are missing at {path}")
    return path
