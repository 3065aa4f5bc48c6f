"""A small Vision Transformer written the way PyTorch users write one (timm's shape, cut down), ported by the import
rule alone: in every import line ``torch`` became ``axonmpi`` (``tests/test_ported_models.py`` runs the same file
with the rule undone under torch).  What it holds that a model of the library's own layers does not:

* a class-token ``nn.Parameter`` of shape ``(1, 1, dim)``, ``expand``-ed over the batch and ``torch.cat``-ed before
  the patch tokens;
* a position ``nn.Parameter`` of shape ``(1, n_patch + 1, dim)`` broadcast-added over the batch;
* its own ``Attention`` (one ``qkv`` Linear, ``reshape`` / ``permute``, a softmax over all tokens: not causal);
* one LayerScale gain (``nn.Parameter`` of ``dim``) shared by two blocks;
* a 0-d learnable temperature (``logit_scale``, CLIP's) multiplying the logits by its ``exp()``;
* ``configure_optimizers`` choosing the decayed group as timm does: ``ndim <= 1``, a ``.bias`` or a name in
  ``no_weight_decay()`` is not decayed;
* ``pipeline_layers()`` (the documented protocol, docs/parallelize.md): a user who read it adds three lines.
"""
import math

import axonmpi as torch
import axonmpi.nn as nn
import axonmpi.nn.functional as F


class Attention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim, num_heads, gamma):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, 4 * dim)
        self.gamma = gamma                        # LayerScale: one Parameter, two blocks

    def forward(self, x):
        x = x + self.gamma * self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """The image as ``(B, n_patch, patch_dim)`` rows, projected; the class token and the positions added."""

    def __init__(self, vit):
        super().__init__()
        self.proj, self.cls_token, self.pos_embed = vit.proj, vit.cls_token, vit.pos_embed

    def forward(self, x):
        x = self.proj(x)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        return torch.cat((cls, x), dim=1) + self.pos_embed


class Head(nn.Module):
    def __init__(self, vit):
        super().__init__()
        self.norm, self.head, self.logit_scale = vit.norm, vit.head, vit.logit_scale

    def forward(self, x):
        return self.head(self.norm(x)[:, 0]) * self.logit_scale.exp()


class VisionTransformer(nn.Module):
    def __init__(self, n_patch=4, patch_dim=12, dim=16, depth=2, num_heads=2, num_classes=5):
        super().__init__()
        self.proj = nn.Linear(patch_dim, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, n_patch + 1, dim) * .02)
        gamma = nn.Parameter(torch.ones(dim) * 0.5)
        self.blocks = nn.ModuleList([Block(dim, num_heads, gamma) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(2.0)))
        nn.init.normal_(self.cls_token, std=.02)

    def no_weight_decay(self):
        return {"pos_embed", "cls_token"}

    def forward(self, x):
        x = PatchEmbed(self)(x)
        for blk in self.blocks:
            x = blk(x)
        return Head(self)(x)

    def pipeline_layers(self):
        return [PatchEmbed(self), *self.blocks, Head(self)]

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        skip = self.no_weight_decay()
        decay, no_decay = [], []
        for name, param in self.named_parameters():
            if not param.requires_grad:
                continue
            if param.ndim <= 1 or name.endswith(".bias") or name in skip:
                no_decay.append(param)
            else:
                decay.append(param)
        groups = [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)
