"""Models with the structure of real ones, for tests and benchmarks: BatchNorm, residual Adds, deep
transformer stacks with unused heads and outlier channels.

They are random-initialised from a fixed seed (no weights ship), then given the statistics that trained
models have and small models trained here lack:

- ``deep_encoder``: a ``transformers`` ``BertModel`` (6 layers, hidden 384, 12 heads, intermediate 1536)
  behind mean pooling and L2 normalisation, so its pooler runs in ``forward`` but nothing uses its output.
  Like pretrained BERTs it has a few residual-stream channels whose LayerNorm gain is an order of magnitude
  above the rest (they dominate the inputs of q/k/v and the FFN up-projections), and a few FFN channels whose
  GELU outputs are outliers (the inputs of the down-projections). Per-tensor int8 with clipping methods
  (percentile, entropy) is visibly worse than max on it, as on pretrained models. Needs ``transformers``.
- ``resnet_cnn``: a ResNet-style 2-D CNN (stem, four basic blocks with BatchNorm and residual Adds, one
  strided with a 1x1 projection shortcut, global average pooling, a linear head) on 3x32x32 images.
- ``bit_resnet``: a BiT-shaped (ResNetV2) CNN whose convolutions standardise their weights in ``forward``
  (timm's ``StdConv2d``) between GroupNorm pre-activations, on the images ``resnet_batches`` makes.
- ``conv1d_bn``: six Conv1d + BatchNorm + ReLU + MaxPool stages and a linear head, on 8-channel signals.

BatchNorm layers get non-trivial running statistics and affine parameters, so folding them is not an
identity. Every factory takes ``seed``; each ``*_batches`` helper returns a list of ``{input name: tensor}``.
Use them as MODEL specs, e.g. ``quantcli calibrate sample_models.structured:resnet_cnn --data ...``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# -- deep_encoder ----------------------------------------------------------------------------------------

#: residual-stream channels given a large LayerNorm gain, as pretrained BERTs have (e.g. dim 308 of bert-base)
OUTLIER_DIMS = (17, 211, 302)
#: FFN intermediate channels whose pre-activation is scaled up, giving outlier GELU outputs
OUTLIER_FFN_CHANNELS = (5, 300, 777, 1200)


class MeanPooledEncoder(nn.Module):
    """``BertModel`` -> mean over the attention mask -> centring -> L2 normalisation: a sentence-embedding
    model.

    Inputs ``input_ids`` and ``attention_mask``, int64 ``(B, T)``; output float32 ``(B, hidden)``. ``center``
    is the mean pooled embedding of a reference set (as embedding pipelines centre or whiten): without it,
    every byte-level line shares one dominant direction and any two embeddings have cosine ~0.98.
    """

    def __init__(self, bert: nn.Module):
        super().__init__()
        self.bert = bert
        self.register_buffer("center", torch.zeros(bert.config.hidden_size))

    def pooled(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(self.pooled(input_ids, attention_mask) - self.center, dim=-1)


def deep_encoder(
    seed: int = 0, layers: int = 6, hidden: int = 384, heads: int = 12, intermediate: int = 1536
) -> MeanPooledEncoder:
    """A 6-layer BERT sentence encoder with pretrained-like outlier channels and an unused pooler."""
    try:
        from transformers import BertConfig
    except ImportError as e:  # pragma: no cover - the test extra installs it
        raise ImportError("deep_encoder needs transformers: pip install 'quantcli[hf]'") from e
    from sample_models.text_encoder import MAX_LEN, VOCAB

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        max_position_embeddings=MAX_LEN,
        initializer_range=0.04,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    return seeded_encoder(
        config, seed, _plant_outliers, deep_encoder_batches("calib", 64), add_pooling_layer=True
    )


def seeded_encoder(
    config, seed: int, statistics, calib: list[dict[str, torch.Tensor]], add_pooling_layer: bool
) -> MeanPooledEncoder:
    """A ``BertModel(config)`` initialised from ``seed`` (the global RNG left as it was), given its weight
    statistics by ``statistics(bert, generator)``, mean-pooled and centred on the ``calib`` batches."""
    from transformers import BertModel

    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        bert = BertModel(config, add_pooling_layer=add_pooling_layer)
        statistics(bert, torch.Generator().manual_seed(seed + 1))
    finally:
        torch.random.set_rng_state(state)
    model = MeanPooledEncoder(bert).eval()
    with torch.no_grad():
        model.center.copy_(torch.cat([model.pooled(**b) for b in calib]).mean(0))
    return model


@torch.no_grad()
def _plant_outliers(bert: nn.Module, gen: torch.Generator) -> None:
    dims = list(OUTLIER_DIMS)
    norms = [bert.embeddings.LayerNorm]
    for layer in bert.encoder.layer:
        norms += [layer.attention.output.LayerNorm, layer.output.LayerNorm]
    for i, norm in enumerate(norms):
        # gains ~ U(0.8, 1.2) elsewhere, 8-14 on the outlier channels, with a bias that keeps them off-centre
        norm.weight.copy_(0.8 + 0.4 * torch.rand(norm.weight.shape, generator=gen))
        norm.bias.copy_(0.1 * torch.randn(norm.bias.shape, generator=gen))
        if i == len(norms) - 1:
            # the last LayerNorm feeds the embedding itself: outlier channels or a common bias there would
            # dominate every embedding (and make every cosine near 1)
            norm.bias.zero_()
            break
        norm.weight[dims] = 3.0 + 2.0 * torch.rand(len(dims), generator=gen)
        norm.bias[dims] = torch.tensor([-2.0, 1.5, 2.5])[: len(dims)]
    for layer in bert.encoder.layer:
        up, down = layer.intermediate.dense, layer.output.dense
        ch = list(OUTLIER_FFN_CHANNELS)
        up.weight[ch] *= 8.0
        up.bias[ch] = 2.0
        # the down-projection reads those channels with ordinary weights: their outliers reach its output
        # as pretrained models' do, without blowing up the residual stream
        down.weight[:, ch] *= 0.1


def deep_encoder_batches(
    split: str = "calib", num_samples: int | None = None
) -> list[dict[str, torch.Tensor]]:
    """Byte-level token batches of CPython standard-library lines (``text_encoder``'s bundled data).

    ``split``: ``"calib"`` (256 lines, 8 batches) or ``"eval"`` (600 held-out lines, 12 batches); sequence
    lengths differ per batch. ``num_samples`` keeps the first batches up to that many lines.
    """
    from sample_models import text_encoder

    batches = text_encoder.calibration_batches() if split == "calib" else text_encoder.evaluation_batches()
    return _first_samples(batches, num_samples)


# -- resnet_cnn ------------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """conv-bn-relu-conv-bn + shortcut, then relu (torchvision's BasicBlock layout)."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNetCNN(nn.Module):
    """Input ``x`` float32 ``(N, 3, 32, 32)``; output ``(N, classes)`` logits."""

    def __init__(self, width: int = 32, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(2)
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, stride=2), BasicBlock(2 * width, 2 * width))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet_cnn(seed: int = 0, width: int = 32) -> ResNetCNN:
    return _seeded(lambda: ResNetCNN(width), seed)


def resnet_batches(
    num_samples: int = 512, batch_size: int = 64, split: str = "calib"
) -> list[dict[str, torch.Tensor]]:
    """scikit-learn's bundled digits (shipped in ``sample_models/data``) upsampled to 3x32x32 and normalised.

    ``split``: ``"calib"`` (the 512 calibration images, repeated with flips if more are asked for) or
    ``"eval"`` (held-out images).
    """
    from sample_models import digits_cnn

    with np.load(digits_cnn.SPLITS) as z:
        pixels = z[f"{split}_x"].astype(np.float32) / 16.0
    x = torch.from_numpy(pixels).reshape(-1, 1, 8, 8)
    x = torch.nn.functional.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
    x = torch.cat([x, x.flip(-1), x.flip(-2)], dim=1)  # three different "colour" planes
    x = (x - 0.25) / 0.35
    while x.shape[0] < num_samples:
        x = torch.cat([x, x.flip(-1)])
    return [{"x": b} for b in x[:num_samples].split(batch_size)]


# -- bit_resnet ------------------------------------------------------------------------------------------


class StdConv2d(nn.Conv2d):
    """A convolution of its weight standardised per output channel on every call, as timm's ``StdConv2d``
    (BiT, NFNet) computes it."""

    def __init__(self, *args, eps: float = 1e-8, **kwargs):
        super().__init__(*args, **kwargs)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.weight.reshape(1, self.out_channels, -1)
        w = F.batch_norm(flat, None, None, training=True, momentum=0.0, eps=self.eps).reshape_as(self.weight)
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class PreActBlock(nn.Module):
    """BiT's pre-activation bottleneck: GroupNorm-ReLU before each standardised convolution."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        mid = cout // 4
        self.norm1, self.conv1 = nn.GroupNorm(8, cin), StdConv2d(cin, mid, 1, bias=False)
        self.norm2, self.conv2 = nn.GroupNorm(8, mid), StdConv2d(mid, mid, 3, stride, 1, bias=False)
        self.norm3, self.conv3 = nn.GroupNorm(8, mid), StdConv2d(mid, cout, 1, bias=False)
        self.downsample = StdConv2d(cin, cout, 1, stride, bias=False) if stride != 1 or cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = F.relu(self.norm1(x))
        shortcut = x if self.downsample is None else self.downsample(pre)
        out = self.conv1(pre)
        out = self.conv2(F.relu(self.norm2(out)))
        out = self.conv3(F.relu(self.norm3(out)))
        return out + shortcut


class BiTResNet(nn.Module):
    """A BiT-shaped (ResNetV2) network: standardised convolutions, GroupNorm. Input ``x`` float32 ``(N, 3, 32,
    32)``; output ``(N, classes)`` logits."""

    def __init__(self, width: int = 32, classes: int = 10):
        super().__init__()
        self.stem = StdConv2d(3, width, 3, padding=1, bias=False)
        self.stages = nn.Sequential(
            PreActBlock(width, 4 * width),
            PreActBlock(4 * width, 4 * width),
            PreActBlock(4 * width, 8 * width, stride=2),
            PreActBlock(8 * width, 8 * width),
        )
        self.norm = nn.GroupNorm(8, 8 * width)
        self.fc = nn.Linear(8 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm(self.stages(self.stem(x))))
        return self.fc(x.mean((2, 3)))


def bit_resnet(seed: int = 0, width: int = 32) -> BiTResNet:
    return _seeded(lambda: BiTResNet(width), seed)


# -- conv1d_bn -------------------------------------------------------------------------------------------


class Conv1dBN(nn.Module):
    """Input ``x`` float32 ``(N, 8, 512)``; six Conv1d+BN+ReLU+MaxPool(2) stages; output ``(N, classes)``."""

    def __init__(self, channels: int = 8, width: int = 64, stages: int = 6, classes: int = 5):
        super().__init__()
        layers: list[nn.Module] = []
        cin = channels
        for i in range(stages):
            cout = width if i < stages // 2 else 2 * width
            layers += [nn.Conv1d(cin, cout, 5, padding=2), nn.BatchNorm1d(cout), nn.ReLU(), nn.MaxPool1d(2)]
            cin = cout
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(-1))


def conv1d_bn(seed: int = 0) -> Conv1dBN:
    return _seeded(Conv1dBN, seed)


def conv1d_batches(
    num_samples: int = 512, batch_size: int = 64, seed: int = 0, length: int = 512
) -> list[dict[str, torch.Tensor]]:
    """Deterministic synthetic sensor signals: per channel a few sinusoids plus noise, ``(B, 8, length)``."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(length, dtype=torch.float32) / length
    freq = 1 + 40 * torch.rand(num_samples, 8, 3, 1, generator=g)
    phase = 6.2832 * torch.rand(num_samples, 8, 3, 1, generator=g)
    amp = torch.rand(num_samples, 8, 3, 1, generator=g)
    x = (amp * torch.sin(6.2832 * freq * t + phase)).sum(2) + 0.1 * torch.randn(
        num_samples, 8, length, generator=g
    )
    return [{"x": b} for b in x.split(batch_size)]


# -- convnext_style --------------------------------------------------------------------------------------


class ConvNeXtBlock(nn.Module):
    """ConvNeXt's block: depthwise 7x7, channels-last LayerNorm, pointwise Linear 4x, GELU, Linear, layer
    scale, residual."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pwconv2(nn.functional.gelu(self.pwconv1(self.norm(y))))
        return x + (self.gamma * y).permute(0, 3, 1, 2)


class ConvNeXtStyle(nn.Module):
    """Input ``x`` float32 ``(N, 3, 32, 32)``; a 4x4 stride-4 stem, three ConvNeXt blocks, pooled LayerNorm
    and a classifier (``(N, classes)`` logits). Issue 36's saturation case: its pointwise Linears' u8s8
    kernels saturate on x86 CPUs without VNNI with 8-bit weights."""

    def __init__(self, dim: int = 32, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 4, stride=4)
        self.stem_norm = nn.LayerNorm(dim, eps=1e-6)
        self.blocks = nn.Sequential(ConvNeXtBlock(dim), ConvNeXtBlock(dim), ConvNeXtBlock(dim))
        self.head_norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem_norm(self.stem(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.head(self.head_norm(self.blocks(x).mean((2, 3))))


def convnext_style(seed: int = 0, dim: int = 32) -> ConvNeXtStyle:
    return _seeded(lambda: ConvNeXtStyle(dim), seed)


def random_images(num_samples: int, batch_size: int = 32, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Standard-normal ``(N, 3, 32, 32)`` inputs: a random network's data (``seed`` 0 calibrates, others hold
    out)."""
    g = torch.Generator().manual_seed(seed)
    return [{"x": b} for b in torch.randn(num_samples, 3, 32, 32, generator=g).split(batch_size)]


# -- shared ----------------------------------------------------------------------------------------------


def _seeded(make, seed: int) -> nn.Module:
    """Build under a fixed seed (the caller's RNG state comes back), then give every BatchNorm real
    statistics."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = make()
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    n = m.num_features
                    m.weight.copy_(0.5 + torch.rand(n, generator=gen))
                    m.bias.copy_(0.2 * torch.randn(n, generator=gen))
                    m.running_mean.copy_(0.2 * torch.randn(n, generator=gen))
                    m.running_var.copy_(0.5 + torch.rand(n, generator=gen))
    finally:
        torch.random.set_rng_state(state)
    return model.eval()


def _first_samples(
    batches: list[dict[str, torch.Tensor]], num_samples: int | None
) -> list[dict[str, torch.Tensor]]:
    if num_samples is None:
        return batches
    out, n = [], 0
    for b in batches:
        if n >= num_samples:
            break
        k = min(num_samples - n, next(iter(b.values())).shape[0])
        out.append({name: t[:k] for name, t in b.items()})
        n += k
    return out
