"""Stage 3 of drafter training: DFlash training (DFlash paper §4.2).

For each sequence the frozen target gives the tapped hidden states of every position; random
anchors start blocks ``[anchor_token, mask x (S-1)]``; block j sees context keys strictly before
its anchor and every position of its own block (blocks never see each other); cross-entropy on
offsets 1..S-1 weighted exp(-(k-1)/gamma). Embedding and LM head are the target's, frozen.
AdamW + warmup/cosine, grad clip 1.0, checkpoint/resume by time limit.

``distill`` > 0 mixes in the target's own next-token distribution at each labelled position
(cross-entropy against it: forward KL up to the target's entropy), which the target's forward
over the sequence already gives for one LM-head product. A sampled label is one draw of that
distribution; the whole of it says how much each alternative is worth, which is what a tree
built from the drafter's probabilities and sampled verification both use."""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ddtree.context import AttentionContext
from ddtree.models.decoder import DecoderLM
from ddtree.models.dflash import DFlashConfig, DFlashDrafter, default_tap_layers
from ddtree.models.layers import apply_rotary


@dataclass
class TrainConfig:
    num_layers: int = 4
    num_taps: int = 5
    block_size: int = 16
    steps: int = 2000
    batch_size: int = 16           # sequences per step
    anchors: int = 64              # blocks per sequence
    max_len: int = 640             # tokens per sequence (truncated)
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float | None = None     # position-weight decay; None = 7 * block_size / 16
    seed: int = 0
    init: str | None = None        # start from this exported drafter (its shape wins over the fields above)
    distill: float = 0.0           # weight of the target-distribution term (1 - distill on the sampled token)
    minutes: float | None = None   # the cosine runs over this many training minutes (summed over resumes)
                                   # instead of over `steps`, and the run ends there: a run split across
                                   # device calls of unknown speed uses all of its time (steps then vary)


def new_drafter(target: DecoderLM, cfg: TrainConfig) -> DFlashDrafter:
    t = target.config
    dcfg = DFlashConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
        head_dim=t.head_dim, vocab_size=t.vocab_size, block_size=cfg.block_size,
        target_layer_ids=default_tap_layers(t.num_hidden_layers, cfg.num_taps), mask_token_id=0,
        num_target_layers=t.num_hidden_layers, rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta,
        max_position_embeddings=t.max_position_embeddings)
    drafter = DFlashDrafter(dcfg, learned_mask=True)
    gen = torch.Generator().manual_seed(cfg.seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name == "norm.weight":  # start from the target's final norm: logits on its scale
                p.copy_(target.model.norm.weight.float().cpu())
            elif "norm" in name:
                p.fill_(1.0)
            elif name == "mask_embedding":
                p.copy_(target.model.embed_tokens.weight.float().mean(0).cpu())
            else:
                p.normal_(0, 0.02, generator=gen)
    return drafter


@torch.no_grad()
def target_features(target: DecoderLM, ids: torch.Tensor, taps: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, L] (right-padded; padding never influences earlier positions) -> the final-normed
    hidden [B, L, H] and the tapped layer outputs [B, L, K*H]."""
    B, L = ids.shape
    layers, heads, dim = target.kv_shape()
    w = target.lm_head.weight
    kv = [(torch.empty(B * L, heads, dim, device=w.device, dtype=w.dtype),
           torch.empty(B * L, heads, dim, device=w.device, dtype=w.dtype)) for _ in range(layers)]
    ctx = AttentionContext.contiguous([L] * B, device=w.device)
    positions = torch.arange(L, device=w.device).repeat(B)
    with torch.autocast(w.device.type, enabled=False):  # the target runs in its own dtype (its KV cache's)
        hidden, tapped = target(ids.reshape(-1), positions, kv, ctx, taps)
    return hidden.view(B, L, -1), tapped.view(B, L, -1)


@torch.no_grad()
def next_token_probs(target: DecoderLM, hidden: torch.Tensor, label_pos: torch.Tensor) -> torch.Tensor:
    """The target's distribution for the token at each of ``label_pos`` [B, ...] (it comes from
    the position before): hidden [B, L, H] -> fp32 probabilities [B, ..., V]."""
    B, L, H = hidden.shape
    before = (label_pos - 1).clamp(0, L - 1).reshape(B, -1, 1).expand(-1, -1, H)
    with torch.autocast(hidden.device.type, enabled=False):
        logits = target.logits(torch.gather(hidden, 1, before))
    return torch.softmax(logits, -1).view(*label_pos.shape, -1)


def drafter_train_logits_hidden(drafter: DFlashDrafter, taps: torch.Tensor, block_embeds: torch.Tensor,
                                anchors: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """taps [B, L, K*H], block_embeds [B, n, S, H], anchors [B, n] -> final-normed hidden [B, n, S, H].
    The same layers as inference, with the training mask in one attention call per layer."""
    B, L, _ = taps.shape
    _, n, S, H = block_embeds.shape
    device = taps.device
    c = drafter.hidden_norm(drafter.fc(taps))                                    # [B, L, H]
    ctx_pos = torch.arange(L, device=device)
    blk_pos = (anchors[:, :, None] + torch.arange(S, device=device)).reshape(B, n * S)
    cos_c, sin_c = drafter.rotary.cos_sin(ctx_pos)
    cos_b, sin_b = drafter.rotary.cos_sin(blk_pos.reshape(-1))
    # Mask [B, n*S, L + n*S]: context strictly before the anchor (and inside the sequence);
    # inside the block everything; other blocks nothing.
    ctx_ok = (ctx_pos[None, None, :] < anchors[:, :, None]) & (ctx_pos[None, None, :] < lengths[:, None, None])
    ctx_ok = ctx_ok[:, :, None, :].expand(B, n, S, L).reshape(B, n * S, L)
    blk = torch.arange(n, device=device).repeat_interleave(S)
    blk_ok = (blk[:, None] == blk[None, :])[None].expand(B, -1, -1)
    mask = torch.cat([ctx_ok, blk_ok], -1)[:, None]                              # [B, 1, nS, L+nS]
    x = block_embeds.reshape(B, n * S, H)
    for layer in drafter.layers:
        att = layer.self_attn
        h = layer.input_layernorm(x)
        q = att.q_norm(att.q_proj(h).view(B * n * S, att.heads, att.head_dim))
        q = apply_rotary(q, cos_b, sin_b).view(B, n * S, att.heads, att.head_dim)
        k_b, v_b = att.kv(h.reshape(B * n * S, H), cos_b, sin_b)
        k_c, v_c = att.kv(c.reshape(B * L, H), cos_c.repeat(B, 1), sin_c.repeat(B, 1))
        k = torch.cat([k_c.view(B, L, att.kv_heads, -1), k_b.view(B, n * S, att.kv_heads, -1)], 1)
        v = torch.cat([v_c.view(B, L, att.kv_heads, -1), v_b.view(B, n * S, att.kv_heads, -1)], 1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, scale=att.scale, enable_gqa=True)
        x = x + att.o_proj(o.transpose(1, 2).reshape(B, n * S, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x).view(B, n, S, H)


class SequenceData:
    """Token sequences from stage 2 (``responses.pt``; several files are concatenated, e.g. more
    responses to the same prompts from another sampling pass)."""

    def __init__(self, paths, max_len: int):
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
        tokens, self.offsets, self.prompt_lens = [], [0], []
        for path in paths:
            data = torch.load(path)
            tokens.append(data["tokens"].long())
            self.offsets += [self.offsets[-1] + o for o in data["offsets"][1:]]
            self.prompt_lens += list(data["prompt_lens"])
        self.tokens = torch.cat(tokens)
        self.max_len = max_len
        # Keep sequences with at least a few response tokens.
        self.index = [i for i in range(len(self.prompt_lens))
                      if self.offsets[i + 1] - self.offsets[i] - self.prompt_lens[i] >= 4]
        if not self.index:
            raise ValueError(f"{', '.join(map(str, paths))}: no sequences with responses")

    def __len__(self) -> int:
        return len(self.index)

    def batch(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> ids [B, L] (right-padded), lengths [B], first anchor position [B]."""
        seqs, starts = [], []
        for j in idx:
            i = self.index[j]
            seq = self.tokens[self.offsets[i]:self.offsets[i + 1]]
            p = self.prompt_lens[i]
            if len(seq) > self.max_len:  # keep the response; cut the prompt's start if needed
                cut = min(len(seq) - self.max_len, max(0, p - 16))
                seq, p = seq[cut:cut + self.max_len], p - cut
            seqs.append(seq)
            starts.append(max(p - 1, 0))
        L = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), L, dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, :len(s)] = s
        return ids, torch.tensor([len(s) for s in seqs]), torch.tensor(starts)


def sample_anchors(lengths, starts, n, gen) -> torch.Tensor:
    """n anchors per sequence, uniformly in [start, length-2] (the anchor needs >= 1 label)."""
    span = (lengths - 1 - starts).clamp(min=1)
    u = torch.rand(len(lengths), n, generator=gen)
    return starts[:, None] + (u * span[:, None]).long()


def train_drafter(target: DecoderLM, data_path, out_dir: str | Path, cfg: TrainConfig,
                  max_minutes: float | None = None, log_every: int = 20, now=time.perf_counter) -> dict:
    """Train (or resume) a drafter; checkpoint in ``out_dir/checkpoint.pt``, log in ``train_log.jsonl``.
    ``now`` is the clock of the time limits and of ``cfg.minutes`` (tests pass a fake one)."""
    if not 0 <= cfg.distill <= 1:
        raise ValueError(f"distill must be in [0, 1], got {cfg.distill}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = target.lm_head.weight.device
    target.requires_grad_(False)
    data = SequenceData(data_path, cfg.max_len)
    ckpt_path = out_dir / "checkpoint.pt"
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        # a resumed run keeps its settings but may be given a new length
        cfg = TrainConfig(**{**ckpt["train_config"], "steps": cfg.steps, "minutes": cfg.minutes})
        drafter = DFlashDrafter(DFlashConfig(**ckpt["drafter_config"]), learned_mask=True)
        drafter.load_state_dict(ckpt["model"])
    elif cfg.init is not None:  # continue training an exported drafter with a fresh optimizer
        ckpt = None
        drafter = DFlashDrafter.from_pretrained(cfg.init, dtype=torch.float32)
        if drafter.mask_embedding is None:
            raise ValueError(f"--init {cfg.init}: the drafter has no learned mask embedding (mask_embedding.pt)")
        drafter.config.check_fits(target.config)
        d = drafter.config
        cfg = TrainConfig(**{**asdict(cfg), "num_layers": d.num_hidden_layers, "block_size": d.block_size,
                             "num_taps": len(d.target_layer_ids)})
    else:
        ckpt = None
        drafter = new_drafter(target, cfg)
    drafter.to(device).train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    if cfg.minutes is not None and cfg.minutes <= 0:
        raise ValueError(f"minutes must be > 0, got {cfg.minutes}")
    clock = {"seconds": 0.0}  # training time so far, over resumes (the time-based schedule's x axis)

    def lr_factor(s: int) -> float:
        if cfg.minutes is None:
            warm = max(1, int(cfg.warmup * cfg.steps))
            return min(1.0, (s + 1) / warm) * 0.5 * (
                1 + math.cos(math.pi * min(1.0, max(0, s - warm) / max(1, cfg.steps - warm))))
        x = min(1.0, clock["seconds"] / (cfg.minutes * 60))
        warm = min(1.0, x / cfg.warmup) if cfg.warmup > 0 else 1.0
        return warm * 0.5 * (1 + math.cos(math.pi * max(0.0, x - cfg.warmup) / max(1e-9, 1 - cfg.warmup)))

    def out_of_time() -> bool:
        return cfg.minutes is not None and clock["seconds"] >= cfg.minutes * 60

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    gen = torch.Generator().manual_seed(cfg.seed)
    step, elapsed = 0, 0.0
    if ckpt is not None:
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        gen.set_state(ckpt["rng"])
        step, elapsed = ckpt["step"], ckpt["elapsed"]
    clock["seconds"] = elapsed
    S = cfg.block_size
    gamma = cfg.gamma or 7.0 * S / 16
    weights = torch.exp(-torch.arange(S - 1, device=device, dtype=torch.float32) / gamma)
    taps = tuple(drafter.config.target_layer_ids)
    embed = target.model.embed_tokens
    lm_head_w = target.lm_head.weight
    amp = dict(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    log = (out_dir / "train_log.jsonl").open("a")
    start = now()
    bar = tqdm(total=cfg.steps, initial=step, desc="train-drafter")
    last = {}
    while step < cfg.steps and not out_of_time():
        if max_minutes is not None and (now() - start) / 60 > max_minutes:
            break
        idx = torch.randint(len(data), (cfg.batch_size,), generator=gen).tolist()
        ids, lengths, starts = data.batch(idx)
        anchors = sample_anchors(lengths, starts, cfg.anchors, gen)
        ids, lengths, anchors = ids.to(device), lengths.to(device), anchors.to(device)
        B, L = ids.shape
        offsets = torch.arange(S, device=device)
        label_pos = anchors[:, :, None] + offsets[1:]                               # [B, n, S-1]
        valid = label_pos < lengths[:, None, None]
        labels = torch.gather(ids, 1, label_pos.clamp(max=L - 1).reshape(B, -1)).view_as(label_pos)
        with torch.autocast(**amp):
            target_hidden, tapped = target_features(target, ids, taps)
            block_embeds = embed(torch.gather(ids, 1, anchors))[:, :, None, :].expand(-1, -1, S, -1).clone()
            block_embeds[:, :, 1:] = drafter.mask_embedding.to(block_embeds.dtype)
            hidden = drafter_train_logits_hidden(drafter, tapped, block_embeds, anchors, lengths)
            logits = F.linear(hidden[:, :, 1:], lm_head_w)                         # [B, n, S-1, V]
        logq = torch.log_softmax(logits.float(), -1)
        ce = -torch.gather(logq, -1, labels[..., None])[..., 0]
        w = weights * valid
        per_pos, extra = ce, {}
        if cfg.distill > 0:
            p = next_token_probs(target, target_hidden, label_pos)
            soft = -(p * logq).sum(-1)
            per_pos = (1 - cfg.distill) * ce + cfg.distill * soft
            with torch.no_grad():  # logged apart: the sampled token's cross-entropy, and the KL
                extra = {"ce": (ce * w).sum() / w.sum(),
                         "kl": ((soft + (p * p.clamp_min(1e-30).log()).sum(-1)) * w).sum() / w.sum()}
            del p, soft
        loss = (per_pos * w).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        opt.step()
        clock["seconds"] = elapsed + now() - start
        sched.step()
        step += 1
        bar.update(1)
        if step % log_every == 0 or step == cfg.steps:
            with torch.no_grad():
                acc = ((logits.argmax(-1) == labels) & valid).float().sum((0, 1)) / valid.float().sum((0, 1))
            last = {"step": step, "loss": float(loss.detach()), "grad_norm": float(gnorm), "lr": sched.get_last_lr()[0],
                    "acc_by_depth": [round(float(a), 4) for a in acc],
                    **{k: round(float(v), 4) for k, v in extra.items()},
                    "minutes": round(clock["seconds"] / 60, 2)}
            log.write(json.dumps(last) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", acc1=f"{float(acc[0]):.2f}")
    bar.close()
    elapsed += now() - start
    torch.save({"model": drafter.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "rng": gen.get_state(), "step": step, "elapsed": elapsed, "train_config": asdict(cfg),
                "drafter_config": {k: v for k, v in asdict(drafter.config).items()}}, ckpt_path)
    # the last logged batch's figures, with the run's own step count and time (not the logged ones)
    return {**last, "step": step, "done": step >= cfg.steps or out_of_time(), "minutes": elapsed / 60}


def export_drafter(out_dir: str | Path, export_dir: str | Path, dtype=torch.bfloat16) -> Path:
    """Checkpoint -> z-lab format folder (config.json, model.safetensors, mask_embedding.pt)."""
    ckpt = torch.load(Path(out_dir) / "checkpoint.pt", map_location="cpu", weights_only=False)
    drafter = DFlashDrafter(DFlashConfig(**ckpt["drafter_config"]), learned_mask=True)
    drafter.load_state_dict(ckpt["model"])
    drafter.to(dtype).save_pretrained(export_dir)
    return Path(export_dir)
