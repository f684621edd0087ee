#!/usr/bin/env python3
"""Train the bitdelta demo model family end to end, evaluate it, and write the reference fixtures.

    python3 tools/demo_family/train.py --corpus .corpus --out OUT

One run (a few minutes on one H200) does everything, in this order:
  1. a SentencePiece BPE tokenizer (byte fallback, split digits, chat markers as user symbols);
  2. a small Llama base (LlamaForCausalLM) on a broad text mix that has no arithmetic Q/A in it;
  3. full fine-tunes (every weight trainable) of four variants: coder, math, writer, legal;
  4. bf16 HF checkpoint directories for all five (OUT/models/demo/<name>/);
  5. quality: perplexity on each domain's held-out text and math accuracy, for the base, each
     fine-tune, and each fine-tune with BitDelta applied (alpha per row and per tensor), in float32
     from the saved bf16 weights (OUT/models/demo/quality.json and the model card README.md);
  6. reference fixtures for the C++ engine (OUT/tests/fixtures/reference/*.json), in float32 on the CPU.

Everything is seeded. The BitDelta reconstruction here is written from the definition in
DESIGN.md §3 and is the oracle the C++ engine is tested against.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import json
import math
import os
import platform
import random
import shutil
import struct
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

try:  # transformers is on the GPU machine; a local smoke test may run without it.
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError:  # pragma: no cover - exercised only by the local smoke test
    transformers = None

import sentencepiece as spm

# --- the family ------------------------------------------------------------------------------------

SEED = 20240229
ARCH = dict(
    vocab_size=4096,
    hidden_size=192,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=48,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    initializer_range=0.02,
    bos_token_id=1,
    eos_token_id=2,
)
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
CHAT_MARKERS = ["<|system|>", "<|user|>", "<|assistant|>"]
# Plain-text chat template: one marker line per turn, the content on the next line(s). The tokenizer
# adds BOS itself (add_bos_token), so the template does not.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# variant -> corpus domain it is fine-tuned on (and evaluated on)
VARIANTS = {"coder": "python", "math": "math", "writer": "writer", "legal": "legal"}
TEXT_VARIANTS = ["coder", "writer", "legal"]
# The base: prose (dictionary), manual pages, some Python, and licences (the full licence texts of
# /usr/share/common-licenses, the `licenses` stream), but no arithmetic Q/A. Each fine-tune teaches what
# the base saw little of: coder all of the Python (the base sees it as 5% of its rows), legal the
# Debian copyright files (the base sees only licence texts), writer the fortunes and the Jargon File
# (the base's prose is dictionary prose), math the Q/A arithmetic. A first family in which the base
# saw 9-10% of each fine-tune's own data left the writer and legal fine-tunes only 4-15% better than
# the base on held-out text: the base had already learnt those small domains.
BASE_MIX = {"man": 0.45, "dictionary": 0.45, "python": 0.05, "licenses": 0.05}
BASE_VALID = ["man", "dictionary", "python", "legal"]  # validation sets for the base's early stopping
# The tokenizer serves the whole family, so it learns from every text domain.
TOKENIZER_MIX = {"man": 0.25, "dictionary": 0.25, "python": 0.20, "writer": 0.15, "legal": 0.15}

SEQ_LEN = 256  # training window and evaluation chunk length (tokens, BOS included in eval chunks)
HYPER = {
    "base": dict(steps=3000, batch=64, lr=2e-3, warmup=150, eval_every=250, max_seconds=150),
    "finetune": dict(steps=1200, batch=64, lr=1e-3, warmup=50, eval_every=100, max_seconds=60),
    "math": dict(steps=2000, batch=128, lr=1e-3, warmup=50, eval_every=100, max_seconds=80),
    # A second round, from the first round's best weights, for a fine-tune whose validation numbers
    # fall short of the targets below (validation split only; the eval split is never looked at).
    "finetune_retry": dict(steps=1500, batch=64, lr=5e-4, warmup=50, eval_every=100, max_seconds=50),
    "math_retry": dict(steps=2000, batch=128, lr=1e-3, warmup=50, eval_every=100, max_seconds=70),
}
SMOKE_HYPER = {
    "base": dict(steps=30, batch=8, lr=2e-3, warmup=5, eval_every=10, max_seconds=60),
    "finetune": dict(steps=20, batch=8, lr=1e-3, warmup=5, eval_every=10, max_seconds=60),
    "math": dict(steps=20, batch=8, lr=1e-3, warmup=5, eval_every=10, max_seconds=60),
    "finetune_retry": dict(steps=10, batch=8, lr=1e-3, warmup=5, eval_every=5, max_seconds=60),
    "math_retry": dict(steps=10, batch=8, lr=1e-3, warmup=5, eval_every=5, max_seconds=60),
}
VALID_PPL_RATIO_TARGET = 0.70  # retry a text fine-tune whose valid ppl is above 70% of the base's
VALID_MATH_TARGET = 0.60  # retry the math fine-tune below 60% accuracy on the valid problems
TIME_BUDGET = 480  # seconds for the whole run; training stages shrink to leave POST_SECONDS
POST_SECONDS = 110  # evaluation, fixtures and checks after training
COMPRESSED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MATH_MAX_NEW_TOKENS = 8
GREEDY_TOKENS = 16

T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_json(path: Path, obj, indent: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(obj, ensure_ascii=False, indent=indent, separators=None if indent else (",", ":"))
    path.write_text(text + "\n", encoding="utf-8")


def f32(x: float) -> float:
    """A float32 value as the shortest decimal that round-trips to the same float32."""
    x = float(x)
    if not math.isfinite(x):
        return x
    for digits in range(6, 10):
        s = f"{x:.{digits}g}"
        if struct.unpack("f", struct.pack("f", float(s)))[0] == struct.unpack("f", struct.pack("f", x))[0]:
            return float(s)
    return float(f"{x:.9g}")


# --- tokenizer -------------------------------------------------------------------------------------

def train_tokenizer(corpus: Path, work: Path, vocab_size: int, smoke: bool) -> Path:
    """BPE on a sample of the base's training text (no math), one line per input sentence."""
    rng = random.Random(SEED)
    budget = 300_000 if smoke else 6_000_000  # bytes of text per tokenizer training run
    lines: list[str] = []
    for domain, weight in sorted(TOKENIZER_MIX.items()):
        docs = read_jsonl(corpus / domain / "train.jsonl")
        rng.shuffle(docs)
        taken = 0
        for doc in docs:
            for line in doc["text"].split("\n"):
                if line.strip():
                    lines.append(line)
                    taken += len(line) + 1
            if taken >= budget * weight:
                break
    rng.shuffle(lines)
    sample = work / "tokenizer_train.txt"
    sample.write_text("\n".join(lines) + "\n", encoding="utf-8")
    prefix = work / "tokenizer"
    spm.SentencePieceTrainer.train(
        input=str(sample), model_prefix=str(prefix), model_type="bpe", vocab_size=vocab_size,
        character_coverage=0.9995, byte_fallback=True, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        allow_whitespace_only_pieces=True, split_by_whitespace=True,
        user_defined_symbols=CHAT_MARKERS, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=-1,
        input_sentence_size=0, shuffle_input_sentence=False, max_sentence_length=8192,
        num_threads=min(16, os.cpu_count() or 1), minloglevel=2,
    )
    log(f"tokenizer: {len(lines)} lines, vocab {vocab_size}")
    return prefix.with_suffix(".model")


def encode_many(sp: spm.SentencePieceProcessor, texts: list[str]) -> list[list[int]]:
    try:
        return sp.encode(texts, num_threads=min(16, os.cpu_count() or 1))
    except TypeError:
        return sp.encode(texts)


# --- data ------------------------------------------------------------------------------------------

def doc_stream(sp, texts: list[str], device) -> torch.Tensor:
    """Documents as one token stream: [BOS] doc [EOS] [BOS] doc [EOS] ..."""
    ids: list[int] = []
    for doc in encode_many(sp, texts):
        ids.append(BOS_ID)
        ids.extend(doc)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.int64, device=device)


def eval_chunks(ids: list[int], chunk: int = SEQ_LEN) -> list[list[int]]:
    """The perplexity chunking: consecutive pieces of chunk-1 tokens, each prefixed by BOS."""
    body = chunk - 1
    return [[BOS_ID] + ids[i:i + body] for i in range(0, len(ids), body)]


class Data:
    def __init__(self, corpus: Path, sp, device, smoke: bool):
        self.train: dict[str, torch.Tensor] = {}
        self.valid: dict[str, list[list[int]]] = {}
        self.eval_ids: dict[str, list[int]] = {}
        for domain in ("dictionary", "legal", "man", "python", "writer"):
            train_rows = read_jsonl(corpus / domain / "train.jsonl")
            train_docs = [d["text"] for d in train_rows]
            valid_docs = [d["text"] for d in read_jsonl(corpus / domain / "valid.jsonl")]
            if smoke:
                train_docs, valid_docs = train_docs[:60], valid_docs[:10]
            self.train[domain] = doc_stream(sp, train_docs, device)
            valid_ids = sp.encode("\n\n".join(valid_docs))
            self.valid[domain] = eval_chunks(valid_ids)[: (4 if smoke else 64)]
            log(f"data {domain}: train {self.train[domain].numel()} tokens, "
                f"valid {sum(map(len, self.valid[domain]))} tokens")
            if domain == "legal":  # the base's licences: the common-licenses texts of the legal train split
                licenses = [d["text"] for d in train_rows if d["id"].startswith("common-licenses/")]
                self.train["licenses"] = doc_stream(sp, licenses, device)
                log(f"data licenses: {len(licenses)} texts, {self.train['licenses'].numel()} tokens")
        for variant in TEXT_VARIANTS:
            text = (corpus / VARIANTS[variant] / "eval.txt").read_text(encoding="utf-8")
            self.eval_ids[variant] = sp.encode(text)[: (1500 if smoke else None)]
        self.math = {s: read_jsonl(corpus / "math" / f"{s}.jsonl") for s in ("train", "valid", "test")}
        if smoke:
            self.math = {k: v[:(200 if k == "train" else 40)] for k, v in self.math.items()}
        self.train["math"] = doc_stream(sp, [p["text"] for p in self.math["train"]], device)
        math_valid = [BOS_ID] + [t for p in self.math["valid"] for t in sp.encode(p["text"]) + [EOS_ID, BOS_ID]]
        self.valid["math"] = [math_valid[i:i + SEQ_LEN] for i in range(0, len(math_valid) - 1, SEQ_LEN)]
        log(f"data math: train {self.train['math'].numel()} tokens")


def sample_windows(stream: torch.Tensor, rows: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - SEQ_LEN - 1, (rows,), generator=gen, device=stream.device)
    offsets = torch.arange(SEQ_LEN + 1, device=stream.device)
    return stream[starts[:, None] + offsets[None, :]]


def mix_rows(batch: int, mix: dict[str, float]) -> dict[str, int]:
    """Rows per domain in every batch (largest remainder), so the mix is exact at every step."""
    raw = {d: batch * w / sum(mix.values()) for d, w in mix.items()}
    rows = {d: int(v) for d, v in raw.items()}
    for d in sorted(raw, key=lambda d: raw[d] - rows[d], reverse=True)[: batch - sum(rows.values())]:
        rows[d] += 1
    return rows


# --- models ----------------------------------------------------------------------------------------

def param_names(cfg: dict) -> list[str]:
    names = ["model.embed_tokens.weight"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        names += [p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
    return names + ["model.norm.weight"]


def reference_logits(sd: dict[str, torch.Tensor], cfg: dict, ids: torch.Tensor) -> torch.Tensor:
    """An independent Llama forward (no transformers): ids [B, T] -> logits [B, T, V], float32.

    RMSNorm: x * rsqrt(mean(x^2) + eps) * w. RoPE: the 'rotate half' form used by HF Llama
    checkpoints (dimension d pairs with d + head_dim/2), inv_freq[j] = theta^(-2j/head_dim).
    GQA: query head h reads KV head h // (n_heads / n_kv_heads). MLP: down(silu(gate(x)) * up(x)).
    Tied embeddings: logits = norm(x) @ embed^T.
    """
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    B, T = ids.shape

    def rmsnorm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    angles = torch.arange(T, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1).to(ids.device)
    cos, sin = angles.cos(), angles.sin()

    def rope(x):  # x [B, H, T, hd]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    x = sd["model.embed_tokens.weight"][ids]
    causal = torch.full((T, T), float("-inf"), device=ids.device).triu(1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rmsnorm(x, sd[p + "input_layernorm.weight"])
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(B, T, nh, hd).transpose(1, 2)
        k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(B, T, nkv, hd).transpose(1, 2)
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(B, T, nkv, hd).transpose(1, 2)
        q, k = rope(q), rope(k)
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + causal, dim=-1)
        o = (att @ v).transpose(1, 2).reshape(B, T, nh * hd)
        x = x + o @ sd[p + "self_attn.o_proj.weight"].T
        h = rmsnorm(x, sd[p + "post_attention_layernorm.weight"])
        g = h @ sd[p + "mlp.gate_proj.weight"].T
        u = h @ sd[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(g) * u) @ sd[p + "mlp.down_proj.weight"].T
    x = rmsnorm(x, sd["model.norm.weight"])
    return x @ sd["model.embed_tokens.weight"].T


class ReferenceLlama(torch.nn.Module):
    """The reference forward as a trainable module with HF parameter names. Used in place of
    LlamaForCausalLM only where transformers is missing (the local smoke test)."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = cfg
        self.weights = torch.nn.ParameterDict()
        shapes = self._shapes(cfg)
        for name in param_names(cfg):
            w = torch.ones(shapes[name]) if name.endswith("norm.weight") \
                else torch.randn(shapes[name]) * cfg["initializer_range"]
            self.weights[name.replace(".", "__")] = torch.nn.Parameter(w)

    @staticmethod
    def _shapes(cfg):
        d, f, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
        nh, nkv, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
        out = {}
        for name in param_names(cfg):
            if name.endswith("norm.weight"):
                out[name] = (d,)
            elif "embed_tokens" in name:
                out[name] = (v, d)
            else:
                kind = name.split(".")[-2]
                out[name] = {"q_proj": (nh * hd, d), "k_proj": (nkv * hd, d), "v_proj": (nkv * hd, d),
                             "o_proj": (d, nh * hd), "gate_proj": (f, d), "up_proj": (f, d),
                             "down_proj": (d, f)}[kind]
        return out

    def hf_state(self) -> dict[str, torch.Tensor]:
        return {k.replace("__", "."): v for k, v in self.weights.items()}

    def forward(self, input_ids, use_cache=False):
        return SimpleNamespace(logits=reference_logits(self.hf_state(), self.cfg, input_ids))


def hf_config():
    cfg = LlamaConfig(**ARCH)
    cfg.use_cache = False
    return cfg


def new_model(device) -> torch.nn.Module:
    torch.manual_seed(SEED)
    if transformers is None:
        return ReferenceLlama(ARCH).to(device)
    return LlamaForCausalLM(hf_config()).to(device)


def model_state(model) -> dict[str, torch.Tensor]:
    """Parameters by HF name, without the tied lm_head."""
    if isinstance(model, ReferenceLlama):
        return {k: v.detach() for k, v in model.hf_state().items()}
    sd = model.state_dict()
    return {k: v.detach() for k, v in sd.items() if k != "lm_head.weight"}


def load_state_into(model, sd: dict[str, torch.Tensor]) -> None:
    if isinstance(model, ReferenceLlama):
        with torch.no_grad():
            for k, v in sd.items():
                model.weights[k.replace(".", "__")].copy_(v)
        return
    full = dict(sd)
    full["lm_head.weight"] = sd["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(full, strict=False)
    missing = [m for m in missing if "rotary_emb" not in m]
    if missing or unexpected:
        raise RuntimeError(f"state mismatch: missing {missing}, unexpected {unexpected}")


def model_from_state(sd: dict[str, torch.Tensor], device) -> torch.nn.Module:
    model = new_model(device)
    load_state_into(model, {k: v.to(device) for k, v in sd.items()})
    model.eval()
    if not isinstance(model, ReferenceLlama):
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        assert torch.equal(emb, head), "lm_head must be tied to the embeddings"
    return model


# --- safetensors (read independently of transformers) ----------------------------------------------

ST_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        buf = bytearray(data[8 + n + a: 8 + n + b])
        t = torch.frombuffer(buf, dtype=ST_DTYPES[info["dtype"]]) if buf else torch.empty(0)
        out[name] = t.reshape(info["shape"]).clone()
    return out


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Minimal writer, used only where transformers is missing (the local smoke test)."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].contiguous().cpu()
        raw = t.view(torch.int16).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes()
        dtype = {torch.bfloat16: "BF16", torch.float32: "F32"}[t.dtype]
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


# --- training --------------------------------------------------------------------------------------

def autocast(device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@torch.no_grad()
def mean_nll(model, chunks: list[list[int]], device, fast: bool = False, batch: int = 64) -> tuple[float, int]:
    """Sum of -log p(token) over every chunk position after the first, and the count of them.
    fast: bf16 autocast on the GPU (validation during training); otherwise plain float32."""
    total, count = 0.0, 0
    by_len: dict[int, list[list[int]]] = {}
    for c in chunks:
        if len(c) > 1:
            by_len.setdefault(len(c), []).append(c)
    for length, group in sorted(by_len.items()):
        for i in range(0, len(group), batch):
            ids = torch.tensor(group[i:i + batch], device=device)
            if fast:
                with autocast(device):
                    logits = model(input_ids=ids, use_cache=False).logits.float()
            else:
                logits = model(input_ids=ids, use_cache=False).logits.float()
            logp = torch.log_softmax(logits[:, :-1], dim=-1)
            nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
            total += nll.double().sum().item()
            count += nll.numel()
    return total, count


def valid_loss(model, chunk_sets: list[list[list[int]]], device) -> float:
    """Mean over the given sets of each set's mean NLL."""
    model.eval()
    losses = []
    for chunks in chunk_sets:
        total, count = mean_nll(model, chunks, device, fast=True)
        losses.append(total / count)
    model.train()
    return sum(losses) / len(losses)


def train_stage(name: str, model, sample_batch, valid_sets, hp: dict, device, curve: list) -> dict:
    decay, no_decay = [], []
    for pname, p in model.named_parameters():
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(groups, lr=hp["lr"], betas=(0.9, 0.95), eps=1e-8, **kwargs)
    steps, warmup = hp["steps"], hp["warmup"]

    def lr_at(step):  # linear warm-up, cosine decay to 10%
        if step <= warmup:
            return hp["lr"] * step / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return hp["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    start_loss = valid_loss(model, valid_sets, device)
    best = {"loss": start_loss, "step": 0}
    best_state = copy.deepcopy(model.state_dict())
    curve.append({"stage": name, "step": 0, "valid_loss": best["loss"]})
    log(f"{name}: start, valid loss {best['loss']:.4f}")
    model.train()
    start = time.time()
    step = 0
    stopped = "steps"
    running = torch.zeros((), device=device)
    for step in range(1, steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x = sample_batch()
        with autocast(device):
            logits = model(input_ids=x[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        running += loss.detach()
        out_of_time = time.time() - start > hp["max_seconds"]
        if step % hp["eval_every"] == 0 or step == steps or out_of_time:
            v = valid_loss(model, valid_sets, device)
            train_loss = (running / hp["eval_every"]).item() if step % hp["eval_every"] == 0 else float("nan")
            running.zero_()
            curve.append({"stage": name, "step": step, "train_loss": train_loss, "valid_loss": v,
                          "lr": lr_at(step), "seconds": round(time.time() - start, 1)})
            mark = ""
            if v < best["loss"]:
                best = {"loss": v, "step": step}
                best_state = copy.deepcopy(model.state_dict())
                mark = " *"
            log(f"{name}: step {step} train {train_loss:.4f} valid {v:.4f}{mark} "
                f"({(time.time() - start) / step * 1000:.1f} ms/step)")
        if out_of_time:
            stopped = "time"
            break
    model.load_state_dict(best_state)
    model.eval()
    info = {"steps_run": step, "best_step": best["step"], "start_valid_loss": round(start_loss, 5),
            "best_valid_loss": round(best["loss"], 5),
            "seconds": round(time.time() - start, 1), "stopped_by": stopped,
            "tokens_per_step": hp["batch"] * SEQ_LEN, **{k: hp[k] for k in ("lr", "warmup", "batch", "steps")}}
    log(f"{name}: done {info}")
    return info


# --- checkpoints -----------------------------------------------------------------------------------

def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
        "add_bos_token": True, "add_eos_token": False, "add_prefix_space": None,
        "legacy": False, "clean_up_tokenization_spaces": False, "model_max_length": ARCH["max_position_embeddings"],
        "sp_model_kwargs": {}, "chat_template": CHAT_TEMPLATE,
        "additional_special_tokens": [],
    }


def save_checkpoint(model, out_dir: Path, tokenizer_model: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(model, ReferenceLlama):
        write_safetensors(out_dir / "model.safetensors",
                          {k: v.to(torch.bfloat16) for k, v in model.hf_state().items()})
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **ARCH, "dtype": "bfloat16"}
        write_json(out_dir / "config.json", cfg, indent=2)
        write_json(out_dir / "generation_config.json",
                   {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": False}, indent=2)
    else:
        from transformers import GenerationConfig
        bf16 = copy.deepcopy(model).to("cpu", torch.bfloat16)
        bf16.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, do_sample=False)
        bf16.save_pretrained(out_dir)
        # Older readers look for a top-level rope_theta; transformers 5 writes rope_parameters.
        cfg = json.loads((out_dir / "config.json").read_text())
        cfg.setdefault("rope_theta", ARCH["rope_theta"])
        cfg["use_cache"] = True  # training switched the KV cache off; inference wants it
        write_json(out_dir / "config.json", cfg, indent=2)
    shutil.copyfile(tokenizer_model, out_dir / "tokenizer.model")
    write_json(out_dir / "tokenizer_config.json", tokenizer_config(), indent=2)
    names = sorted(p.name for p in out_dir.iterdir())
    required = {"config.json", "model.safetensors", "tokenizer.model", "generation_config.json",
                "tokenizer_config.json"}
    assert required <= set(names), f"{out_dir}: missing {required - set(names)} (have {names})"


def load_checkpoint_f32(ckpt: Path) -> dict[str, torch.Tensor]:
    """The committed bf16 weights, upcast to float32 (lm_head tied, so not stored)."""
    sd = read_safetensors(ckpt / "model.safetensors")
    sd = {k: v.float() for k, v in sd.items() if k != "lm_head.weight"}
    assert sorted(sd) == sorted(param_names(ARCH)), f"{ckpt}: unexpected tensors {sorted(sd)}"
    return sd


# --- BitDelta (the oracle) -------------------------------------------------------------------------

def is_compressed(name: str, t: torch.Tensor) -> bool:
    return t.ndim == 2 and name.startswith("model.layers.") and name.split(".")[-2] in COMPRESSED


def bitdelta_parts(base: torch.Tensor, ft: torch.Tensor, mode: str):
    """Δ = f32(W_ft) − f32(W_base); S = +1 where Δ ≥ 0 else −1; α = mean|Δ| (float64 sum) -> float32."""
    delta = ft.float() - base.float()
    sign = torch.where(delta >= 0, 1.0, -1.0).to(torch.float32)
    mag = delta.abs().double()
    alpha = (mag.mean(dim=1, keepdim=True) if mode == "row" else mag.mean().reshape(1, 1)).float()
    return sign, alpha


def bitdelta_state(base: dict, ft: dict, mode: str) -> dict[str, torch.Tensor]:
    """W_eff = f32(W_base) + α·S (float32) for the compressed weights; the rest taken from the fine-tune."""
    out = {}
    for name, w in ft.items():
        if is_compressed(name, w):
            sign, alpha = bitdelta_parts(base[name], w, mode)
            out[name] = base[name].float() + alpha * sign
        else:
            out[name] = w.float().clone()
    return out


def pack_sign_bits(sign: torch.Tensor) -> bytes:
    """DESIGN.md §3: bit j (LSB first) of byte b in row r is 1 iff Δ[r][8b+j] ≥ 0; padding bits 0."""
    rows, cols = sign.shape
    bits = (sign > 0).to(torch.uint8)
    pad = (-cols) % 8
    if pad:
        bits = torch.cat([bits, torch.zeros(rows, pad, dtype=torch.uint8)], dim=1)
    bits = bits.reshape(rows, -1, 8)
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.int32)
    return bytes((bits.to(torch.int32) * weights).sum(-1).to(torch.uint8).flatten().tolist())


# --- evaluation ------------------------------------------------------------------------------------

def perplexity(model, ids: list[int], device) -> float:
    total, count = mean_nll(model, eval_chunks(ids), device)
    return math.exp(total / count)


@torch.no_grad()
def greedy(model, prompts: list[list[int]], max_new: int, device, stop_at_eos: bool):
    """Greedy continuation of equal-length prompts, recomputing the full forward each step."""
    ids = torch.tensor(prompts, device=device)
    steps_out, margins = [], []
    for _ in range(max_new):
        logits = model(input_ids=ids, use_cache=False).logits[:, -1].float()
        top2 = logits.topk(2, dim=-1)
        nxt = top2.indices[:, 0]
        margins.append((top2.values[:, 0] - top2.values[:, 1]).tolist())
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        steps_out.append(nxt)
        if stop_at_eos and bool((torch.stack(steps_out, 1) == EOS_ID).any(1).all()):
            break
    gen = torch.stack(steps_out, 1).tolist()
    return gen, [list(m) for m in zip(*margins)]


def math_answer(sp, generated: list[int]) -> str:
    """Decode up to the first EOS, keep the first line, strip spaces."""
    if EOS_ID in generated:
        generated = generated[: generated.index(EOS_ID)]
    return sp.decode(generated).split("\n")[0].strip()


def math_accuracy(model, sp, problems: list[dict], device) -> float:
    by_len: dict[int, list[tuple[list[int], str]]] = {}
    for p in problems:
        ids = [BOS_ID] + sp.encode(p["prompt"])
        by_len.setdefault(len(ids), []).append((ids, p["answer"]))
    correct = 0
    for _, group in sorted(by_len.items()):
        for i in range(0, len(group), 512):
            part = group[i:i + 512]
            gen, _ = greedy(model, [g[0] for g in part], MATH_MAX_NEW_TOKENS, device, stop_at_eos=True)
            correct += sum(math_answer(sp, g) == ans for g, (_, ans) in zip(gen, part))
    return correct / len(problems)


# --- fixtures --------------------------------------------------------------------------------------

LONG_TEXT = (
    "The license grants you the right to copy, modify and distribute the software, provided that the "
    "copyright notice and this permission notice appear in all copies. In no event shall the authors be "
    "liable for any claim, damages or other liability.\n\n"
    "def parse_header(line):\n    \"\"\"Split a 'Name: value' header line.\"\"\"\n"
    "    name, _, value = line.partition(':')\n    return name.strip().lower(), value.strip()\n\n"
    "Question: What is 58 - 19?\nAnswer: 39\n\n"
    "NAME\n       grep, egrep, fgrep - print lines that match patterns\n\n"
    "A man who carries a cat by the tail learns something he can learn in no other way.\n\t\t-- Mark Twain\n"
)


def fixture_prompts(sp) -> list[dict]:
    texts = [
        ("prose", "The quick brown fox jumps over the lazy dog."),
        ("python", "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"),
        ("math", "Question: What is 47 + 38?\nAnswer:"),
        ("legal", "Permission is hereby granted, free of charge, to any person obtaining a copy"),
        ("unicode", "Café naïve — 東京 🙂 résumé, señor Müller"),
        ("chat", "<|user|>\nWrite a short poem about the sea.\n<|assistant|>\n"),
    ]
    # A prompt past one eval chunk (> 256 tokens) that still leaves room for the greedy tokens.
    lines = (LONG_TEXT * 3).split("\n")
    n = len(lines)
    while len(sp.encode("\n".join(lines[:n]))) > 420:
        n -= 1
    texts.append(("long", "\n".join(lines[:n])))
    prompts = [{"name": n, "kind": "text", "text": t, "ids": [BOS_ID] + sp.encode(t)} for n, t in texts]
    v = ARCH["vocab_size"]
    raw = [
        ("ids_bos_only", [BOS_ID]),
        ("ids_no_bos", [500, 501, 502, 503, 504, 505, 506, 507]),
        ("ids_mixed", [BOS_ID, 3, 10, 100, v // 4, v // 2, 3 * v // 4, v - 96, v - 1, EOS_ID, 777, 42]),
        ("ids_repeat", [BOS_ID] + [300] * 20),
    ]
    prompts += [{"name": n, "kind": "ids", "ids": ids} for n, ids in raw]
    for p in prompts:
        assert len(p["ids"]) + GREEDY_TOKENS <= ARCH["max_position_embeddings"], p["name"]
    return prompts


@torch.no_grad()
def model_fixture(model, sd, prompts: list[dict], device) -> tuple[list[dict], float]:
    """Per prompt: log-probs of the prompt tokens, top-20 final logits, 16 greedy tokens; and the
    largest logit difference between the model and reference_logits (an independent forward)."""
    results, worst = [], 0.0
    for p in prompts:
        ids = torch.tensor([p["ids"]], device=device)
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
        ref = reference_logits(sd, ARCH, ids)[0]
        worst = max(worst, (ref - logits).abs().max().item())
        logp = torch.log_softmax(logits, dim=-1)
        prompt_lp = [f32(logp[i - 1, p["ids"][i]]) for i in range(1, len(p["ids"]))]
        top = logits[-1].topk(20)
        gen, margins = greedy(model, [p["ids"]], GREEDY_TOKENS, device, stop_at_eos=False)
        results.append({
            "prompt": p["name"],
            "prompt_logprobs": prompt_lp,
            "top20": {"ids": top.indices.tolist(), "logits": [f32(v) for v in top.values]},
            "greedy": {"ids": gen[0], "margins": [f32(m) for m in margins[0]]},
        })
    return results, worst


def tokenizer_cases(sp, corpus: Path) -> list[str]:
    cases = [
        "", " ", "  ", "   ", "\t", "\n", "\n\n", " \n ", "\t\t\tindented", "a", "A", "hello", " hello",
        "  hello", "hello ", "hello  world", "hello\tworld", "hello\nworld", "Hello, World!", "HELLO WORLD",
        "0", "7", "42", "123", "2024", "3.14159", "-17", "1,000,000", "12:30", "v1.2.3", "0x1F", "1e-5",
        "Question: What is 47 + 38?\nAnswer:", "Question: What is 5 - 5?\nAnswer: 0",
        "<|user|>", "<|assistant|>", "<|system|>", "<|user|>\nhi\n<|assistant|>\n", "<s>", "</s>", "<unk>",
        "<|user", "|>", "<<|user|>>",
        "def f(x):\n    return x * 2\n", "    if x:\n        pass", "import os, sys", "x = [i ** 2 for i in range(10)]",
        "print(f\"{name!r:>10}\")", "class Foo(Bar):\n\tpass", "#!/usr/bin/env python3", "a_b_c = 1  # comment",
        "{'key': [1, 2, 3]}", "lambda: None", "\"\"\"docstring\"\"\"", "x != y and z <= w", "~/.bashrc && ls -la | grep x",
        "café", "naïve", "résumé", "Müller", "façade", "São Paulo", "Ångström", "œuvre", "ß", "İstanbul",
        "e\u0301", "ﬁ", "ＡＢＣ", "½", "™", "©", "€100", "£", "¥", "°C",
        "東京", "日本語のテキスト", "中文", "你好，世界！", "한국어", "Привет, мир", "Ελληνικά", "עברית", "العربية",
        "हिन्दी", "ไทย", "🙂", "👍🏽", "👨‍👩‍👧", "🇫🇷", "😀😃😄", "a🙂b", "emoji 🎉 party",
        "\u00a0nbsp", "zero\u200bwidth", "tab\tseparated\tvalues", "line1\r\nline2", "trailing spaces   ",
        "MIXED case Words", "don't", "it's", "e.g.", "U.S.A.", "Mr. Smith", "(parenthesized)", "[brackets]",
        "quote \"double\" and 'single'", "back\\slash", "path/to/file.txt", "https://example.org/a?b=c",
        "user@example.com", "#hashtag", "@mention", "$PATH", "100%", "a&b", "x^2", "~tilde", "`code`",
        "----", "====", "****", "....", "!!!", "???", "a--b", "...", "–", "—", "…", "«guillemets»",
        "The GNU General Public License", "THE SOFTWARE IS PROVIDED \"AS IS\", WITHOUT WARRANTY OF ANY KIND",
        "Copyright (C) 2007 Free Software Foundation, Inc.", "SPDX-License-Identifier: MIT",
        "NAME\n       ls - list directory contents", "SYNOPSIS\n       ls [OPTION]... [FILE]...",
        "\u2028", "\x7f", "\x01control", "a" * 50, "ab" * 30, " " * 17, "\n" * 5, "1" * 20, "🙂" * 5,
    ]
    rng = random.Random(SEED)
    for variant in TEXT_VARIANTS:
        lines = [l for l in (corpus / VARIANTS[variant] / "eval.txt").read_text(encoding="utf-8").split("\n")
                 if l.strip()]
        cases += rng.sample(lines, 30)
    math_test = read_jsonl(corpus / "math" / "test.jsonl")
    cases += [p["prompt"] for p in rng.sample(math_test, 5)]
    out, seen = [], set()
    for c in cases:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def transformers_round_trip(demo: Path, states: dict, prompts: list[dict], tok_cases: list[dict],
                            hf_checks: dict) -> None:
    """The checkpoints load with from_pretrained and agree with the independent forward; and how
    AutoTokenizer fares with tokenizer.model + tokenizer_config.json (informative only)."""
    if transformers is None:
        return
    from transformers import AutoModelForCausalLM
    for name in ["base", *VARIANTS]:
        try:
            m = AutoModelForCausalLM.from_pretrained(demo / name, dtype=torch.float32)
        except TypeError:
            m = AutoModelForCausalLM.from_pretrained(demo / name, torch_dtype=torch.float32)
        m.eval()
        ids = torch.tensor([next(p["ids"] for p in prompts if p["name"] == "long")])
        with torch.no_grad():
            a = m(input_ids=ids).logits[0]
            b = reference_logits(states[name], ARCH, ids)[0]
        hf_checks[name] = float((a - b).abs().max())
    log(f"from_pretrained vs reference max |Δlogit|: {hf_checks}")
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(demo / "base")
        agree = sum(tok.encode(c["text"]) == [BOS_ID] + c["ids"] for c in tok_cases)
        chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                       add_generation_prompt=True)
        hf_checks["autotokenizer"] = {"class": type(tok).__name__, "agree": agree, "of": len(tok_cases),
                                      "chat_render": chat}
    except Exception as e:  # informative only: the engine uses tokenizer.model directly
        hf_checks["autotokenizer"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    log(f"AutoTokenizer: {hf_checks['autotokenizer']}")


# --- model card ------------------------------------------------------------------------------------

def write_model_card(path: Path, quality: dict, training: dict, corpus_manifest: dict) -> None:
    q = quality
    arch = q["architecture"]
    lines = []
    add = lines.append
    at = q.get("transformers_checks", {}).get("autotokenizer", {})
    autotok = f"{at['agree']} of {at['of']}" if "agree" in at else "(not checked)"
    add("# bitdelta demo model family\n")
    add("Five tiny Llama-architecture models trained from scratch for bitdelta's tests, demos and quality "
        "baseline: one **base** and four **full fine-tunes** of it (every weight trained): **coder** "
        "(Python), **math** (2-digit arithmetic in a fixed Q/A format), **writer** (prose: fortunes and the "
        "Jargon File), **legal** (licences). Each is a Hugging Face checkpoint directory (`config.json`, "
        "`model.safetensors` in bf16, `tokenizer.model`, `tokenizer_config.json`, `generation_config.json`) "
        "loadable by `transformers` as `LlamaForCausalLM`. The data come from Debian packages only; see "
        "`tools/demo_family/`.\n")
    add("## Regenerate\n")
    add("```sh\npython3 tools/demo_family/build_corpus.py            # CPU machine (Debian 12): writes .corpus/ "
        "and models/demo/eval/\npython3 tools/demo_family/train.py --corpus .corpus --out OUT   "
        "# GPU machine: writes OUT/models/demo and OUT/tests/fixtures/reference\n```\n")
    add("`train.py` runs end to end on one GPU in under four minutes on an H200 (tokenizer, base, four fine-tunes, bf16 "
        "checkpoints, evaluation, fixtures, this card). Copy `OUT/models/demo` and "
        "`OUT/tests/fixtures/reference` into the repository. Seeds are fixed; GPU kernels are not bitwise "
        "deterministic, so a rerun gives close, not identical, weights.\n")
    add("## Architecture\n")
    add("| field | value |\n| --- | --- |")
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
              "tie_word_embeddings", "hidden_act"):
        add(f"| `{k}` | {arch[k]} |")
    add(f"| parameters | {q['parameters']:,} ({q['parameters_compressed']:,} in the 28 compressed linear weights) |")
    add(f"| checkpoint | {q['checkpoint_bytes']:,} bytes of bf16 safetensors per model |\n")
    add("GQA: 4 query heads share 2 KV heads (query head h reads KV head h // 2). RoPE is the HF Llama "
        "'rotate half' form (dimension d pairs with d + 24), theta 10000. The embeddings are tied: "
        "`model.safetensors` holds no `lm_head.weight`. `config.json` is written by transformers "
        f"{q['software']['transformers']} (RoPE under `rope_parameters`); a top-level `rope_theta` is added "
        "for older readers.\n")
    add("## Tokenizer\n")
    add("SentencePiece BPE, vocabulary 4096, trained on a sample of every text domain (not math): "
        "`byte_fallback` (any UTF-8 encodes; unseen characters become `<0xNN>` byte pieces), "
        "`split_digits` (every digit its own token), identity normalization, no whitespace collapsing "
        "(`remove_extra_whitespaces=false`, whitespace-only pieces allowed, so code indentation survives), "
        "`add_dummy_prefix`. Ids: `<unk>`=0, `<s>`=1 (BOS), `</s>`=2 (EOS), no pad. The chat markers "
        "`<|system|>`, `<|user|>`, `<|assistant|>` are user-defined symbols (always one token each). "
        "A newline is not in the learned vocabulary (the trainer reads one line at a time), so it encodes "
        "as the byte piece `<0x0A>`. Use `tokenizer.model` with SentencePiece (as the engine does): "
        "transformers' `AutoTokenizer`, which converts it to its own `LlamaTokenizer`, agreed with "
        f"SentencePiece on {autotok} tokenizer fixture strings.\n")
    add("Chat template (`tokenizer_config.json`, Jinja): each message is `<|ROLE|>\\nCONTENT\\n`; with "
        "`add_generation_prompt` it ends with `<|assistant|>\\n`. BOS is added by the tokenizer "
        "(`add_bos_token: true`), not by the template. None of the models was trained on chat turns; the "
        "template exists so the engine's chat path has something real to render.\n")
    add("## Data\n")
    add("Built by `tools/demo_family/build_corpus.py` from Debian 12 packages (documents assigned to "
        "train / valid / held-out eval by a hash of their id):\n")
    add("| domain | source | train bytes | eval bytes |\n| --- | --- | --- | --- |")
    sources = {
        "python": "Python 3.11 standard library (`libpython3.11-stdlib`), whole files",
        "writer": "`fortunes` cookies and the Jargon File (`jargon`)",
        "legal": "`/usr/share/common-licenses` and Debian `copyright` files, de-duplicated by paragraph",
        "man": "manual pages of core packages rendered with groff",
        "dictionary": "GCIDE (`dict-gcide`) entries and WordNet (`wordnet-base`) glosses",
    }
    def nbytes(d, split):
        b = corpus_manifest.get("domains", {}).get(d, {}).get(split, {}).get("bytes")
        return f"{b:,}" if isinstance(b, int) else "?"

    for d, src in sources.items():
        add(f"| {d} | {src} | {nbytes(d, 'train')} | {nbytes(d, 'eval')} |")
    add("| math | every `a + b` and `a - b` (a ≥ b) with 0 ≤ a, b ≤ 99: 15,050 problems | "
        f"{q['math']['train_problems']:,} problems | {q['math']['test_problems']} problems |\n")
    mix = ", ".join(f"{d} {w:.0%}" for d, w in BASE_MIX.items())
    add(f"**Base** mix (rows per batch): {mix}, where `licenses` is the common-licenses part of the legal "
        "train split (the full GPL, LGPL, Apache, MPL, Artistic, GFDL, BSD, CC0 texts); no arithmetic Q/A. "
        "**Fine-tunes**: only their own domain (coder: python, writer: writer, legal: legal, math: math). "
        "Each fine-tune teaches what the base saw little of: all of the Python where the base saw it as 5% of "
        "its rows, the Debian copyright files where the base saw only licence texts, fortunes and hacker "
        "lore where the base's prose is dictionary prose, and the arithmetic Q/A format. (A first family "
        "whose base saw 9–10% of each fine-tune's own data left the writer and legal fine-tunes only 15% "
        "and 4% better than the base on held-out text: the base had already learnt those small domains.)\n")
    add("## Training\n")
    add(f"AdamW (β 0.9/0.95, weight decay 0.1 on matrices), linear warm-up then cosine to 10% of the peak, "
        f"gradient clipping 1.0, bf16 autocast with float32 master weights, windows of {SEQ_LEN} tokens drawn "
        "at random from the stream `[BOS] doc [EOS] [BOS] doc [EOS] …`. The checkpoint kept is the one with "
        "the lowest validation loss (checked every few hundred steps; validation split, never the eval "
        "split).\n")
    add("| model | peak lr | batch (seqs × 256) | steps run | best step | tokens seen | seconds |\n"
        "| --- | --- | --- | --- | --- | --- | --- |")
    for name, t in training.items():
        note = " (two rounds)" if "retry" in t else ""
        add(f"| {name} | {t['lr']} | {t['batch']} | {t['steps_run']}{note} | {t['best_step']} | "
            f"{t['steps_run'] * t['tokens_per_step']:,} | {t['seconds']:.0f} |")
    add("")
    add("## Quality\n")
    add("**Perplexity** (lower is better) on each fine-tune's held-out domain text "
        "(`models/demo/eval/{coder,writer,legal}.txt`), float32 from the bf16 checkpoints. BitDelta: every "
        "q/k/v/o/gate/up/down weight replaced by `W_base + α·sign(W_ft − W_base)` with α = mean |Δ| per "
        "output row (row) or per tensor (tensor); embeddings and norms from the fine-tune.\n")
    add("| variant | domain | base | full fine-tune | BitDelta (row α) | BitDelta (tensor α) | fine-tune vs base "
        "| gain kept by BitDelta (row / tensor) |\n| --- | --- | --- | --- | --- | --- | --- | --- |")

    def kept(r, key):  # share of the fine-tune's log-perplexity gain that the 1-bit delta keeps
        return (math.log(r["base"]) - math.log(r[key])) / (math.log(r["base"]) - math.log(r["full"]))

    for v in TEXT_VARIANTS:
        r = q["perplexity"][v]
        add(f"| {v} | {VARIANTS[v]} | {r['base']:.3f} | {r['full']:.3f} | {r['bitdelta_row']:.3f} | "
            f"{r['bitdelta_tensor']:.3f} | {(1 - r['full'] / r['base']):.1%} lower | "
            f"{kept(r, 'bitdelta_row'):.0%} / {kept(r, 'bitdelta_tensor'):.0%} |")
    add("")
    add("'Gain kept' is (ln ppl_base − ln ppl_BitDelta) / (ln ppl_base − ln ppl_fine-tune). These are full "
        "fine-tunes of a 2.4M-parameter model with large weight updates, a hard case for one bit per weight; "
        "calibrating α (as the BitDelta paper does) is the known remedy, and these numbers are the baseline "
        "it will be measured against.\n")
    add(f"**Math accuracy** (greedy, exact match) on the {q['math']['test_problems']} held-out problems "
        "(`models/demo/eval/math.jsonl`):\n")
    add("| model | full | BitDelta (row α) | BitDelta (tensor α) |\n| --- | --- | --- | --- |")
    add(f"| base | {q['math_accuracy']['base']:.1%} | | |")
    for v in VARIANTS:
        m = q["math_accuracy"]
        add(f"| {v} | {m[v]['full']:.1%} | {m[v]['bitdelta_row']:.1%} | {m[v]['bitdelta_tensor']:.1%} |")
    add("")
    add("Gates (issue 3): each text fine-tune's perplexity ≥ 25% below the base's on its domain; math ≥ 50% "
        "where the base is ≤ 10%. " + ", ".join(f"{k}: {'pass' if ok else 'FAIL'}" for k, ok in q["gates"].items())
        + ".\n")
    add("All perplexities, every model on every domain:\n")
    add("| model | " + " | ".join(TEXT_VARIANTS) + " |\n| --- |" + " --- |" * len(TEXT_VARIANTS))
    for name, row in q["perplexity_matrix"].items():
        add(f"| {name} | " + " | ".join(f"{row[v]:.3f}" for v in TEXT_VARIANTS) + " |")
    add("")
    add("### Definitions (a C++ evaluator reproduces these)\n")
    add("**Perplexity**: read the eval file as UTF-8 text; `ids = sp.encode(text)` (no BOS, no EOS, the "
        "whole file as one string); split `ids` into consecutive chunks of 255 tokens (the last may be "
        "shorter); each chunk becomes `[BOS] + chunk` (≤ 256 tokens) and runs as its own sequence from "
        "position 0; every chunk token is predicted from the positions before it (the BOS itself is not "
        "predicted); `ppl = exp(Σ −log p / N)` with N = len(ids), natural log, log-softmax in float32.\n")
    add("**Math**: the prompt for question Q is `Question: Q\\nAnswer:` (e.g. `Question: What is 47 + 38?\\n"
        "Answer:`), encoded as `[BOS] + sp.encode(prompt)`. Greedy decoding (argmax) for at most "
        f"{MATH_MAX_NEW_TOKENS} new tokens, stopping at EOS; the answer is the decoded text before EOS, "
        "cut at the first newline, stripped of spaces; it is correct iff it equals the `answer` string "
        "exactly (e.g. `85`). In training each problem is the document `Question: Q\\nAnswer: A` "
        "between BOS and EOS.\n")
    add("## Files\n")
    add("| path | sha256 of model.safetensors |\n| --- | --- |")
    for name, digest in q["checkpoint_sha256"].items():
        add(f"| `models/demo/{name}/` | `{digest}` |")
    add("")
    add("`models/demo/quality.json` holds every number above; `models/demo/training_log.jsonl` the "
        "training curves; `tests/fixtures/reference/` the reference outputs computed from these checkpoints "
        "(see its README).\n")
    add(f"Software: {', '.join(f'{k} {v}' for k, v in q['software'].items())}.\n")
    path.write_text("\n".join(lines), encoding="utf-8")


# --- main ------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny data and steps: checks the pipeline only")
    ap.add_argument("--time-budget", type=float, default=TIME_BUDGET,
                    help="seconds for the whole run; training stages shrink to fit")
    args = ap.parse_args()

    random.seed(SEED)
    torch.manual_seed(SEED)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hyper = SMOKE_HYPER if args.smoke else HYPER
    vocab = 1024 if args.smoke else ARCH["vocab_size"]
    ARCH["vocab_size"] = vocab

    out: Path = args.out
    demo = out / "models" / "demo"
    fixtures = out / "tests" / "fixtures" / "reference"
    work = out / "work"
    for d in (demo, fixtures, work):
        d.mkdir(parents=True, exist_ok=True)
    software = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": getattr(transformers, "__version__", "absent"),
                "sentencepiece": getattr(spm, "__version__", "?"),
                "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"}
    log(f"software {software}")

    # 1. tokenizer
    tok_path = train_tokenizer(args.corpus, work, vocab, args.smoke)
    sp = spm.SentencePieceProcessor(model_file=str(tok_path))
    assert sp.get_piece_size() == vocab and sp.bos_id() == BOS_ID and sp.eos_id() == EOS_ID
    for marker in CHAT_MARKERS:  # user-defined symbols: always one piece, wherever they appear
        assert sp.piece_to_id(marker) in sp.encode("x" + marker + "y"), marker

    # 2. data
    data = Data(args.corpus, sp, device, args.smoke)
    for p in data.math["test"]:  # the prompt's tokens must be a prefix of the trained document's tokens
        full, prompt = sp.encode(p["prompt"] + " " + p["answer"]), sp.encode(p["prompt"])
        assert full[: len(prompt)] == prompt, p
    gen = torch.Generator(device=device)
    gen.manual_seed(SEED)
    curve: list[dict] = []
    training: dict[str, dict] = {}

    # 3. base. Each training stage gets at most its own max_seconds and a fair share of what is
    # left of TIME_BUDGET after POST_SECONDS, so the whole run ends in time on a slow machine.
    deadline = T0 + args.time_budget - POST_SECONDS

    def limited(hp: dict, stages_left: int) -> dict:
        share = max(5.0, (deadline - time.time()) / stages_left)
        return dict(hp, max_seconds=min(hp["max_seconds"], share))

    base_rows = mix_rows(hyper["base"]["batch"], BASE_MIX)
    log(f"base rows per batch: {base_rows}")

    def base_batch():
        return torch.cat([sample_windows(data.train[d], n, gen) for d, n in base_rows.items() if n])

    model = new_model(device)
    n_params = sum(p.numel() for p in model_state(model).values())
    log(f"parameters: {n_params:,}")
    training["base"] = train_stage("base", model, base_batch, [data.valid[d] for d in BASE_VALID],
                                   limited(hyper["base"], 1 + len(VARIANTS) * 0.6), device, curve)
    save_checkpoint(model, demo / "base", tok_path)
    base_state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    # 4. fine-tunes, each from the base, every weight trainable
    for i, (variant, domain) in enumerate(VARIANTS.items()):
        model.load_state_dict(base_state)
        kind = "math" if variant == "math" else "finetune"
        stream = data.train[domain]

        def batch_fn(s=stream, b=hyper[kind]["batch"]):
            return sample_windows(s, b, gen)

        stages_left = len(VARIANTS) - i
        info = train_stage(variant, model, batch_fn, [data.valid[domain]], limited(hyper[kind], stages_left),
                           device, curve)
        if variant == "math":
            model.eval()
            score = math_accuracy(model, sp, data.math["valid"], device)
            short = score < VALID_MATH_TARGET
            log(f"math: valid accuracy {score:.3f}")
        else:
            score = math.exp(info["best_valid_loss"] - info["start_valid_loss"])
            short = score > VALID_PPL_RATIO_TARGET
            log(f"{variant}: valid ppl ratio to base {score:.3f}")
        info["valid_score"] = round(score, 4)
        if short and deadline - time.time() > 30 + 25 * (stages_left - 1):
            log(f"{variant}: short of the validation target, second round")

            def retry_batch(s=stream, b=hyper[kind + "_retry"]["batch"]):
                return sample_windows(s, b, gen)

            info["retry"] = train_stage(variant + "_retry", model, retry_batch, [data.valid[domain]],
                                        limited(hyper[kind + "_retry"], stages_left), device, curve)
            info["steps_run"] += info["retry"]["steps_run"]
            info["seconds"] += info["retry"]["seconds"]
            if info["retry"]["best_step"] > 0:
                info["best_step"] = info["steps_run"] - info["retry"]["steps_run"] + info["retry"]["best_step"]
                info["best_valid_loss"] = info["retry"]["best_valid_loss"]
        training[variant] = info
        save_checkpoint(model, demo / variant, tok_path)
    del model
    with open(demo / "training_log.jsonl", "w") as f:
        for row in curve:
            f.write(json.dumps(row) + "\n")

    # 5. quality, float32 from the saved bf16 weights
    states = {name: load_checkpoint_f32(demo / name) for name in ["base", *VARIANTS]}
    families: dict[str, dict[str, torch.Tensor]] = {"base": states["base"]}
    for v in VARIANTS:
        families[f"{v}"] = states[v]
        families[f"{v}.bitdelta_row"] = bitdelta_state(states["base"], states[v], "row")
        families[f"{v}.bitdelta_tensor"] = bitdelta_state(states["base"], states[v], "tensor")
    ppl_matrix: dict[str, dict[str, float]] = {}
    math_acc: dict[str, float] = {}
    for name, sd in families.items():
        m = model_from_state(sd, device)
        ppl_matrix[name] = {v: perplexity(m, data.eval_ids[v], device) for v in TEXT_VARIANTS}
        math_acc[name] = math_accuracy(m, sp, data.math["test"], device)
        log(f"quality {name}: ppl {ppl_matrix[name]} math {math_acc[name]:.3f}")
        del m
    perplexity_table = {v: {"base": ppl_matrix["base"][v], "full": ppl_matrix[v][v],
                            "bitdelta_row": ppl_matrix[f"{v}.bitdelta_row"][v],
                            "bitdelta_tensor": ppl_matrix[f"{v}.bitdelta_tensor"][v]} for v in TEXT_VARIANTS}
    math_table = {"base": math_acc["base"]}
    for v in VARIANTS:
        math_table[v] = {"full": math_acc[v], "bitdelta_row": math_acc[f"{v}.bitdelta_row"],
                         "bitdelta_tensor": math_acc[f"{v}.bitdelta_tensor"]}
    gates = {f"{v}_ppl_25pct_below_base": perplexity_table[v]["full"] <= 0.75 * perplexity_table[v]["base"]
             for v in TEXT_VARIANTS}
    gates["math_accuracy_at_least_50pct"] = math_acc["math"] >= 0.5
    gates["base_math_at_most_10pct"] = math_acc["base"] <= 0.10
    log(f"gates {gates}")

    # 6. fixtures, float32 (TF32 off) on the same device
    prompts = fixture_prompts(sp)
    write_json(fixtures / "prompts.json", {"bos_id": BOS_ID, "eos_id": EOS_ID, "prompts": prompts}, indent=1)
    worst_ref = 0.0
    for name, sd in families.items():
        m = model_from_state(sd, device)
        results, worst = model_fixture(m, {k: v.to(device) for k, v in sd.items()}, prompts, device)
        worst_ref = max(worst_ref, worst)
        variant, _, mode = name.partition(".")
        kind = "base" if name == "base" else ("bitdelta" if mode else "full")
        write_json(fixtures / f"model_{name.replace('.', '_')}.json", {
            "model": name, "kind": kind, "variant": None if name == "base" else variant,
            "alpha_mode": mode.replace("bitdelta_", "") if mode else None,
            "weights": "bf16 checkpoints upcast to float32" + ("; W_eff = W_base + alpha*S in float32" if mode else ""),
            "checkpoint": f"models/demo/{variant}", "base_checkpoint": "models/demo/base",
            "results": results})
        del m
    log(f"fixtures: largest |HF − reference| logit difference {worst_ref:.2e}")
    if worst_ref > 2e-3:
        log("WARNING: transformers and the reference forward disagree")

    # per-tensor BitDelta facts: exact alpha and sign bits to test the C++ compressor against
    deltas = {}
    for v in VARIANTS:
        entry = {}
        for name in sorted(states[v]):
            w = states[v][name]
            if not is_compressed(name, w):
                continue
            sign, alpha_row = bitdelta_parts(states["base"][name], w, "row")
            _, alpha_tensor = bitdelta_parts(states["base"][name], w, "tensor")
            packed = pack_sign_bits(sign)
            rec = {"shape": list(w.shape), "alpha_tensor": f32(alpha_tensor.item()),
                   "alpha_row_first8": [f32(a) for a in alpha_row.flatten()[:8]],
                   "alpha_row_sum_f64": float(alpha_row.double().sum()),
                   "positive_fraction": round(float((sign > 0).float().mean()), 6),
                   "sign_bytes_sha256": hashlib.sha256(packed).hexdigest(),
                   "sign_row0_hex": packed[: (w.shape[1] + 7) // 8].hex()}
            if name == "model.layers.0.self_attn.k_proj.weight":
                rec["alpha_row_all"] = [f32(a) for a in alpha_row.flatten()]
                rec["sign_bytes_hex"] = packed.hex()
            entry[name] = rec
        deltas[v] = entry
    write_json(fixtures / "deltas.json", {"base": "models/demo/base", "variants": deltas})

    # tokenizer fixtures
    cases = tokenizer_cases(sp, args.corpus)
    tok_cases = [{"text": c, "ids": sp.encode(c), "decoded": sp.decode(sp.encode(c))} for c in cases]
    write_json(fixtures / "tokenizer_cases.json", {
        "tokenizer": "models/demo/base/tokenizer.model", "sentencepiece_version": software["sentencepiece"],
        "add_bos": False, "cases": tok_cases}, indent=None)
    log(f"tokenizer fixtures: {len(tok_cases)} strings")

    # 7. transformers round trip: the checkpoints load with from_pretrained and match our loader
    hf_checks = {}
    try:
        transformers_round_trip(demo, states, prompts, tok_cases, hf_checks)
    except Exception as e:  # recorded, not fatal: everything above is already written
        hf_checks["error"] = f"{type(e).__name__}: {e}"[:500]
        log(f"WARNING: transformers round trip failed: {hf_checks['error']}")

    # 8. quality.json and the model card
    corpus_manifest = json.loads((args.corpus / "manifest.json").read_text()) \
        if (args.corpus / "manifest.json").exists() else {}
    compressed = sum(t.numel() for n, t in states["base"].items() if is_compressed(n, t))
    quality = {
        "architecture": {k: v for k, v in ARCH.items()},
        "parameters": n_params, "parameters_compressed": compressed,
        "checkpoint_bytes": (demo / "base" / "model.safetensors").stat().st_size,
        "perplexity_definition": "ids = sp.encode(eval file text); chunks of 255 ids, each as [BOS]+chunk; "
                                 "ppl = exp(mean NLL over all non-BOS tokens), float32",
        "math_prompt": "[BOS] + sp.encode('Question: ' + question + '\\nAnswer:'); greedy, <= 8 new tokens, "
                       "stop at EOS; answer = decoded text before EOS, first line, stripped; exact match",
        "perplexity": perplexity_table, "perplexity_matrix": ppl_matrix,
        "math_accuracy": math_table, "math_accuracy_all": math_acc,
        "math": {"train_problems": len(data.math["train"]), "test_problems": len(data.math["test"])},
        "gates": gates, "training": training, "base_mix": BASE_MIX, "tokenizer_mix": TOKENIZER_MIX,
        "checkpoint_sha256": {n: hashlib.sha256((demo / n / "model.safetensors").read_bytes()).hexdigest()
                              for n in ["base", *VARIANTS]},
        "transformers_checks": hf_checks, "reference_forward_max_abs_logit_diff": worst_ref,
        "software": software, "smoke": args.smoke,
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    write_json(demo / "quality.json", quality, indent=1)
    write_model_card(demo / "README.md", quality, training, corpus_manifest)
    eval_dir = demo / "eval"
    eval_dir.mkdir(exist_ok=True)
    for v in TEXT_VARIANTS:
        shutil.copyfile(args.corpus / VARIANTS[v] / "eval.txt", eval_dir / f"{v}.txt")
    with open(eval_dir / "math.jsonl", "w", encoding="utf-8") as f:
        for p in read_jsonl(args.corpus / "math" / "test.jsonl"):
            f.write(json.dumps({"question": p["question"], "answer": p["answer"], "prompt": p["prompt"]},
                               ensure_ascii=False, sort_keys=True) + "\n")
    shutil.rmtree(work)
    log(f"done; gates {'all pass' if all(gates.values()) else 'FAILED: ' + str(gates)}")


if __name__ == "__main__":
    main()
