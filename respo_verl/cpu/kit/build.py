"""Build the CPU kit: tokenizer, tiny Qwen3 (or Qwen3-MoE) with a supervised warm start, and verl RLHF parquet files.

The kit is deterministic for a given :class:`KitSpec` (torch runs the warm start on one thread with a fixed seed) and
cached, so that every run and test reuses one build. ``<variant>`` is ``dense`` or ``moe`` (the addition task,
``task.py``) or ``chain`` (the regime task of the demo, ``chain.py``, :data:`CHAIN`); the ``device=cpu`` preset
points verl at ``<root>/dense``, ``+task=cpu_chain`` at ``<root>/chain``:

    <root>/<variant>/model/        save_pretrained (config, weights, generation config, tokenizer files)
    <root>/<variant>/train.parquet verl RLHF format: data_source, prompt (chat messages), ability, reward_model, ...
    <root>/<variant>/val.parquet
    <root>/<variant>/kit.json      the spec, its hash, and the warm start's measured accuracy

A cached kit whose hash differs from the requested spec's (an older recipe) is rebuilt.

``root`` is ``$RESPO_VERL_CPU_KIT`` when set, else ``~/.cache/respo_verl/cpu_kit``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from respo_verl.cpu.kit import chain, task
from respo_verl.cpu.kit.model import CACHE_ROOT, build_tiny_qwen3

KIT_ENV = "RESPO_VERL_CPU_KIT"
DEFAULT_ROOT = CACHE_ROOT / "cpu_kit"
# Bumped whenever the task, the tokenizer or the warm-start recipe changes, so that a stale cached kit is not reused.
KIT_VERSION = 2
KIT_FILE = "kit.json"
TASKS = {"addition": task, "chain": chain}


@dataclass(frozen=True)
class KitSpec:
    """Everything that determines a kit.

    Attributes:
        moe: build ``Qwen3MoeForCausalLM`` (every layer sparse, top-k routing with normalised top-k probabilities,
            shaped like Qwen3-30B-A3B in miniature) instead of the dense ``Qwen3ForCausalLM``.
        hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim: the Qwen3 shape (GQA, q/k
            norm as in Qwen3).
        num_experts, experts_per_token, moe_intermediate_size: the MoE shape.
        train_prompts, val_prompts: dataset sizes.
        warm_start_steps, warm_start_batch, warm_start_lr: the supervised warm start on correct responses; short
            enough that the model is right only part of the time, so that RL has both signs of advantage.
        seed: initialisation, data and warm-start seed.
        task: ``addition`` (``task.py``) or ``chain`` (``chain.py``, dense only).
        complete_share: chain task only: the share of complete chains in the warm start's data (the rest break
            off), which sets the base model's success rate.
    """

    task: str = "addition"
    moe: bool = False
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    # vLLM's CPU attention takes head sizes of 32, 64, 80, ... only; the dense and MoE kits are sampled by vLLM too.
    head_dim: int = 32
    num_experts: int = 4
    experts_per_token: int = 2
    moe_intermediate_size: int = 64
    train_prompts: int = 512
    val_prompts: int = 32
    warm_start_steps: int = 300
    warm_start_batch: int = 64
    warm_start_lr: float = 3e-3
    seed: int = 0
    complete_share: float = 0.0

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"KitSpec.task must be one of {sorted(TASKS)}, got {self.task!r}")
        if self.task == "chain" and self.moe:
            raise ValueError("the chain task's kit is dense only (KitSpec(task='chain', moe=False))")

    @property
    def variant(self) -> str:
        if self.task == "chain":
            return "chain"
        return "moe" if self.moe else "dense"

    def key(self) -> str:
        blob = json.dumps({"version": KIT_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Kit:
    """Paths of a built kit."""

    root: Path

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def train_files(self) -> Path:
        return self.root / "train.parquet"

    @property
    def val_files(self) -> Path:
        return self.root / "val.parquet"

    def info(self) -> dict:
        return json.loads((self.root / KIT_FILE).read_text())


# The demo's regime task: long answers (the chain task's 51 tokens) from a base model right about a third of the time.
# Its head size stays 16 (the demo's measured figures are on this model); the chain task is sampled by hf_cpu only.
CHAIN = KitSpec(task="chain", head_dim=16, warm_start_steps=400, complete_share=0.4, train_prompts=1024)


def spec_of(variant: str) -> KitSpec:
    """The spec whose kit lives in the folder ``variant`` (``dense``, ``moe`` or ``chain``)."""
    specs = {"dense": KitSpec(), "moe": KitSpec(moe=True), "chain": CHAIN}
    if variant not in specs:
        raise ValueError(f"no CPU kit variant {variant!r}: one of {sorted(specs)}")
    return specs[variant]


def kit_root() -> Path:
    return Path(os.environ.get(KIT_ENV) or DEFAULT_ROOT).expanduser()


def build_tokenizer(spec: KitSpec | None = None):
    """The tokenizer of ``spec``'s task (the addition task's by default)."""
    if spec is not None and spec.task == "chain":
        return chain.build_tokenizer()
    return _addition_tokenizer()


def _addition_tokenizer():
    """A one-token-per-character tokenizer (``tokenizers`` WordLevel) with a chat template, as a fast HF tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*task.SPECIAL_TOKENS, *task.CHARACTERS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=task.UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    template = (
        "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}" + task.PROMPT_SUFFIX + "{% endif %}"
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=task.BOS,
        eos_token=task.EOS,
        pad_token=task.PAD,
        unk_token=task.UNK,
        chat_template=template,
        model_max_length=task.MAX_PROMPT_TOKENS + task.MAX_RESPONSE_TOKENS,
    )


def build_model(spec: KitSpec, tokenizer):
    """A freshly initialised tiny Qwen3 / Qwen3-MoE in fp32 (SDPA attention, which runs on CPU)."""
    return build_tiny_qwen3(
        spec,
        vocab_size=len(tokenizer),
        seed=spec.seed,
        moe_config=dict(mlp_only_layers=[], router_aux_loss_coef=0.0),
        max_position_embeddings=128 if spec.task == "chain" else 64,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
        torch_dtype="float32",
    )


def _encode_examples(tokenizer, examples: list[tuple[str, str, bool]]):
    """Token ids of prompt + response (+ end of sequence where the example has it), and a mask selecting the
    response tokens (the SFT targets)."""
    import torch

    rows, masks = [], []
    for prompt_text, response_text, ends_with_eos in examples:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt_text}], add_generation_prompt=True, tokenize=True
        )
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        response = tokenizer(response_text, add_special_tokens=False)["input_ids"]
        response += [tokenizer.eos_token_id] if ends_with_eos else []
        rows.append(prompt + response)
        masks.append([0] * len(prompt) + [1] * len(response))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    target = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (row, mask) in enumerate(zip(rows, masks, strict=True)):
        ids[i, : len(row)] = torch.tensor(row)
        target[i, : len(mask)] = torch.tensor(mask, dtype=torch.bool)
    return ids, target


def _warm_start_examples(spec: KitSpec) -> list[tuple[str, str, bool]]:
    if spec.task == "chain":
        return chain.warm_start_pairs(4096, seed=spec.seed + 1, complete_share=spec.complete_share)
    return [(p.prompt, p.response, True) for p in task.problems(8192, seed=spec.seed + 1)]


def warm_start(model, tokenizer, spec: KitSpec, progress: bool = True) -> None:
    """Supervised fine-tuning for ``spec.warm_start_steps`` AdamW steps: on correct responses (addition), on complete
    chains and chains that break off (chain)."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    generator = torch.Generator().manual_seed(spec.seed)
    pool = _warm_start_examples(spec)
    ids, target = _encode_examples(tokenizer, pool)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.warm_start_lr)
    model.train()
    for _ in tqdm(
        range(spec.warm_start_steps), desc="cpu kit: warm start", disable=None if progress else True, leave=False
    ):
        rows = torch.randint(0, len(pool), (spec.warm_start_batch,), generator=generator)
        batch, mask = ids[rows], target[rows]
        logits = model(input_ids=batch).logits[:, :-1]  # (B, T-1, V)
        loss = F.cross_entropy(logits[mask[:, 1:]], batch[:, 1:][mask[:, 1:]])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()


def sampled_accuracy(model, tokenizer, examples: list, seed: int, task_module=task) -> float:
    """Share of ``examples`` answered correctly by one sample at temperature 1 (as the rollout samples)."""
    import torch

    torch.manual_seed(seed)
    correct = 0
    for problem in examples:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": problem.prompt}],
            add_generation_prompt=True,
            tokenize=True,
            return_tensors="pt",
        )
        prompt_ids = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
        out = model.generate(
            prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=task_module.MAX_RESPONSE_TOKENS,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        text = tokenizer.decode(out[0, prompt_ids.shape[1] :], skip_special_tokens=True)
        correct += task_module.score(text, problem.answer) > 0
    return correct / len(examples)


def _write_parquet(path: Path, examples: list, split: str, task_module=task) -> None:
    import pandas as pd

    rows = [
        {
            "data_source": task_module.DATA_SOURCE,
            "prompt": [{"role": "user", "content": p.prompt}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": p.answer},
            "extra_info": {"split": split, "index": i},
        }
        for i, p in enumerate(examples)
    ]
    pd.DataFrame(rows).to_parquet(path)


def build_kit(spec: KitSpec = KitSpec(), root: Path | None = None, progress: bool = True) -> Kit:
    """The kit of ``spec`` under ``root``, built now unless a complete one is cached there."""
    import torch

    root = (root or kit_root()) / spec.variant
    kit = Kit(root)
    if (root / KIT_FILE).is_file() and kit.info().get("key") == spec.key():
        return kit
    root.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same bits on any machine with this torch build
    task_module = TASKS[spec.task]
    try:
        tokenizer = build_tokenizer(spec)
        model = build_model(spec, tokenizer)
        warm_start(model, tokenizer, spec, progress=progress)
        val = task_module.problems(spec.val_prompts, seed=spec.seed + 3)
        accuracy = sampled_accuracy(model, tokenizer, val, seed=spec.seed, task_module=task_module)
    finally:
        torch.set_num_threads(threads)
    # Build in a scratch folder next to the target and rename: a crash never leaves a half-built kit behind.
    scratch = Path(tempfile.mkdtemp(prefix=f".{spec.variant}-build-", dir=root.parent))
    try:
        model.save_pretrained(scratch / "model")
        tokenizer.save_pretrained(scratch / "model")
        train = task_module.problems(spec.train_prompts, seed=spec.seed + 2)
        _write_parquet(scratch / "train.parquet", train, "train", task_module)
        _write_parquet(scratch / "val.parquet", val, "val", task_module)
        info = {
            "key": spec.key(),
            "version": KIT_VERSION,
            "spec": asdict(spec),
            "warm_start_val_accuracy": accuracy,
            "build_seconds": round(time.perf_counter() - started, 1),
        }
        (scratch / KIT_FILE).write_text(json.dumps(info, indent=2) + "\n")
        if (root / KIT_FILE).is_file() and kit.info().get("key") == spec.key():
            return kit  # another process (a parallel test worker) finished the same kit, which may be in use
        stale = root.with_name(f".{spec.variant}-stale-{os.getpid()}")
        if root.exists():
            root.rename(stale)
        try:
            scratch.rename(root)
        except OSError:  # another process finished the same kit first
            if not (root / KIT_FILE).is_file():
                raise
        finally:
            shutil.rmtree(stale, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return kit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m respo_verl.cpu.kit", description="Build (or find) the CPU kit.")
    parser.add_argument("--moe", action="store_true", help="the Qwen3-MoE variant")
    parser.add_argument("--chain", action="store_true", help="the chain task of the demo (dense)")
    parser.add_argument("--root", type=Path, default=None, help=f"kit folder (default ${KIT_ENV} or {DEFAULT_ROOT})")
    args = parser.parse_args(argv)
    try:
        kit = build_kit(CHAIN if args.chain else KitSpec(moe=args.moe), root=args.root)
    except OSError as exc:
        print(f"cpu kit: cannot write the kit: {exc}", file=sys.stderr)
        return 2
    info = kit.info()
    print(f"{kit.root}  (warm start: {info['warm_start_val_accuracy']:.0%} of validation prompts right at T = 1)")
    return 0
