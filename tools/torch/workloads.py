"""Real PyTorch workloads built in code (no downloads), shared by the trace recorder
(tools/torch/record_traces.py) and the allocator comparison (issue 12).

Each workload is deterministic for a given seed: `run(name, steps, device)` returns a list of
per-step floats (losses, or a checksum of the decoded logits) so two allocators can be
compared for identical results. Sizes are chosen so one workload takes seconds on an H200.
"""
import math
import random

import torch
import torch.nn as nn
import torch.nn.functional as F


def set_deterministic(seed: int = 0) -> None:
    import os

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(seed)
    random.seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # The memory-efficient and flash attention backwards are not deterministic (two runs of
    # the transformer differed at step 3 on the H200): the math backend is. The traces in
    # bench/traces were recorded before this line, with PyTorch's default backends.
    for name in ("enable_flash_sdp", "enable_mem_efficient_sdp", "enable_cudnn_sdp"):
        if hasattr(torch.backends.cuda, name):
            getattr(torch.backends.cuda, name)(False)


# --- transformer training with varying sequence lengths -------------------------------
class TinyLM(nn.Module):
    def __init__(self, vocab=8192, d_model=768, heads=12, layers=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens):
        seq = tokens.shape[1]
        mask = torch.triu(torch.full((seq, seq), float("-inf"), device=tokens.device), 1)
        return self.head(self.blocks(self.embed(tokens), mask=mask, is_causal=True))


def transformer_training(steps: int, device: str, seed: int = 0):
    set_deterministic(seed)
    model = TinyLM().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random(seed)
    losses = []
    for _ in range(steps):
        seq = rng.choice([128, 192, 256, 384, 512, 768, 1024])
        batch = max(2, 8192 // seq)
        tokens = torch.randint(0, 8192, (batch, seq + 1), device=device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# --- autoregressive decode with caches grown by torch.cat -------------------------------
class DecoderLayer(nn.Module):
    def __init__(self, d_model, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))
        self.n1 = nn.LayerNorm(d_model)
        self.n2 = nn.LayerNorm(d_model)

    def forward(self, x, cache):
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).split(d, dim=-1)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.reshape(shape).transpose(1, 2) for z in (q, k, v))
        if cache is not None:  # the growing cache: a new tensor every token
            k = torch.cat([cache[0], k], dim=2)
            v = torch.cat([cache[1], v], dim=2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None)
        x = x + self.out(att.transpose(1, 2).reshape(b, t, d))
        x = x + self.mlp(self.n2(x))
        return x, (k, v)


class TinyDecoder(nn.Module):
    def __init__(self, vocab=8192, d_model=1024, heads=16, layers=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(DecoderLayer(d_model, heads) for _ in range(layers))
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens, caches):
        x = self.embed(tokens)
        new = []
        for layer, cache in zip(self.layers, caches):
            x, c = layer(x, cache)
            new.append(c)
        return self.head(x[:, -1]), new


@torch.no_grad()
def decode_growing_caches(steps: int, device: str, seed: int = 0):
    """`steps` requests; each decodes 64-192 tokens from a random prompt (batch 1-8)."""
    set_deterministic(seed)
    model = TinyDecoder().to(device).eval()
    rng = random.Random(seed)
    sums = []
    for _ in range(steps):
        batch = rng.choice([1, 2, 4, 8])
        prompt = torch.randint(0, 8192, (batch, rng.choice([32, 64, 128])), device=device)
        logits, caches = model(prompt, [None] * len(model.layers))
        total = 0.0
        for _ in range(rng.choice([64, 128, 192])):
            token = logits.argmax(-1, keepdim=True)
            logits, caches = model(token, caches)
            total += float(logits.float().sum().item()) * 1e-6
        sums.append(total)
        del caches
    return sums


@torch.no_grad()
def decode_streams(steps: int, device: str, seed: int = 0):
    """`steps` requests served four at a time, each on its own CUDA stream, one token of each
    in turn (a server without batching): each decodes 32-96 tokens from a random prompt
    (batch 1-8) with caches grown by torch.cat; a finished request's stream takes the next."""
    set_deterministic(seed)
    model = TinyDecoder().to(device).eval()
    torch.cuda.synchronize()
    rng = random.Random(seed)
    streams = [torch.cuda.Stream() for _ in range(4)]
    slots = [None] * len(streams)  # [logits, caches, tokens left]
    started = 0
    sums = []

    def start(i):
        nonlocal started
        with torch.cuda.stream(streams[i]):
            batch = rng.choice([1, 2, 4, 8])
            prompt = torch.randint(0, 8192, (batch, rng.choice([32, 64, 128])), device=device)
            logits, caches = model(prompt, [None] * len(model.layers))
        slots[i] = [logits, caches, rng.choice([32, 64, 96])]
        started += 1

    for i in range(len(streams)):
        if started < steps:
            start(i)
    while any(slot is not None for slot in slots):
        for i, slot in enumerate(slots):
            if slot is None:
                continue
            with torch.cuda.stream(streams[i]):
                token = slot[0].argmax(-1, keepdim=True)
                slot[0], slot[1] = model(token, slot[1])
                slot[2] -= 1
                if slot[2] == 0:
                    sums.append(float(slot[0].float().sum().item()) * 1e-6)
                    slots[i] = None
                    if started < steps:
                        start(i)
    torch.cuda.synchronize()
    return sums


# --- conv net training with varying batch and resolution --------------------------------
def conv_block(cin, cout, stride):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class TinyResNet(nn.Module):
    def __init__(self, classes=100):
        super().__init__()
        widths = [64, 128, 256, 512]
        layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(True)]
        cin = 64
        for i, w in enumerate(widths):
            layers += [conv_block(cin, w, 1 if i == 0 else 2), conv_block(w, w, 1)]
            cin = w
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(self.features(x).mean(dim=(2, 3)))  # deterministic backward


def conv_training(steps: int, device: str, seed: int = 0):
    set_deterministic(seed)
    model = TinyResNet().to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rng = random.Random(seed)
    losses = []
    for _ in range(steps):
        batch = rng.choice([8, 16, 32, 64])
        res = rng.choice([96, 128, 160, 192, 224, 256])
        x = torch.randn(batch, 3, res, res, device=device).to(memory_format=torch.channels_last)
        y = torch.randint(0, 100, (batch,), device=device)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


WORKLOADS = {
    "transformer_training": transformer_training,
    "decode_growing_caches": decode_growing_caches,
    "decode_streams": decode_streams,
    "conv_training": conv_training,
}


def run(name: str, steps: int, device: str = "cuda", seed: int = 0):
    return WORKLOADS[name](steps, device, seed)
