"""Architecture facts the planner needs: shipped for the two models of the paper, or read from an HF config.json.

Parameter counts follow the Qwen3 / Qwen3-MoE layout (no biases, RMSNorm before attention and MLP, per-head q/k
RMSNorm, SwiGLU MLPs with gate, up and down projections).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path


class ModelConfigError(ValueError):
    """A model config.json is missing, unreadable, or lacks a field the planner needs."""


@dataclass(frozen=True)
class ModelShape:
    """Shapes of a decoder-only transformer (dense or MoE).

    Attributes:
        name: display name.
        num_layers: transformer layers.
        hidden_size: model width h.
        num_attention_heads: query heads.
        num_kv_heads: key/value heads (query groups).
        head_dim: per-head width.
        vocab_size: rows of the embedding / output layer.
        tie_word_embeddings: output layer shares the embedding matrix.
        ffn_hidden_size: intermediate width of a dense MLP layer (0 if every layer is MoE).
        num_experts: routed experts per MoE layer (0: dense model).
        moe_topk: experts each token is routed to.
        moe_ffn_hidden_size: intermediate width of one expert.
        num_moe_layers: layers whose MLP is an MoE block (the rest are dense).
        model_type: the config's ``model_type`` (``qwen3``, ``qwen3_moe``), where it is read from one.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    ffn_hidden_size: int = 0
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    num_moe_layers: int = 0
    model_type: str = ""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and self.num_moe_layers > 0

    # ---- parameter counts (elements) ----
    @property
    def attention_params_per_layer(self) -> int:
        """q, k, v, o projections, per-head q/k norms and the two RMSNorm weights of a layer."""
        h, hd = self.hidden_size, self.head_dim
        q = h * self.num_attention_heads * hd
        kv = 2 * h * self.num_kv_heads * hd
        o = self.num_attention_heads * hd * h
        return q + kv + o + 2 * hd + 2 * h

    @property
    def dense_mlp_params(self) -> int:
        """One SwiGLU MLP: gate, up (h x ffn each) and down (ffn x h)."""
        return 3 * self.hidden_size * self.ffn_hidden_size

    @property
    def expert_params(self) -> int:
        """One routed expert (SwiGLU)."""
        return 3 * self.hidden_size * self.moe_ffn_hidden_size

    @property
    def router_params(self) -> int:
        return self.hidden_size * self.num_experts

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def output_params(self) -> int:
        """Output layer (0 when tied to the embedding) plus the final norm."""
        return (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size) + self.hidden_size

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def total_expert_params(self) -> int:
        return self.num_moe_layers * self.num_experts * self.expert_params

    @property
    def replicated_params_per_layer(self) -> int:
        """Norm weights of a layer, which megatron keeps whole on every TP rank: the two RMSNorm weights and the
        per-head q/k norms (an MoE layer's router is replicated too; :meth:`layer_params_on_tp_rank` adds it)."""
        return 2 * self.head_dim + 2 * self.hidden_size

    def layer_params_on_tp_rank(self, tp: int) -> float:
        """Non-expert parameters of one layer on one TP rank (averaged over MoE and dense layers).

        The projections and dense MLPs are split over TP; norms and routers are replicated (megatron-core's
        ``TopKRouter`` weight and its norm modules are not tensor-parallel).
        """
        replicated = self.replicated_params_per_layer * self.num_layers + self.num_moe_layers * self.router_params
        split = self.total_non_expert_layer_params - replicated
        return (split / tp + replicated) / self.num_layers

    @property
    def total_non_expert_layer_params(self) -> int:
        """Everything inside the transformer layers except routed experts (attention, routers, dense MLPs)."""
        return (
            self.num_layers * self.attention_params_per_layer
            + self.num_moe_layers * self.router_params
            + self.num_dense_layers * self.dense_mlp_params
        )

    @property
    def total_params(self) -> int:
        return (
            self.total_non_expert_layer_params + self.total_expert_params + self.embedding_params + self.output_params
        )

    @property
    def active_params(self) -> int:
        """Parameters one token touches (top-k experts instead of all)."""
        return self.total_params - self.total_expert_params + self.num_moe_layers * self.moe_topk * self.expert_params


# Published architecture of Qwen3-30B-A3B (its config.json): 48 MoE layers, 128 experts top-8, untied embeddings.
QWEN3_30B_A3B = ModelShape(
    name="Qwen3-30B-A3B",
    num_layers=48,
    hidden_size=2048,
    num_attention_heads=32,
    num_kv_heads=4,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=False,
    ffn_hidden_size=6144,  # config.json intermediate_size; unused, every layer is MoE
    num_experts=128,
    moe_topk=8,
    moe_ffn_hidden_size=768,
    num_moe_layers=48,
)

# Published config.json of Qwen3-1.7B(-Base): dense, tied embeddings.
QWEN3_1P7B = ModelShape(
    name="Qwen3-1.7B",
    num_layers=28,
    hidden_size=2048,
    num_attention_heads=16,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=True,
    ffn_hidden_size=6144,
)

SHIPPED_MODELS: dict[str, ModelShape] = {"qwen3_30b_a3b": QWEN3_30B_A3B, "qwen3_1p7b": QWEN3_1P7B}

# A Hugging Face hub id as verl's model.path takes it: <owner>/<name>.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_REQUIRED_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")


def _moe_layer_count(cfg: dict, num_layers: int) -> int:
    """MoE layers of a Qwen-MoE style config: every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``."""
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense_only = set(cfg.get("mlp_only_layers", []) or [])
    first_dense = int(cfg.get("first_k_dense_replace", 0) or 0)  # DeepSeek-style configs
    return sum(1 for i in range(num_layers) if i not in dense_only and i >= first_dense and (i + 1) % step == 0)


def shape_from_hf_config(path: str | Path) -> ModelShape:
    """Read a HuggingFace ``config.json`` (or a directory holding one) into a :class:`ModelShape`.

    Raises:
        ModelConfigError: the file is missing, is not a JSON object, or lacks a required field.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"model config not found: {path} (pass an HF config.json or the model directory)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ModelConfigError(f"model config {path} is not valid JSON: {err}") from err
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"model config {path} must be a JSON object, got {type(cfg).__name__}")
    cfg = cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg
    missing = [k for k in _REQUIRED_KEYS if k not in cfg]
    if missing:
        raise ModelConfigError(f"model config {path} lacks {', '.join(missing)}")
    try:
        num_layers = int(cfg["num_hidden_layers"])
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        num_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", cfg.get("n_routed_experts", 0))) or 0)
        shape = ModelShape(
            name=str(cfg.get("_name_or_path") or (cfg.get("architectures") or [path.parent.name])[0]),
            num_layers=num_layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            ffn_hidden_size=int(cfg.get("intermediate_size", 0) or 0),
            num_experts=num_experts,
            moe_topk=int(cfg.get("num_experts_per_tok", 0) or 0),
            moe_ffn_hidden_size=int(cfg.get("moe_intermediate_size", 0) or 0),
            num_moe_layers=_moe_layer_count(cfg, num_layers) if num_experts else 0,
            model_type=str(cfg.get("model_type") or ""),
        )
    except (TypeError, ValueError) as err:
        raise ModelConfigError(f"model config {path} has a non-numeric shape field: {err}") from err
    if shape.is_moe and (shape.moe_topk <= 0 or shape.moe_ffn_hidden_size <= 0):
        raise ModelConfigError(f"model config {path} has experts but no num_experts_per_tok / moe_intermediate_size")
    if shape.num_dense_layers and shape.ffn_hidden_size <= 0:
        raise ModelConfigError(f"model config {path} has dense layers but no intermediate_size")
    return shape


def local_model_config(model_path: str) -> Path | None:
    """The ``config.json`` of a job's ``actor_rollout_ref.model.path`` where it is on this machine, else None.

    A folder holding one is read as it is; a hub id (``Qwen/Qwen3-1.7B``) is looked up in the local Hugging Face
    cache only, at the revision ``main`` points to: nothing is downloaded.
    """
    folder = Path(model_path).expanduser()
    if folder.is_dir():
        return folder / "config.json" if (folder / "config.json").is_file() else None
    if not HUB_ID.match(model_path):
        return None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(model_path, "config.json")
    return Path(found) if isinstance(found, str) else None  # None, or a marker that the hub has no such file


def job_model_shape(cfg) -> ModelShape | None:
    """The shape of a composed job's model (``actor_rollout_ref.model.path``) from its ``config.json`` on this machine
    (:func:`local_model_config`), or None: unknown here, an interpolation unresolved here (an environment
    variable), or not a shape the rules read."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        raw = OmegaConf.select(cfg, "actor_rollout_ref.model.path", default=None)
        config = local_model_config(str(raw)) if raw is not None else None
        return shape_from_hf_config(config) if config is not None else None
    except (OmegaConfBaseException, ModelConfigError):
        return None
