"""molmo2: is a batch of two image prompts read right when image_token_pooling is concatenated as is
(specdec's batch_model_inputs) vs offset by the first prompt's patch count (16)?"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from sweep import last_logits, two_image_batch

model, e1, e2, ids, mask, alone = two_image_batch("molmo2_no_type_ids")
base = {k: torch.cat([e1[k], e2[k]]) for k in e1}
as_is = last_logits(model, ids, base, mask)
off = dict(base)
off["image_token_pooling"] = torch.cat([e1["image_token_pooling"], e2["image_token_pooling"] + 16])
offset = last_logits(model, ids, off, mask)
print("row1 |batched-as-is - alone| =", (as_is[1] - alone[1]).abs().max().item())
print("row1 |batched-offset - alone| =", (offset[1] - alone[1]).abs().max().item())
print("row0 as-is/offset:", (as_is[0] - alone[0]).abs().max().item(), (offset[0] - alone[0]).abs().max().item())
