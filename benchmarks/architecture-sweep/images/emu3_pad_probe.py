"""emu3: do image 1's VQ tokens change when its pixel_values are zero-padded to image 2's width (as specdec batches them)?"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from sweep import build

spec, model = build("emu3")
torch.manual_seed(1)
p1 = spec.image_inputs(model, 1)
torch.manual_seed(2)
p2 = spec.image_inputs(model, 2)
padded = torch.zeros(2, 3, 32, 48)
padded[0, :, :, :32] = p1["pixel_values"][0]
padded[1] = p2["pixel_values"][0]
sizes = torch.cat([p1["image_sizes"], p2["image_sizes"]])
with torch.no_grad():
    alone = model.model.get_image_tokens(p1["pixel_values"], p1["image_sizes"])
    both = model.model.get_image_tokens(padded, sizes)
n = alone.numel()
print("alone tokens", n, "same in padded batch:", torch.equal(alone, both[:n]), "differing:", (alone != both[:n]).sum().item())
