"""gemma4: batch of the two image prompts (16 and 24 patches) with image_position_ids padded by 0 (specdec's
batch_model_inputs) vs by -1 (gemma4's padding marker): does each row match its single-prompt logits?"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from sweep import last_logits, two_image_batch

model, e1, e2, ids, mask, alone = two_image_batch("gemma4")
pv = torch.zeros(2, 24, 48)
pv[0, :16] = e1["pixel_values"][0]
pv[1] = e2["pixel_values"][0]
for fill in (0, -1):
    pos = torch.full((2, 24, 2), fill)
    pos[0, :16] = e1["image_position_ids"][0]
    pos[1] = e2["image_position_ids"][0]
    try:
        out = last_logits(model, ids, {"pixel_values": pv, "image_position_ids": pos}, mask)
        print(f"pad {fill}: max |batched - alone| per row", [(out[r] - alone[r]).abs().max().item() for r in range(2)])
    except Exception as err:
        print(f"pad {fill}: {type(err).__name__}: {str(err)[:150]}")
