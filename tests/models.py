"""Small models the compiler tests train: each exercises a kind of weight the passes meet."""

import torch
import torch.nn.functional as F
from torch import nn


def mlp(bias: bool = True) -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16, bias=bias), nn.Tanh(), nn.Linear(16, 3, bias=bias))


def wide() -> nn.Module:
    """Layers much wider than the batch (2 rows): their gradients reach the runtime as factors."""
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))


class FrozenFirstLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(6, 12)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        return self.head(torch.relu(self.frozen(x)))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, kernel_size=3, padding=1)
        self.head = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        # No qkv bias: the key bias gets a gradient of pure rounding noise (softmax ignores a
        # shift of all keys), which Adam amplifies into kernel-dependent updates.
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """GPT-2 style: token and position embeddings, pre-LN blocks, LM head tied to the embedding."""

    def __init__(
        self, vocab: int = 32, width: int = 16, heads: int = 2, layers: int = 1, block: int = 8
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(block, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def batches(name: str, steps: int, seed: int = 1):
    """Deterministic (input, target) pairs for a model of ``tests.models``; inputs of the MLPs
    are scaled per feature so that column importances are well separated."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if name == "gpt":
            idx = torch.randint(0, 32, (4, 8), generator=g)
            out.append((idx, torch.randint(0, 32, (4, 8), generator=g)))
        elif name == "wide":
            scale = torch.linspace(0.2, 3.0, 16)
            out.append((torch.randn(2, 16, generator=g) * scale, torch.randn(2, 16, generator=g)))
        elif name == "conv":
            out.append((torch.randn(4, 2, 5, 5, generator=g), torch.randn(4, 3, generator=g)))
        else:
            scale = torch.linspace(0.2, 3.0, 6)
            out.append((torch.randn(8, 6, generator=g) * scale, torch.randn(8, 3, generator=g)))
    return out


def loss_of(name: str, model: nn.Module, inputs, targets) -> torch.Tensor:
    out = model(inputs)
    if name == "gpt":
        return F.cross_entropy(out.flatten(0, 1), targets.flatten())
    return F.mse_loss(out, targets)


MODELS = {
    "mlp": mlp,
    "mlp_nobias": lambda: mlp(bias=False),
    "wide": wide,
    "frozen": FrozenFirstLayer,
    "conv": ConvNet,
    "gpt": TinyGPT,
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()
