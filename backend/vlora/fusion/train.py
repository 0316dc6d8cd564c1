"""Training one LoRA adapter with PEFT, with or without vision task heads, on vision datasets.

The adapter is a PEFT LoRA on the language decoder's projections (the server applies LoRA there and
nowhere else), and each dataset gets a task head: ``nn.Linear(hidden, labels)`` on the final-norm
hidden state at the prompt's last token, the same state the engine hands to a head at serving time
(``StepResult.hidden``). Modes:

- ``head``: cross-entropy of the head; the LoRA learns features for it. A new head starts from a
  linear probe fitted (L-BFGS) on the adapter's current features, and after training every trained
  head is refitted the same way on the final features (``refit_heads``): the head then matches the
  features the LoRA ended with, however few steps it took;
- ``lm``: no head; the LoRA learns to generate the label (``" <label></s>"``) through the LM head;
- ``both``: the sum of the two losses; the adapter answers with a head and in text.

The vision tower and projector are frozen (an adapter cannot change them), so each image is encoded
once, when a dataset is prepared, and training runs only the decoder. Prompts are the dataset's
template with one ``<image>`` per image, tokenized by the loader's ``build_prompt_ids`` exactly as the
server tokenizes the same text, so what is trained is what is served. Sequences of one length train
together (no padding).

``snapshot()`` and ``restore()`` copy every trainable tensor (LoRA and heads) and the set of heads, so
a rejected fusion step rolls the adapter back bit for bit.
"""
from __future__ import annotations

import math
import random
from contextlib import nullcontext
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch
from torch import nn
import torch.nn.functional as F

from vlora.fusion.datasets import VisionDataset
from vlora.heads import TaskHead, save_heads

MODES = ("head", "lm", "both")
ProgressFn = Callable[[str], None]


@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of one adapter. ``steps`` are optimizer steps per dataset."""

    r: int = 8
    lora_alpha: float = 16.0
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    mode: str = "head"
    steps: int = 150
    batch_size: int = 16
    lr: float = 3e-3
    head_lr: float = 5e-3
    weight_decay: float = 0.0
    seed: int = 0
    eval_batch_size: int = 64
    log_every: int = 25
    head_init: str = "probe"  # "probe": fit the new head on the adapter's current features first; "random"
    probe_samples: int = 256  # training samples the probe is fitted on
    refit_heads: bool = True  # after training, refit the heads (probe) on the adapter's final features

    def __post_init__(self) -> None:
        if self.head_init not in ("probe", "random"):
            raise ValueError(f"head_init must be 'probe' or 'random', got {self.head_init!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.r < 1 or self.steps < 0 or self.batch_size < 1 or self.eval_batch_size < 1:
            raise ValueError("r, batch_size and eval_batch_size must be >= 1 and steps >= 0")
        if not (self.lr > 0 and self.head_lr > 0):
            raise ValueError("learning rates must be positive")
        allowed = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        bad = [m for m in self.target_modules if m not in allowed]
        if bad or not self.target_modules:
            raise ValueError(f"target_modules must be a non-empty subset of {allowed}, got {list(self.target_modules)}")

    @property
    def uses_head(self) -> bool:
        return self.mode in ("head", "both")

    @property
    def uses_lm(self) -> bool:
        return self.mode in ("lm", "both")


@dataclass
class _Bucket:
    """Samples of one split whose prompts (and answers) have the same lengths."""

    prompt_ids: torch.Tensor  # [n, P]
    answer_ids: torch.Tensor  # [n, A]: " <label>" tokens then EOS
    features: torch.Tensor  # [n, images * tokens_per_image, hidden]
    labels: torch.Tensor  # [n] label indices


@dataclass
class PreparedDataset:
    """A dataset's splits encoded for the decoder: token ids and image features, bucketed by length."""

    dataset: VisionDataset
    splits: dict[str, list[_Bucket]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.dataset.name

    def size(self, split: str) -> int:
        return sum(len(b.labels) for b in self.splits.get(split, []))


def lora_target_regex(modules: Iterable[str]) -> str:
    """PEFT ``target_modules`` limited to the language model (not the CLIP tower's q/k/v projections)."""
    return r".*language_model.*\.(" + "|".join(modules) + ")"


class AdapterTrainer:
    """One PEFT LoRA adapter (plus heads) on a loaded LLaVA model, trained and evaluated in place.

    The trainer owns ``loaded.model``: PEFT wraps its decoder projections. ``new_adapter()`` starts a
    fresh adapter (new LoRA initialisation, no heads) on the same model.
    """

    def __init__(self, loaded, config: TrainConfig, progress: Optional[ProgressFn] = None) -> None:
        from peft import LoraConfig as PeftLoraConfig, get_peft_model

        self.loaded = loaded
        self.config = config
        self.progress = progress or (lambda msg: None)
        self.device = next(loaded.model.parameters()).device
        self.hidden_size = int(loaded.text_config.hidden_size)
        loaded.model.requires_grad_(False)
        self.peft_config = PeftLoraConfig(r=config.r, lora_alpha=config.lora_alpha, lora_dropout=0.0, bias="none",
                                          target_modules=lora_target_regex(config.target_modules),
                                          init_lora_weights=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self.peft = get_peft_model(loaded.model, self.peft_config)
        self.peft.eval()  # no dropout anywhere; gradients still flow to the LoRA weights
        inner = loaded.model.model
        self.decoder = inner.language_model
        self.vision_tower = inner.vision_tower
        self.projector = inner.multi_modal_projector
        self.lm_head = loaded.model.lm_head
        self.heads = nn.ModuleDict()
        self.head_info: dict[str, VisionDataset] = {}
        self.adapter_index = 0
        self._eos = loaded.tokenizer.eos_token_id

    # -- data ----------------------------------------------------------------------------------
    @torch.no_grad()
    def prepare(self, ds: VisionDataset, splits: Sequence[str] = ("train", "val", "test")) -> PreparedDataset:
        """Tokenize and encode the images of ``splits`` once (the vision side is frozen)."""
        from vlora.models.images import pixel_values
        from vlora.models.loader import build_prompt_ids

        prepared = PreparedDataset(ds)
        for split in splits:
            groups: dict[tuple[int, int], list] = {}
            prompt_cache: dict[int, list[int]] = {}
            samples = ds.split(split)
            for start in range(0, len(samples), 64):
                chunk = samples[start:start + 64]
                pv = pixel_values([img for s in chunk for img in s.images], self.loaded.image_processor)
                feats = self._image_features(pv)  # [images, T, H]
                k = 0
                for s in chunk:
                    n = len(s.images)
                    if n not in prompt_cache:
                        prompt_cache[n] = build_prompt_ids(self.loaded, ds.prompt_for(n), n, False)
                    answer = self._answer_ids(s.label)
                    f = feats[k:k + n].reshape(-1, feats.shape[-1])
                    k += n
                    groups.setdefault((len(prompt_cache[n]), len(answer)), []).append(
                        (prompt_cache[n], answer, f, ds.label_index(s.label)))
            buckets = []
            for key in sorted(groups):
                rows = groups[key]
                buckets.append(_Bucket(
                    prompt_ids=torch.tensor([r[0] for r in rows], dtype=torch.long, device=self.device),
                    answer_ids=torch.tensor([r[1] for r in rows], dtype=torch.long, device=self.device),
                    features=torch.stack([r[2] for r in rows]),
                    labels=torch.tensor([r[3] for r in rows], dtype=torch.long, device=self.device)))
            prepared.splits[split] = buckets
        return prepared

    def _answer_ids(self, label: str) -> list[int]:
        ids = list(self.loaded.tokenizer(" " + label, add_special_tokens=False)["input_ids"])
        return ids + ([self._eos] if self._eos is not None else [])

    def _image_features(self, pv: torch.Tensor) -> torch.Tensor:
        """As LlavaModel.get_image_features and the engine's ModelRunner.encode_images."""
        cfg = self.loaded.model.config
        out = self.vision_tower(pv.to(self.device, self.loaded.model.dtype), output_hidden_states=True)
        layers = cfg.vision_feature_layer if isinstance(cfg.vision_feature_layer, (list, tuple)) else [cfg.vision_feature_layer]
        feats = [out.hidden_states[i][:, 1:] if cfg.vision_feature_select_strategy == "default" else out.hidden_states[i]
                 for i in layers]
        return self.projector(torch.cat(feats, dim=-1)).float()

    # -- the model ---------------------------------------------------------------------------
    def _hidden(self, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states [n, L, H] of token ids [n, L] with image features spliced in."""
        emb = self.decoder.embed_tokens(ids)
        mask = (ids == self.loaded.image_token_id).unsqueeze(-1)
        emb = emb.masked_scatter(mask, feats.to(emb.dtype))
        return self.decoder(inputs_embeds=emb, use_cache=False).last_hidden_state

    def add_head(self, ds: VisionDataset) -> None:
        """A head for ``ds`` (a new task in this adapter); small random init from the trainer's seed."""
        if ds.name in self.heads:
            raise ValueError(f"adapter already has a head for task {ds.name!r}")
        head = nn.Linear(self.hidden_size, len(ds.labels))
        gen = torch.Generator().manual_seed(self.config.seed * 1009 + len(self.heads) + 31 * self.adapter_index)
        with torch.no_grad():
            head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * 0.02)
            head.bias.zero_()
        self.heads[ds.name] = head.to(self.device)
        self.head_info[ds.name] = ds

    def fit_head(self, prepared: PreparedDataset, split: str = "train", *, use_lora: bool = True,
                 max_iter: int = 100, l2: float = 1e-2) -> None:
        """Fit the task's head alone (a linear probe, L-BFGS) on the adapter's current features.

        A head that starts from the probe makes LoRA training start from what the features already
        tell, instead of from chance; with ``use_lora=False`` it is the base model's probe.
        """
        x, y = self.last_hidden(prepared, split, use_lora=use_lora, limit=self.config.probe_samples)
        head = self.heads[prepared.name]
        w = head.weight.detach().clone().requires_grad_(True)
        b = head.bias.detach().clone().requires_grad_(True)
        opt = torch.optim.LBFGS([w, b], max_iter=max_iter, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(x @ w.T + b, y) + l2 * w.pow(2).sum()
            loss.backward()
            return loss

        with torch.enable_grad():
            opt.step(closure)
        with torch.no_grad():
            head.weight.copy_(w)
            head.bias.copy_(b)

    def lora_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.peft.named_parameters() if "lora_" in n}

    def trainable(self) -> dict[str, torch.Tensor]:
        params = dict(self.lora_parameters())
        params.update({f"heads.{n}": p for n, p in self.heads.named_parameters()})
        return params

    # -- training ------------------------------------------------------------------------------
    def train(self, datasets: Sequence[PreparedDataset], steps: Optional[int] = None, *, label: str = "") -> list[float]:
        """``steps`` optimizer steps (default: config.steps per dataset) over ``datasets``, round robin.

        Returns the loss of each step. Heads are created for datasets that have none.
        """
        cfg = self.config
        steps = cfg.steps * len(datasets) if steps is None else steps
        if cfg.uses_head:
            for p in datasets:
                if p.name not in self.heads:
                    self.add_head(p.dataset)
                    if cfg.head_init == "probe":
                        self.fit_head(p)
        lora = [p for p in self.lora_parameters().values()]
        groups = [{"params": lora, "lr": cfg.lr}]
        if cfg.uses_head:
            groups.append({"params": [p for d in datasets for p in self.heads[d.name].parameters()], "lr": cfg.head_lr})
        for g in groups:
            for p in g["params"]:
                p.requires_grad_(True)
        opt = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
        rng = random.Random(cfg.seed * 7919 + self.adapter_index * 104729 + sum(len(d.name) for d in datasets))
        losses: list[float] = []
        t0 = time.perf_counter()
        warmup = max(1, steps // 10)
        for step in range(steps):
            scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / max(1, steps)))
            for g, base in zip(opt.param_groups, [cfg.lr, cfg.head_lr]):
                g["lr"] = base * scale
            prepared = datasets[step % len(datasets)]
            bucket = self._pick_bucket(prepared.splits["train"], rng)
            idx = torch.tensor([rng.randrange(len(bucket.labels)) for _ in range(cfg.batch_size)], device=self.device)
            loss = self._loss(prepared.name, bucket, idx)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            if cfg.log_every and ((step + 1) % cfg.log_every == 0 or step + 1 == steps):
                recent = losses[-cfg.log_every:]
                self.progress(f"{label or '+'.join(d.name for d in datasets)}: step {step + 1}/{steps} "
                              f"loss {sum(recent) / len(recent):.3f} ({time.perf_counter() - t0:.0f}s)")
        opt.zero_grad(set_to_none=True)
        if cfg.uses_head and cfg.refit_heads:
            for p in datasets:
                self.fit_head(p)
        return losses

    @staticmethod
    def _pick_bucket(buckets: list[_Bucket], rng: random.Random) -> _Bucket:
        if not buckets:
            raise ValueError("the training split is empty")
        sizes = [len(b.labels) for b in buckets]
        return rng.choices(buckets, weights=sizes)[0]

    def _loss(self, task: str, b: _Bucket, idx: torch.Tensor) -> torch.Tensor:
        prompt, feats = b.prompt_ids[idx], b.features[idx]
        loss = torch.zeros((), device=self.device)
        if self.config.uses_lm:
            ids = torch.cat([prompt, b.answer_ids[idx]], dim=1)
            hidden = self._hidden(ids, feats)
            P, A = prompt.shape[1], b.answer_ids.shape[1]
            logits = self.lm_head(hidden[:, P - 1:P + A - 1]).float()
            loss = loss + F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b.answer_ids[idx].reshape(-1))
            last = hidden[:, P - 1]
        else:
            last = self._hidden(prompt, feats)[:, -1]
        if self.config.uses_head:
            loss = loss + F.cross_entropy(self.heads[task](last).float(), b.labels[idx])
        return loss

    # -- evaluation ----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, prepared: PreparedDataset, split: str = "val", *, use_head: Optional[bool] = None,
                 use_lora: bool = True) -> float:
        """Accuracy on ``split``: the head's argmax, or (``use_head=False``) whether greedy generation
        yields exactly the label and EOS (checked in one teacher-forced pass: greedy decoding reproduces
        the target iff every target token is the argmax after its prefix)."""
        use_head = (prepared.name in self.heads) if use_head is None else use_head
        correct = total = 0
        ctx = self.peft.disable_adapter() if not use_lora else nullcontext()
        with ctx:
            for b in prepared.splits[split]:
                for start in range(0, len(b.labels), self.config.eval_batch_size):
                    sl = slice(start, start + self.config.eval_batch_size)
                    prompt, feats = b.prompt_ids[sl], b.features[sl]
                    if use_head:
                        last = self._hidden(prompt, feats)[:, -1]
                        pred = self.heads[prepared.name](last).argmax(-1)
                        correct += int((pred == b.labels[sl]).sum())
                    else:
                        ids = torch.cat([prompt, b.answer_ids[sl]], dim=1)
                        P, A = prompt.shape[1], b.answer_ids.shape[1]
                        logits = self.lm_head(self._hidden(ids, feats)[:, P - 1:P + A - 1])
                        correct += int((logits.argmax(-1) == b.answer_ids[sl]).all(dim=1).sum())
                    total += len(b.labels[sl])
        return correct / total if total else 0.0

    @torch.no_grad()
    def last_hidden(self, prepared: PreparedDataset, split: str, *, use_lora: bool = True,
                    limit: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states at the prompts' last token and the label indices of ``split`` (for probes and
        parity); ``limit`` takes that many samples, spread over the length buckets."""
        hs, ys = [], []
        total = prepared.size(split)
        ctx = self.peft.disable_adapter() if not use_lora else nullcontext()
        with ctx:
            for b in prepared.splits[split]:
                n = len(b.labels) if limit is None or limit >= total else max(1, round(len(b.labels) * limit / total))
                for start in range(0, n, self.config.eval_batch_size):
                    sl = slice(start, min(n, start + self.config.eval_batch_size))
                    hs.append(self._hidden(b.prompt_ids[sl], b.features[sl])[:, -1].float())
                    ys.append(b.labels[sl])
        return torch.cat(hs), torch.cat(ys)

    # -- state ---------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """A copy of every trainable tensor and of the head list: what ``restore`` returns to."""
        return {"tensors": {n: p.detach().clone() for n, p in self.trainable().items()},
                "heads": list(self.heads.keys())}

    @torch.no_grad()
    def restore(self, snap: dict) -> None:
        """Return to ``snap`` bit for bit: heads added since are dropped, every tensor is copied back."""
        for name in [n for n in self.heads.keys() if n not in snap["heads"]]:
            del self.heads[name]
            self.head_info.pop(name, None)
        current = self.trainable()
        if set(current) != set(snap["tensors"]):
            raise RuntimeError("restore: the snapshot's tensors do not match the adapter's")
        for n, p in current.items():
            p.copy_(snap["tensors"][n])

    def matches(self, snap: dict) -> bool:
        """Whether the adapter's state equals ``snap`` exactly (bitwise)."""
        current = self.trainable()
        return (list(self.heads.keys()) == snap["heads"] and set(current) == set(snap["tensors"])
                and all(torch.equal(p, snap["tensors"][n]) for n, p in current.items()))

    @torch.no_grad()
    def new_adapter(self) -> None:
        """Start the next adapter: LoRA re-initialised (A random from a seed, B zero), no heads."""
        self.adapter_index += 1
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.config.seed * 1_000_003 + self.adapter_index)
            for module in self.peft.modules():
                if hasattr(module, "reset_lora_parameters") and "default" in getattr(module, "lora_A", {}):
                    module.reset_lora_parameters("default", True)
        self.heads = nn.ModuleDict()
        self.head_info = {}

    def head_objects(self) -> dict[str, TaskHead]:
        return {name: TaskHead(task=name, task_type=self.head_info[name].task_type, labels=self.head_info[name].labels,
                               weight=h.weight.detach().float().cpu(), bias=h.bias.detach().float().cpu(),
                               prompt=self.head_info[name].prompt)
                for name, h in self.heads.items()}

    def save(self, out: Path, *, description: str = "", name: Optional[str] = None) -> Path:
        """Write the adapter as a PEFT folder (adapter_config.json, adapter_model.safetensors) plus its heads;
        ``name`` titles its README (default: the folder's name)."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self.peft.save_pretrained(str(out))
        if self.heads:
            save_heads(out, self.head_objects())
        lines = [f"# {name or out.name}", "", description or "A LoRA adapter trained by `vlora train` / `vlora fuse`.", "",
                 f"PEFT LoRA r={self.config.r}, alpha={self.config.lora_alpha}, targets "
                 f"{', '.join(self.config.target_modules)}; mode {self.config.mode}.", ""]
        for name, ds in self.head_info.items():
            lines += [f"- task head `{name}` ({ds.task_type}): labels {', '.join(ds.labels)}",
                      f"  prompt: `{ds.prompt}` ({{images}} = one <image> per image)"]
        (out / "README.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
        return out
